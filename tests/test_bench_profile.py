"""python -m pytest tests/test_bench_profile.py -q

bench/profile.py: the train step's ops from a jax.profiler trace, the runs of the step told apart on
a GPU (whose kernels carry no run number), and the experiments that put back what the step computed
before."""

import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from helpers import REPO, tiny_config

import model as model_lib
from bench import profile as bench_profile
from compute import layers
from model import GPT


def test_runs_apart_cuts_at_the_widest_gaps():
    """Three runs of ops, 1 apart inside a run and 50 or more between runs; an op that outlasts the
    next op's start (two streams) is no gap."""
    starts = [0, 1, 2, 60, 61, 62, 200, 201]
    ends = [1, 30, 3, 61, 62, 63, 201, 202]  # the second op ends at 30: from 2, 30 to 60 is the gap
    assert bench_profile.runs_apart(starts, ends, 3) == [(0, 3), (3, 6), (6, 8)]
    assert bench_profile.runs_apart(starts, ends, 2) == [(0, 6), (6, 8)]
    assert bench_profile.runs_apart(starts, ends, 1) == [(0, 8)]


@pytest.mark.slow  # a benchmark's whole tiny run: make test-slow (CI runs it)
def test_a_tiny_steps_profile_names_its_ops_and_reads_back(tmp_path):
    """The step's time and its ops by kind and by name, with the JAX source of some; --read of the
    kept trace reports the same."""
    xplane = str(tmp_path / "step.xplane.pb")
    common = ["--preset=tiny", "--steps=2", "--warmup=2", "--top=5"]
    p = subprocess.run(
        [sys.executable, "-m", "bench.profile", *common, f"--xplane={xplane}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout[p.stdout.index("traced: ") :]
    assert re.match(
        r"traced: [\d.]+ ms a step, ops busy [\d.]+ ms of it \(\d+%\), \d+ op runs a step\n", out
    ), out
    ops = out[out.index("op  (source)") :].splitlines()[1:]
    assert len(ops) == 5 and all(
        re.match(r" +[\d.]+ +[\d.]+% +\d+  \S+  \(.*\)$", line) for line in ops
    ), ops
    # the source, from the program kept beside it
    assert any("jit(leaves_step)/" in line for line in ops), ops
    r = subprocess.run(
        [sys.executable, "-m", "bench.profile", *common, f"--read={xplane}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0 and r.stdout == out, r.stderr[-3000:]


def test_the_experiments_put_back_float32_logits_and_autodiffs_gradient(monkeypatch):
    """--logits float32: the loss's logits out of the head in float32 again; --loss autodiff:
    layers.token_nll without its own gradient, the same forward."""
    monkeypatch.setattr(model_lib, "tied_head", model_lib.tied_head)  # put back after the test
    monkeypatch.setattr(layers, "token_nll", layers.token_nll)
    gpt = GPT(tiny_config(vocab_size=97, dtype="bfloat16"), nnx.Rngs(0))
    x = jnp.zeros((2, 16), jnp.int32)

    def logits_dtypes():
        jaxpr = str(jax.make_jaxpr(lambda: gpt.loss(x, x))())
        return {
            dtype for dtype in ("bf16", "f32") if f"{dtype}[2,16,97]" in jaxpr
        }, "token_nll" in jaxpr

    # the head's bf16, upcast in the loss's own function
    assert logits_dtypes() == ({"bf16", "f32"}, True)
    logits = 3 * jax.random.normal(jax.random.key(0), (4, 97))
    targets = jnp.arange(4)
    before = layers.token_nll(logits, targets)
    bench_profile.as_before("float32", "autodiff")
    assert logits_dtypes() == ({"f32"}, False)
    assert jnp.allclose(layers.token_nll(logits, targets), before)


# slow (make test-slow; CI runs it): an experiment's equivalence; the tool itself is the test below
@pytest.mark.slow
def test_the_three_projections_experiment_computes_the_same(monkeypatch):
    """--qkv three: q, k and v as three matmuls on the same kernel, for GPT-2 and the speedrun's
    rotary: the same loss and gradients as the one (B, T, 3C) projection split apart, and no (B, T,
    3C) array left, forward or backward."""
    monkeypatch.setattr(model_lib.CausalSelfAttention, "qkv", model_lib.CausalSelfAttention.qkv)
    for config in (tiny_config(), tiny_config(arch="speedrun", bias=False)):
        graphdef, params = nnx.split(GPT(config, nnx.Rngs(0)))
        params = jax.tree.map(
            lambda p: p + 0.01 * jax.random.normal(jax.random.key(1), p.shape), params
        )
        x = jax.random.randint(jax.random.key(2), (2, 16), 0, config.vocab_size)

        def loss(params):
            return nnx.merge(graphdef, params).loss(x, x)

        def has_qkv_array():
            return f"[2,16,{3 * config.n_embd}]" in str(jax.make_jaxpr(jax.grad(loss))(params))

        one = jax.value_and_grad(loss)(params)
        assert has_qkv_array()
        monkeypatch.setattr(model_lib.CausalSelfAttention, "qkv", model_lib.CausalSelfAttention.qkv)
        bench_profile.three_projections()
        three = jax.value_and_grad(loss)(params)
        assert not has_qkv_array()
        monkeypatch.undo()
        monkeypatch.setattr(model_lib.CausalSelfAttention, "qkv", model_lib.CausalSelfAttention.qkv)
        for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(three)):
            assert jnp.allclose(a, b, rtol=1e-5, atol=1e-6), (config.arch, jnp.abs(a - b).max())
