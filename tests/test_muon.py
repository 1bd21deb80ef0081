"""python -m pytest tests/test_muon.py -q

optimizer='muon' (train_step.make_optimizer) against modded-nanogpt's record 5 in PyTorch
(parity/speedrun_reference.py): a few steps of Muon on the blocks' kernels in our (in, out) layout
(c_fc's (C, 4C), c_proj's (4C, C), attn.c_proj's (C, C), the fused QKV (C, 3C) against the record's
three (C, C)) and of Adam on the embedding, in float32 Newton-Schulz and in the record's bfloat16;
the stacked kernels of scan_layers; a mesh of fsdp x tensor (8 fake CPU devices, one subprocess);
which params Muon steps; where bf16 Newton-Schulz rounds, read off its jaxpr (the trapezoid
schedule, the settings' one-line errors, optimizer='adamw' against torch's AdamW, the step's finite
flag: test_optimizer.py)."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import MUON_SETTINGS, REPO, assert_close, fake_devices

from archs import muon
from run import train_step

C, V = 32, 64  # n_embd, vocab
STEPS = 6  # the schedule's multipliers 0.5, 1, 1, 1, 2/3, 1/3
KERNELS = {
    "attn.c_attn": (C, 3 * C),
    "attn.c_proj": (C, C),
    "mlp.c_fc": (C, 4 * C),
    "mlp.c_proj": (4 * C, C),
}


def uniform(rng, shape, fan_in=C):
    """torch nn.Linear's init, U(-1/sqrt(fan_in), 1/sqrt(fan_in)): the record's, the tied
    embedding's too."""
    return rng.uniform(-1, 1, shape).astype(np.float32) / np.float32(np.sqrt(fan_in))


def block(rng, layers=None):
    """One block's kernels {'attn': {'c_attn': {'kernel': (C, 3C)}, ...}}, or `layers` of them
    stacked."""
    tree = {}
    for name, shape in KERNELS.items():
        module, linear = name.split(".")
        shape = shape if layers is None else (layers, *shape)
        tree.setdefault(module, {})[linear] = {"kernel": uniform(rng, shape)}
    return tree


def params_and_grads(seed=0):
    """Params of one block and the tied embedding, as model.GPT names them, and STEPS gradients for
    them."""
    rng = np.random.default_rng(seed)
    params = {"h": {"0": block(rng)}, "wte": {"embedding": uniform(rng, (V, C))}}
    grads = [
        jax.tree.map(lambda p: rng.standard_normal(p.shape).astype(np.float32), params)
        for _ in range(STEPS)
    ]
    return params, grads


def train_ours(c, params, grads):
    """The params after each step of make_optimizer(c), jitted as train.py's step."""
    tx = train_step.make_optimizer(c)
    state = tx.init(params)

    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return train_step.optax.apply_updates(params, updates), state

    out = []
    for g in grads:
        params, state = step(params, state, g)
        out.append(jax.tree.map(np.asarray, params))
    # the step's metrics["lr"] reads this count
    assert int(train_step.schedule_count(state)) == len(grads)
    return out


def torch_layout(params):
    """{the record's name: torch (out, in) array}: c_attn's column thirds are the record's c_q, c_k,
    c_v."""
    block = params["h"]["0"]
    q, k, v = np.split(block["attn"]["c_attn"]["kernel"], 3, axis=1)
    out = {f"attn.{n}": w.T for n, w in zip(("c_q", "c_k", "c_v"), (q, k, v))}
    out.update(
        {
            name: block[name.split(".")[0]][name.split(".")[1]]["kernel"].T
            for name in KERNELS
            if name != "attn.c_attn"
        }
    )
    return {**out, "wte": params["wte"]["embedding"]}


def train_reference(c, params, grads, ns_dtype):
    """The same steps with the record's optimizers: its Muon on the blocks, torch AdamW (no decay)
    on the embedding, both under LambdaLR(get_lr). Returns the params after each step in the
    record's layout."""
    import torch

    from parity.speedrun_reference import Muon, get_lr

    tensors = {k: torch.tensor(v, requires_grad=True) for k, v in torch_layout(params).items()}
    blocks = [t for k, t in tensors.items() if k != "wte"]
    adam = torch.optim.AdamW(
        [tensors["wte"]], lr=c["learning_rate"], betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0
    )
    muon = Muon(blocks, lr=c["muon_learning_rate"], momentum=c["muon_momentum"], ns_dtype=ns_dtype)
    lambdas = [
        torch.optim.lr_scheduler.LambdaLR(
            opt, lambda it: get_lr(it, c["max_iters"], c["warmup_iters"], c["warmdown_iters"])
        )
        for opt in (adam, muon)
    ]
    out = []
    for g in grads:
        for k, grad in torch_layout(g).items():
            tensors[k].grad = torch.tensor(grad)
        for opt, schedule in zip((adam, muon), lambdas):
            opt.step()
            schedule.step()
        out.append({k: t.detach().numpy().copy() for k, t in tensors.items()})
    return out


def step_diffs(ours, reference, start):
    """Per step, the largest |ours - reference| of each param (both in the record's layout), over
    the largest distance it moved from `start`."""
    return [
        {k: float(np.abs(o[k] - r[k]).max() / np.abs(r[k] - start[k]).max()) for k in r}
        for o, r in zip(ours, reference)
    ]


@pytest.fixture(scope="module")
def run():
    import torch

    params, grads = params_and_grads()
    return (
        params,
        grads,
        torch_layout(params),
        train_reference(MUON_SETTINGS, params, grads, torch.float32),
    )


def test_muon_and_adam_steps_equal_the_record_in_float32(run):
    """Every kernel shape, the fused QKV as three matrices, momentum and Nesterov over 6 steps of
    the trapezoid."""
    params, grads, start, reference = run
    diffs = step_diffs(
        map(torch_layout, train_ours(MUON_SETTINGS, params, grads)), reference, start
    )
    print(
        "\nfloat32 Newton-Schulz, worst step:",
        {k: f"{max(d[k] for d in diffs):.1e}" for k in diffs[0]},
    )
    for i, d in enumerate(diffs):
        for name, rel in d.items():
            assert rel < 1e-5, f"step {i}: {name} {rel:.2g} of its update off the record's"


def test_qkv_orthogonalised_whole_is_caught(run, monkeypatch):
    """The comparison catches the classic slip: the fused (C, 3C) QKV orthogonalised as one matrix,
    scaled by sqrt(3C), where the record has three (C, C) matrices."""
    params, grads, start, reference = run
    monkeypatch.setattr(muon, "FUSED_QKV", muon.re.compile("no such param"))
    diffs = step_diffs(
        map(torch_layout, train_ours(MUON_SETTINGS, params, grads)), reference, start
    )
    assert min(diffs[0][k] for k in ("attn.c_q", "attn.c_k", "attn.c_v")) > 0.1, diffs[0]
    assert diffs[-1]["mlp.c_fc"] < 1e-5


def test_bfloat16_newton_schulz_is_as_close_to_float32_as_the_records(run):
    """The record's bf16 Newton-Schulz (ours rounds where torch.compile's fused kernels did, the
    reference where eager torch does): ours is no further from the float32 steps than the
    reference's bf16, in ||Δparam|| over the distance the param moved, the mean over the steps."""
    import torch

    params, grads, start, reference = run

    def off_float32(side):
        return {
            k: np.mean(
                [
                    np.linalg.norm(s[k] - r[k]) / np.linalg.norm(r[k] - start[k])
                    for s, r in zip(side, reference)
                ]
            )
            for k in start
            if k != "wte"
        }

    ours = off_float32(
        [
            torch_layout(p)
            for p in train_ours(dict(MUON_SETTINGS, muon_ns_dtype="bfloat16"), params, grads)
        ]
    )
    record = off_float32(train_reference(MUON_SETTINGS, params, grads, torch.bfloat16))
    print(
        "\nbfloat16 Newton-Schulz off float32 (ours, the reference's):",
        {k: f"{ours[k]:.1e}, {record[k]:.1e}" for k in ours},
    )
    for name in ours:
        assert 0 < ours[name] <= record[name], (
            f"{name}: {ours[name]:.2g} off float32, the reference {record[name]:.2g}"
        )


def test_stacked_kernels_step_as_each_layer():
    """scan_layers' (n_layer, in, out) kernels: orthogonalised layer by layer, the same numbers."""
    rng = np.random.default_rng(1)
    stacked = {"h": block(rng, layers=2), "wte": {"embedding": uniform(rng, (V, C))}}
    grads = [
        jax.tree.map(lambda p: rng.standard_normal(p.shape).astype(np.float32), stacked)
        for _ in range(2)
    ]

    def per_layer(tree):
        return {
            "h": {str(i): jax.tree.map(lambda x: x[i], tree["h"]) for i in range(2)},
            "wte": tree["wte"],
        }

    ours = train_ours(MUON_SETTINGS, stacked, grads)[-1]
    layers = train_ours(MUON_SETTINGS, per_layer(stacked), [per_layer(g) for g in grads])[-1]
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(per_layer(ours)), jax.tree.leaves(layers)
    ):
        assert_close(a, b, rtol=1e-6, atol=1e-7, what=jax.tree_util.keystr(path))


# Runs in a python with 8 fake CPU devices: the step on the mesh (fsdp x tensor), each param and
# momentum placed by sharding.PARAM_SPECS, jitted with them pinned and traced under the mesh (as
# train_step.compile_step); then the same on one device. Stacked (scan_layers) and per-layer kernels
# side by side.
MESH_RUN = r"""
import json, sys
import jax, numpy as np
from compute import sharding
from run import train_step
settings, meshes = json.loads(sys.argv[1]), json.loads(sys.argv[2])
rng = np.random.default_rng(0)
def kernels(shape):
    return {"kernel": rng.standard_normal(shape).astype(np.float32) / 8}
C = 32
block = lambda *l: {"attn": {"c_attn": kernels((*l, C, 3 * C)), "c_proj": kernels((*l, C, C))},
                    "mlp": {"c_fc": kernels((*l, C, 4 * C)), "c_proj": kernels((*l, 4 * C, C))}}
params = {"a": {"h": {"0": block()}}, "b": {"h": block(2)},
          "wte": {"embedding": rng.standard_normal((64, C), np.float32)}}
grads = [jax.tree.map(lambda p: rng.standard_normal(p.shape).astype(np.float32), params) for _ in range(3)]
tx = train_step.make_optimizer(settings)

def train(mesh):
    shard = lambda tree: sharding.shardings_for(tree, mesh)
    state = jax.jit(tx.init, out_shardings=shard(jax.eval_shape(tx.init, params)))(params)
    p = jax.device_put(params, shard(params))
    def step(p, state, g):
        updates, state = tx.update(g, state, p)
        return train_step.optax.apply_updates(p, updates), state
    step = jax.jit(step, in_shardings=(shard(p), shard(state), shard(p)), out_shardings=(shard(p), shard(state)))
    with jax.set_mesh(mesh):
        for g in grads:
            p, state = step(p, state, jax.device_put(g, shard(params)))
    momentum = {sharding._path(k): [x.sharding.spec == y.sharding.spec, x.addressable_shards[0].data.size, x.size]
                for (k, x), y in zip(jax.tree_util.tree_leaves_with_path(state.inner_states["muon"].inner_state[0]),
                                     jax.tree.leaves(p)) if x.ndim >= 2}
    return jax.tree.map(np.asarray, p), momentum

one, _ = train(sharding.make_mesh(devices=jax.devices()[:1]))
report = {}
for fsdp, tp in meshes:
    ours, momentum = train(sharding.make_mesh(fsdp, tp))
    # in units in the last place of the param's largest element
    diffs = {sharding._path(k): float(np.abs(a - b).max() / np.spacing(np.abs(b).max())) for (k, a), b in
             zip(jax.tree_util.tree_leaves_with_path(ours), jax.tree.leaves(one))}
    report[f"fsdp{fsdp}_tp{tp}"] = {"diffs": diffs, "momentum": momentum}
print("REPORT " + json.dumps(report))
"""  # noqa: E501


@pytest.mark.slow
def test_a_mesh_steps_as_one_device():
    """fsdp 4 x tensor 2 and data 2 x fsdp 2 x tensor 2: every param as one device computes it, the
    momentum split like its param. In the record's bfloat16, where XLA's own split of
    Newton-Schulz's matmuls (partial sums rounded to bf16) is 10^4-10^5 ulp off."""
    settings = dict(MUON_SETTINGS, muon_ns_dtype="bfloat16")
    p = subprocess.run(
        [sys.executable, "-c", MESH_RUN, json.dumps(settings), json.dumps([[4, 2], [2, 2]])],
        cwd=REPO,
        env=fake_devices(8),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads(
        next(line for line in p.stdout.splitlines() if line.startswith("REPORT "))[7:]
    )
    for mesh, r in report.items():
        print(
            f"\n{mesh}: max |param diff| from one device {max(r['diffs'].values()):g} ulp (of its "
            "largest)"
        )
        # XLA:CPU's programs for 1 and 8 devices fuse the update differently
        for path, diff in r["diffs"].items():
            assert diff <= 4, f"{mesh}: {path} differs from one device's by {diff:g} ulp"
        assert len(r["momentum"]) == 8 and len(r["diffs"]) == 9  # the blocks' 8 kernels; + wte
        for path, (same_spec, shard, size) in r["momentum"].items():
            assert same_spec and shard < size, (
                f"{mesh}: {path}'s momentum is not split like its param"
            )


def test_muon_steps_the_blocks_matrices_adam_the_rest():
    params, _ = params_and_grads()
    labels = {
        jax.tree_util.keystr(k, simple=True, separator="."): v
        for k, v in jax.tree_util.tree_leaves_with_path(muon.muon_labels(params))
    }
    assert labels == {**{f"h.0.{name}.kernel": "muon" for name in KERNELS}, "wte.embedding": "adam"}


def test_bfloat16_newton_schulz_rounds_where_the_record_does():
    """Read off the jaxpr of a tall G (transposed: the matmuls on the small side): G and its norm
    rounded to bf16 first; each matmul bf16 in and out at HIGHEST precision (a TPU's default would
    drop the float32 accumulation the record's torch matmuls keep); every elementwise sum, product
    and the norm's reduction in float32; the result bf16. The accuracy test above is one-sided (no
    further from float32 than the record): this pins where ours rounds."""
    jaxpr = jax.make_jaxpr(lambda g: muon.newton_schulz(g, jnp.bfloat16))(jnp.ones((32, 16))).jaxpr
    eqns, bf16 = jaxpr.eqns, jnp.dtype(jnp.bfloat16)
    names = [e.primitive.name for e in eqns]
    assert names[0] == "convert_element_type" and eqns[0].params["new_dtype"] == bf16
    assert eqns[names.index("sqrt") + 1].params.get("new_dtype") == bf16
    dots = [e for e in eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 15 and dots[0].outvars[0].aval.shape == (16, 16)
    for e in dots:
        assert [v.aval.dtype for v in e.invars] == [bf16, bf16] and e.outvars[0].aval.dtype == bf16
        assert e.params["precision"] == (jax.lax.Precision.HIGHEST,) * 2
    for e in eqns:
        if e.primitive.name in ("add", "sub", "mul", "div", "square", "sqrt", "reduce_sum"):
            assert all(v.aval.dtype == jnp.float32 for v in e.invars if hasattr(v, "aval")), e
    assert jaxpr.outvars[0].aval.dtype == bf16 and jaxpr.outvars[0].aval.shape == (32, 16)
    # and Muon's update (muon_ns_dtype='bfloat16') asks for it in bf16, then scales it in float32
    params = {"h": {"0": {"mlp": {"c_fc": {"kernel": jnp.ones((16, 32))}}}}}
    tx = muon.orthogonalize("bfloat16")
    update = jax.make_jaxpr(lambda g: tx.update(g, tx.init(params), params)[0])(params).jaxpr
    assert {e.invars[0].aval.dtype for e in update.eqns if e.primitive.name == "dot_general"} == {
        bf16
    }
    assert update.outvars[0].aval.dtype == jnp.float32
