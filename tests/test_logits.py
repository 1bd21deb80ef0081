"""python -m pytest tests/test_logits.py -q

The GPT-2 model against transformers: logit parity on random HF checkpoints in fp32 and bf16
(parity/check_logits.py, in process and as its command), a swapped weight mapping caught, HF export
round trips, and the HF loader's bad input."""

import subprocess
import sys

import jax
import numpy as np
import pytest
import torch
from flax import nnx
from helpers import tiny_config
from jax.sharding import NamedSharding

from archs.models import load_pretrained
from compute import sharding
from configurator import exit_on_bad_input
from dataio.weights import load_hf_model
from model import GPT
from parity import check_logits
from parity.check_logits import check
from parity.common import save_random_hf_model


@pytest.mark.parametrize(
    "hf_kwargs, text",
    [
        # n_embd not a multiple of 64
        (dict(n_layer=1, n_head=2, n_embd=48, n_positions=24, vocab_size=128), ""),
        (dict(n_layer=3, n_head=4, n_embd=80, n_positions=40, vocab_size=301), ""),
        (
            dict(n_layer=2, n_head=2, n_embd=64, n_positions=64, vocab_size=50257),
            "Hello, I'm a language model,",
        ),
    ],
)
def test_logit_parity_random_checkpoints(tmp_path, hf_kwargs, text):
    path = save_random_hf_model(tmp_path / "hf", seed=1, **hf_kwargs)
    ok, figures = check(str(path), text=text, batch=3)
    assert ok, figures
    assert figures["top1"] == 1.0
    assert figures["max_rel"] < 3e-6


def test_bf16_parity_judged_against_fp32(tmp_path):
    path = save_random_hf_model(
        tmp_path / "hf", seed=2, n_layer=2, n_head=2, n_embd=64, n_positions=64, vocab_size=512
    )
    ok, figures = check(str(path), dtype="bfloat16", text="", batch=4)
    assert ok, figures
    assert figures["jax"]["max_rel"] > 0  # it really ran in bf16


def test_parity_detects_a_swapped_mapping(tmp_path, monkeypatch):
    """With every tensor random, swapping two rows of the weight map must fail the check (a check
    that cannot fail proves nothing; HF's own init, biases 0, would hide this swap)."""
    from dataio import weights

    path = save_random_hf_model(
        tmp_path / "hf", seed=3, n_layer=2, n_head=2, n_embd=64, n_positions=32, vocab_size=128
    )
    swap = {"ln_1.bias": "ln_2.bias", "ln_2.bias": "ln_1.bias"}
    table = [
        (hf, next((ours.replace(a, b) for a, b in swap.items() if a in ours), ours), linear)
        for hf, ours, linear in weights.WEIGHT_MAP
    ]
    monkeypatch.setattr(weights, "WEIGHT_MAP", table)
    ok, figures = check(str(path), text="", batch=1)
    assert not ok and figures["max_rel"] > 1e-3


def test_export_round_trip_gives_identical_logits(tmp_path):
    src = save_random_hf_model(
        tmp_path / "src", seed=4, n_layer=2, n_head=2, n_embd=64, n_positions=32, vocab_size=128
    )
    GPT.from_pretrained(str(src)).save_pretrained(tmp_path / "exported")
    tokens = torch.from_numpy(np.random.default_rng(0).integers(0, 128, (2, 32)))
    with torch.no_grad():
        a = load_hf_model(str(src))(tokens).logits.numpy()
        b = load_hf_model(str(tmp_path / "exported"))(tokens).logits.numpy()
    np.testing.assert_array_equal(a, b)


def test_export_of_a_padded_vocab_model_from_scratch(tmp_path):
    model = GPT(tiny_config(vocab_size=50304), nnx.Rngs(0))
    model.save_pretrained(tmp_path / "out")
    back = GPT.from_pretrained(str(tmp_path / "out"))
    assert back.config.vocab_size == 50304
    np.testing.assert_array_equal(back.wte.embedding[...], model.wte.embedding[...])


def test_loader_errors_are_one_line(tmp_path):
    with pytest.raises(
        ValueError, match="unknown model 'gpt3'.*gpt2, gpt2-medium, gpt2-large, gpt2-xl"
    ):
        GPT.from_pretrained("gpt3")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="needs config.json and model.safetensors"):
        GPT.from_pretrained(str(tmp_path / "empty"))


def test_check_logits_cli(tmp_path, capsys):
    """python -m parity.check_logits: in process, what the command does (exit_on_bad_input(main));
    once as the command itself, on an argument it refuses before loading anything."""
    path = save_random_hf_model(
        tmp_path / "hf", seed=5, n_layer=1, n_head=2, n_embd=32, n_positions=16, vocab_size=64
    )

    def run(*args):
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            exit_on_bad_input(lambda: check_logits.main(list(args)))
        out, err = capsys.readouterr()
        return e.value.code, out, err

    code, out, err = run("--model", str(path), "--text", "")
    assert code == 0, err
    assert "fp32 parity" in out and "OK" in out and "top-1 agree" in out
    code, _, err = run("--model", "gpt3")
    assert code == 2 and err.startswith("error: unknown model") and "Traceback" not in err
    code, _, err = run("--model", str(path), "--seq-len", "17", "--text", "")
    assert code == 2 and "--seq-len" in err
    command = subprocess.run(
        [sys.executable, "-m", "parity.check_logits", "--random-init", "--model", "gpt7"],
        capture_output=True,
        text=True,
    )
    assert (
        command.returncode == 2
        and command.stderr.startswith("error: --random-init takes a size name")
        and command.stderr.count("\n") == 1
    ), command.stderr


def test_load_pretrained_gives_the_model_the_runs_settings_and_mesh(tmp_path):
    """models.load_pretrained (sample, eval, hellaswag, a finetune's start): the run's choices reach
    the config (bf16 here), and with a mesh every tensor lands in its shards on it; without one,
    in no mesh's."""
    path = save_random_hf_model(
        tmp_path / "hf", seed=2, n_layer=1, n_head=2, n_embd=64, n_positions=32, vocab_size=128
    )
    mesh = sharding.make_mesh()
    model, _ = load_pretrained(str(path), mesh=mesh, dtype="bfloat16")
    assert model.config.dtype == "bfloat16"
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert all(isinstance(p.sharding, NamedSharding) and p.sharding.mesh == mesh for p in params)
    plain, _ = load_pretrained(str(path))
    assert plain.config.dtype == "float32"
    params = jax.tree.leaves(nnx.state(plain, nnx.Param))
    assert not any(isinstance(p.sharding, NamedSharding) for p in params)
