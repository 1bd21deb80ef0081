"""python -m pytest tests/test_speedrun_model.py -q

arch='speedrun' (modded-nanogpt's record 5) against the torch reference written from the record
(parity/speedrun_reference.py): rotary with bfloat16 tables, QK-norm and RMSNorm's eps, ReLU^2, the
inits, whole-model logits and loss through weights.py's state_step*.pt mapping both ways,
scan_layers, remat and loss_chunk, KV-cache generation, export.py --format=modded, and the bad input
of each, one line."""

import math
import os
import re

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flax import nnx
from helpers import assert_close, rel_diff, save_ours, tiny_config

import attention
import checkpoint
import export
import sample
import sharding
import train
from configurator import UsageError, exit_on_bad_input
from layers import rms_norm, rotary, rotary_tables
from model import GPT, GPTConfig
from models import build, check_config, load_pretrained, model_from
from parity import speedrun_reference as record
from parity.check_generate import CACHE_LOGITS_TOL
from parity.check_logits import FP32_LOSS_TOL, FP32_MAX_REL_TOL
from pretrained import (
    COMPILED_PREFIX,
    from_modded_state,
    modded_config,
    read_pretrained,
    to_modded_state,
)
from tokenizer import save_vocab
from weights import state_dict

SPEEDRUN = dict(arch="speedrun", bias=False)
# tiny_config's shape, in the record's fields
RECORD = dict(vocab_size=128, n_layer=2, n_head=2, n_embd=64)


@pytest.fixture(autouse=True)
def highest_precision():
    """fp32 matmuls as they are written, on both sides (no TF32, no bf16 passes)."""
    torch.set_float32_matmul_precision("highest")
    with jax.default_matmul_precision("highest"):
        yield


def random_record(seed=0):
    """The record's GPT with every matrix random: its zero-initialised projections would hide a
    wrong mapping."""
    torch.manual_seed(seed)
    ref = record.GPT(record.GPTConfig(**RECORD))
    with torch.no_grad():
        for p in ref.parameters():  # lm_head.weight is transformer.wte.weight: one tensor
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))
    return ref.eval()


def ours_of(ref, **settings):
    """Our GPT holding the record's weights, through weights.py's state_step*.pt mapping."""
    state = from_modded_state(ref.state_dict())
    return model_from(
        GPTConfig(
            **{**modded_config(state, n_head=RECORD["n_head"]), "block_size": 32, **settings}
        ),
        state,
    )


def record_logits(ref, tokens, targets=None):
    with torch.no_grad():
        logits, loss = ref(
            torch.from_numpy(np.asarray(tokens, np.int64)),
            None if targets is None else torch.from_numpy(np.asarray(targets, np.int64)),
        )
    return logits.numpy(), None if loss is None else loss.item()


def tokens(batch=2, T=32, seed=0):
    return np.random.default_rng(seed).integers(0, RECORD["vocab_size"], (batch, T))


# --- the pieces
# -------------------------------------------------------------------------------------


@pytest.mark.parametrize("hs", [32, 128])
def test_rotary_tables_are_the_records_bf16_ones_at_every_position(hs):
    """Bit for bit over the record's 1024 positions (head size 128 is the record's), and so under
    jit: the tables are constants of the program, no device cos or sin."""
    T = 1024
    want = [t[0, :, 0].float().numpy() for t in record.Rotary(hs)(torch.zeros(1, T, 1, hs))]
    for table, expected in zip(rotary_tables(T, hs), want):
        assert table.dtype == jnp.bfloat16
        np.testing.assert_array_equal(table.astype(np.float32), expected)
    ones = jnp.concatenate([jnp.ones((1, T, 1, hs // 2)), jnp.zeros((1, T, 1, hs // 2))], axis=-1)
    y = jax.jit(lambda x: rotary(x, *rotary_tables(T, hs)))(ones)  # x1 = 1, x2 = 0 -> (cos, -sin)
    np.testing.assert_array_equal(y[0, :, 0], np.concatenate([want[0], -want[1]], axis=-1))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rotary_rotates_as_the_record(dtype):
    x = torch.randn(2, 16, 2, 32, generator=torch.Generator().manual_seed(0)).to(
        getattr(torch, dtype)
    )
    want = record.apply_rotary_emb(x, *record.Rotary(32)(x)).float().numpy()
    got = rotary(jnp.asarray(x.float().numpy(), dtype), *rotary_tables(16, 32))
    assert got.dtype == jnp.dtype(dtype)
    # float32: the same products and sums (an FMA may round once less); bfloat16: at most one
    # rounding apart
    if dtype == "float32":
        assert_close(got, want, atol=2e-6, what="rotary float32")
    else:
        assert_close(np.asarray(got, np.float32), want, rtol=2**-7, what="rotary bfloat16")


def test_rms_norm_is_torchs_with_its_eps():
    """float32 and bfloat16 inputs as F.rms_norm (eps: float32's machine epsilon, 1.19e-7, for
    both); on inputs of 1e-4 the eps is most of the mean square (1e-8): the output is a quarter of
    what it would be without it."""
    g = torch.Generator().manual_seed(0)
    for scale in (1.0, 1e-4):
        x = scale * torch.randn(3, 5, 64, generator=g)
        want = F.rms_norm(x, (64,)).numpy()
        got = rms_norm(jnp.asarray(x.numpy()))
        assert_close(got, want, rtol=1e-6, atol=0, what=f"rms_norm at scale {scale}")
        without_eps = x.numpy() / np.sqrt(np.mean(x.numpy() ** 2, axis=-1, keepdims=True))
        assert rel_diff(got, without_eps) > 0.5 if scale < 1 else rel_diff(got, without_eps) < 1e-6
    x = torch.randn(3, 5, 64, generator=g).bfloat16()
    got = rms_norm(jnp.asarray(x.float().numpy(), jnp.bfloat16))
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), F.rms_norm(x, (64,)).float().numpy())


def test_q_k_v_after_rotary_and_qk_norm_and_the_relu2_mlp_equal_the_records():
    ref, T = random_record(seed=1), 16
    model = ours_of(ref)
    x = torch.randn(2, T, 64, generator=torch.Generator().manual_seed(2))
    attn, mlp = ref.transformer.h[1].attn, ref.transformer.h[1].mlp
    with torch.no_grad():
        q, k, v = (f(x).view(2, T, 2, 32) for f in (attn.c_q, attn.c_k, attn.c_v))
        cos, sin = attn.rotary(q)
        q, k = (F.rms_norm(record.apply_rotary_emb(a, cos, sin), (32,)) for a in (q, k))
        want_mlp = mlp(x).numpy()
    for name, got, want in zip("qkv", model.h[1].attn.qkv(jnp.asarray(x.numpy())), (q, k, v)):
        assert_close(got, want.numpy(), atol=2e-6, what=name)
    assert_close(
        model.h[1].mlp(jnp.asarray(x.numpy())), want_mlp, atol=2e-6, rtol=1e-5, what="ReLU^2 MLP"
    )


def test_init_is_the_records():
    """Zero residual projections (@Grad62304977's zero init); every other matrix and the tied
    embedding U(-1/sqrt(C), 1/sqrt(C)), torch nn.Linear's default (the embedding is the record's
    lm_head Linear); no wpe, LayerNorm or bias params at all."""
    model = build(tiny_config(**SPEEDRUN), nnx.Rngs(0))
    params = {
        jax.tree_util.keystr(p, simple=True, separator=".").removesuffix(".value"): np.asarray(v)
        for p, v in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
    }
    assert sorted(params) == sorted(
        f"h.{i}.{name}"
        for i in range(2)
        for name in (
            "attn.c_attn.kernel",
            "attn.c_proj.kernel",
            "mlp.c_fc.kernel",
            "mlp.c_proj.kernel",
        )
    ) + ["wte.embedding"]
    bound = 1 / math.sqrt(64)
    for path, value in params.items():
        if path.endswith("c_proj.kernel"):
            assert not value.any(), path
        else:  # uniform on (-bound, bound): its extremes near the bound, its std bound / sqrt(3)
            assert 0.97 * bound < np.abs(value).max() <= bound, path
            assert (
                abs(value.std() / (bound / math.sqrt(3)) - 1) < 0.05
                and abs(value.mean()) < 0.01 * bound
            ), path
    # every param has its row in sharding's table: none is left whole on every device by accident
    assert all(
        any(re.search(pattern, path) for pattern, _ in sharding.PARAM_SPECS) for path in params
    )
    assert model.num_params() == sum(v.size for v in params.values())  # no wpe to leave out


# --- the whole model
# ----------------------------------------------------------------------------------


def test_logits_and_loss_equal_the_records_on_its_weights():
    ref = random_record(seed=3)
    model = ours_of(ref)
    x, y = tokens(seed=4), tokens(seed=5)
    y[0, :3] = -1  # ignored, as the record's ignore_index
    want_logits, want_loss = record_logits(ref, x, y)
    logits, loss = model(jnp.asarray(x), jnp.asarray(y))
    assert rel_diff(logits, want_logits) < FP32_MAX_REL_TOL
    assert abs(float(loss) - want_loss) < FP32_LOSS_TOL
    assert abs(float(model.loss(jnp.asarray(x), jnp.asarray(y))) - want_loss) < FP32_LOSS_TOL


def test_our_weights_load_strictly_into_the_record_with_the_same_logits():
    # through one mapping; a fresh random model back through the other:
    model = ours_of(random_record(seed=6))
    fresh = model_from(
        model.config,
        {
            k: np.random.default_rng(7).normal(0, 0.1, v.shape).astype(np.float32)
            for k, v in state_dict(model).items()
        },
    )
    ref = record.GPT(record.GPTConfig(**RECORD))
    # strict
    ref.load_state_dict({k: torch.from_numpy(v) for k, v in to_modded_state(fresh).items()})
    x = tokens(seed=8)
    assert rel_diff(fresh(jnp.asarray(x))[0], record_logits(ref, x)[0]) < FP32_MAX_REL_TOL


@pytest.mark.parametrize(
    "settings",
    [
        dict(scan_layers=True),
        dict(scan_layers=True, remat="dots", loss_chunk=8),
        dict(remat="block", loss_chunk=12),
    ],
    ids=["scan", "scan-dots-chunks", "block-chunks"],
)
def test_scan_layers_remat_and_loss_chunk_compute_the_same_loss_and_grads(settings):
    ref = random_record(seed=9)
    plain, other = ours_of(ref), ours_of(ref, **settings)
    x, y = jnp.asarray(tokens(seed=10)), jnp.asarray(tokens(seed=11))

    def loss_and_grads(model):
        graphdef, params = nnx.split(model)
        loss, grads = jax.jit(jax.value_and_grad(lambda p: nnx.merge(graphdef, p).loss(x, y)))(
            params
        )
        return float(loss), state_dict(nnx.merge(graphdef, grads))

    (loss, grads), (loss2, grads2) = loss_and_grads(plain), loss_and_grads(other)
    assert abs(loss - loss2) < 1e-6
    for k, g in grads.items():
        assert_close(grads2[k], g, atol=1e-6 * np.abs(g).max(), what=k)
    if settings.get("scan_layers"):
        assert rel_diff(other(x)[0], plain(x)[0]) < FP32_MAX_REL_TOL


@pytest.mark.parametrize("scan_layers", [False, True])
def test_kv_cache_generation_equals_the_full_forward(scan_layers):
    """Greedy tokens and every step's logits with the cache (keys rotated at their absolute
    positions) equal the full forward's, within block_size and past it (the window slides: the full
    forward then serves). block_size 40, not the head size 32: the cache's rotary tables are as long
    as the cache."""
    model = ours_of(random_record(seed=12), scan_layers=scan_layers, block_size=40)
    prompt = tokens(batch=2, T=5, seed=13)
    cached, cached_logits = model.generate(prompt, 40, temperature=0, return_logits=True)
    full, full_logits = model.generate(
        prompt, 40, temperature=0, return_logits=True, use_cache=False
    )
    np.testing.assert_array_equal(cached, full)
    assert len(set(cached[:, 5:].ravel().tolist())) >= 5  # it decided something
    assert rel_diff(cached_logits, full_logits) < CACHE_LOGITS_TOL
    # and the first step's are the record's last position's
    assert (
        rel_diff(cached_logits[:, 0], record_logits(random_record(seed=12), prompt)[0][:, -1])
        < FP32_MAX_REL_TOL
    )


def test_bfloat16_is_as_close_to_float32_as_the_records_autocast():
    """In bf16 the matmuls, rotary (bf16 tables on bf16 q, k) and the MLP compute in bf16, the
    residual stream and the norms' sums in float32, as the record under autocast: our bf16 logits
    are about as far from the float32 ones as torch's autocast logits are (CPU autocast here; the
    record's is CUDA's)."""
    ref = random_record(seed=19)
    x = tokens(seed=20)
    want = record_logits(ref, x)[0]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        theirs = ref(torch.from_numpy(np.asarray(x, np.int64)))[0].float().numpy()
    ours = ours_of(ref, dtype="bfloat16")(jnp.asarray(x))[0]
    assert 0 < rel_diff(ours, want) < 2 * rel_diff(theirs, want), (
        rel_diff(ours, want),
        rel_diff(theirs, want),
    )


@pytest.mark.parametrize("kernel", ["splash", "explicit"])
def test_every_attention_kernel_takes_the_rotated_normed_q_and_k(kernel, monkeypatch):
    """Rotary and QK-norm happen before the kernel: splash (Pallas interpret mode off a TPU; T a
    multiple of 128) and the explicit attention that attention dropout takes compute xla's
    logits."""
    ref = random_record(seed=21)
    x = jnp.asarray(tokens(batch=1, T=128, seed=22))
    want = ours_of(ref, block_size=128, attention="xla")(x)[0]
    if kernel == "explicit":  # what a dropout > 0 run takes, here with its rate 0
        monkeypatch.setattr(
            attention,
            "causal_attention",
            lambda q, k, v, _: attention.explicit_attention(q, k, v, 0.0, None),
        )
    got = ours_of(ref, block_size=128, attention="splash" if kernel == "splash" else "xla")(x)[0]
    assert rel_diff(got, want) < FP32_MAX_REL_TOL


# --- state_step*.pt in and out
# -----------------------------------------------------------------------


def save_record_file(
    state, path, code="model = GPT(GPTConfig(vocab_size=num_vocab, n_layer=2, n_head=2, n_embd=64))"
):
    """A state_step*.pt as the record's training script saves it: its torch.compile'd model's state
    dict."""
    state = {COMPILED_PREFIX + k: v for k, v in state.items()}
    torch.save(
        {
            "step": 7,
            "code": code,
            "model": state,
            "optimizers": [{"state": {}, "param_groups": []}],
        },
        path,
    )


def test_a_record_file_loads_for_the_scripts_with_the_records_logits(tmp_path, capsys):
    ref = random_record(seed=14)
    save_record_file(ref.state_dict(), tmp_path / "state_step000007.pt")
    # sample, hellaswag, eval
    model, train_config = checkpoint.load_model(str(tmp_path / "state_step000007.pt"))
    assert (model.config.arch, model.config.n_head, model.config.bias, train_config) == (
        "speedrun",
        2,
        False,
        None,
    )
    x = tokens(seed=15)
    assert rel_diff(model(jnp.asarray(x))[0], record_logits(ref, x)[0]) < FP32_MAX_REL_TOL
    # the heads come from the file's code; without one, from n_head (the record's 6 by default)
    save_record_file(ref.state_dict(), tmp_path / "no_code.pt", code="")
    assert read_pretrained(str(tmp_path / "no_code.pt"), n_head=2)[0]["n_head"] == 2
    assert load_pretrained(str(tmp_path / "no_code.pt"), n_head=2)[0].config.n_head == 2
    with pytest.raises(UsageError, match="n_head=6 does not split n_embd=64"):
        read_pretrained(str(tmp_path / "no_code.pt"))
    # sample.py greedy, with a character vocabulary beside the file: the record's own greedy
    # continuation
    chars = [chr(48 + i) for i in range(RECORD["vocab_size"])]
    save_vocab(tmp_path, chars)
    assert (
        sample.main(
            [
                f"--init_from={tmp_path / 'state_step000007.pt'}",
                "--start=ab",
                "--temperature=0",
                "--num_samples=1",
                "--max_new_tokens=6",
                "--dtype=float32",
            ]
        )
        == 0
    )
    ids = [chars.index(c) for c in "ab"]
    for _ in range(6):
        ids.append(int(record_logits(ref, [ids])[0][0, -1].argmax()))
    assert (
        capsys.readouterr().out == "".join(chars[i] for i in ids) + "\n" + sample.SEPARATOR + "\n"
    )


def test_train_py_trains_on_from_a_record_file(tmp_path, dataset):
    """train.py --init_from=state_step*.pt with the recipe's settings: the record's weights are the
    run's first params, and its Muon steps train them on."""
    ref = random_record(seed=18)
    save_record_file(ref.state_dict(), tmp_path / "state_step000007.pt")
    recipe = [
        "--arch=speedrun",
        "--bias=False",
        "--optimizer=muon",
        "--muon_learning_rate=0.01",
        "--lr_schedule=trapezoid",
        "--warmup_iters=0",
        "--warmdown_iters=2",
        "--n_head=2",
        "--block_size=32",
        f"--init_from={tmp_path / 'state_step000007.pt'}",
    ]
    trainer = train.Trainer(helpers.settings(dataset, tmp_path / "out", *recipe))
    first = to_modded_state(nnx.merge(trainer.graphdef, trainer.params))
    for k, v in ref.state_dict().items():
        np.testing.assert_array_equal(first[k], v.numpy(), err_msg=k)
    trainer.run()
    losses = [loss for _, loss in helpers.read_log(tmp_path / "out", "loss")]
    assert len(losses) == 4 and losses[-1] < losses[0], losses


def test_export_modded_loads_in_the_record_and_round_trips(tmp_path):
    model = ours_of(random_record(seed=16))
    save_ours(tmp_path / "run", model)
    to = tmp_path / "logs" / "state_step000005.pt"
    assert export.main([f"--out_dir={tmp_path / 'run'}", "--format=modded", f"--to={to}"]) == 0
    saved = torch.load(to, weights_only=True)
    assert saved["step"] == 5 and set(saved) == {"step", "code", "model", "optimizers"}
    assert all(k.startswith(COMPILED_PREFIX) for k in saved["model"])
    ref = record.GPT(record.GPTConfig(**RECORD))
    # strict
    ref.load_state_dict({k.removeprefix(COMPILED_PREFIX): v for k, v in saved["model"].items()})
    x = tokens(seed=17)
    assert rel_diff(record_logits(ref, x)[0], model(jnp.asarray(x))[0]) < FP32_MAX_REL_TOL
    back, _ = checkpoint.load_model(str(to))  # n_head from the code export wrote
    assert back.config.n_head == 2
    for k, v in state_dict(model).items():
        np.testing.assert_array_equal(state_dict(back)[k], v, err_msg=k)


# --- bad input
# ---------------------------------------------------------------------------------------


def test_bad_configs_are_one_line():
    for kw, message in [
        (dict(arch="llama"), "arch must be 'gpt2' or 'speedrun'"),
        (dict(arch="speedrun", bias=True), "set bias=False"),
        (dict(arch="speedrun", bias=False, n_head=64), "head size n_embd / n_head must be even"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)) as e:
            check_config(tiny_config(**kw))  # GPTConfig's checks, then record 5's
        assert "\n" not in str(e.value)


def test_bad_files_and_exports_are_one_line_exit_2_and_write_nothing(tmp_path, capsys):
    ref = random_record(seed=18)
    save_record_file(ref.state_dict(), tmp_path / "record.pt")
    torch.save({"step": 1, "model": {"w": torch.zeros(2)}}, tmp_path / "neither.pt")
    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint")
    # a later record's: an extra param
    save_record_file(
        {**ref.state_dict(), "transformer.h.0.attn.lamb": torch.zeros(())}, tmp_path / "later.pt"
    )
    save_ours(tmp_path / "gpt2", GPT(tiny_config(), nnx.Rngs(0)))
    save_ours(tmp_path / "speedrun", ours_of(ref))
    runs = [
        (
            lambda: sample.main([f"--init_from={tmp_path / 'neither.pt'}"]),
            "is neither a nanoGPT ckpt.pt (a dict with model and model_args) nor a modded-nanogpt "
            "state_step*.pt",
        ),
        (
            lambda: sample.main([f"--init_from={tmp_path / 'garbage.pt'}"]),
            "is not a torch checkpoint",
        ),
        (
            lambda: sample.main([f"--init_from={tmp_path / 'later.pt'}"]),
            "unexpected ['transformer.h.0.attn.lamb']",
        ),
        (lambda: read_pretrained(str(tmp_path / "record.pt"), n_head=4), "not 4: set n_head=2"),
        (
            lambda: export.main(
                [f"--out_dir={tmp_path / 'gpt2'}", "--format=modded", f"--to={tmp_path / 'a.pt'}"]
            ),
            "this model is arch='gpt2': export it with --format=hf or --format=nanogpt",
        ),
        (
            lambda: export.main(
                [f"--out_dir={tmp_path / 'speedrun'}", "--format=hf", f"--to={tmp_path / 'hf'}"]
            ),
            "this model is arch='speedrun' (modded-nanogpt's record 5), which hf's GPT-2 cannot "
            "compute: export it with --format=modded\n",
        ),
        (
            lambda: export.main(
                [f"--out_dir={tmp_path / 'speedrun'}", "--format=nanogpt", f"--to={tmp_path / 'n'}"]
            ),
            "which nanogpt's GPT-2 cannot compute: export it with --format=modded\n",
        ),
        (
            lambda: export.main(
                [
                    f"--out_dir={tmp_path / 'speedrun'}",
                    "--format=modded",
                    f"--to={tmp_path / 'dir'}",
                ]
            ),
            "--to must end in .pt",
        ),
    ]
    before = sorted(os.listdir(tmp_path))
    for run, message in runs:
        with pytest.raises(SystemExit) as e:
            exit_on_bad_input(run)
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err and err.count("\n") == 1, (message, err)
    assert sorted(os.listdir(tmp_path)) == before
    with pytest.raises(UsageError, match="a modded-nanogpt state dict has transformer.wte.weight"):
        from_modded_state({"transformer.h.0.attn.c_q.weight": np.zeros((2, 2))})
