"""python -m pytest tests/test_train.py -q

train.py's pieces: the configuration contract, the schedule and the optimizer's decay grouping, the
train step (the loss in halves, each micro-batch's dropout key, a gradient that is not finite), what
a restore takes from a checkpoint (the loop, resume, preemption, bad input: test_train_loop.py;
meshes and processes: test_sharding.py)."""

import dataclasses
import json
import math
import os
import platform
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import REPO, assert_close, settings

import train
from configurator import ConfigError, configure
from run import train_step
from run.settings import DEFAULTS, validate

# --- configurator
# ----------------------------------------------------------------------------------


def test_configurator_contract(tmp_path):
    defaults = {"batch_size": 12, "learning_rate": 6e-4, "dataset": "openwebtext", "decay_lr": True}
    cfg = tmp_path / "cfg.py"
    cfg.write_text(
        "import math\n_helper = 3\nbatch_size = 4 * _helper\ndataset = 'shakespeare_char'\n"
    )
    c = configure(defaults, [str(cfg), "--learning_rate=1", "--dataset=owt", "--decay_lr=False"])
    assert c == {"batch_size": 12, "learning_rate": 1.0, "dataset": "owt", "decay_lr": False}
    assert defaults["dataset"] == "openwebtext"  # no side effect on the defaults

    with pytest.raises(
        ConfigError, match="unknown config key 'batch_szie'.*did you mean batch_size"
    ):
        configure(defaults, ["--batch_szie=3"])
    with pytest.raises(ConfigError, match="batch_size must be int .* got str 'big'"):
        configure(defaults, ["--batch_size=big"])
    with pytest.raises(ConfigError, match="decay_lr must be bool"):
        configure(defaults, ["--decay_lr=1"])
    # None is no value for a setting whose default is not None (issue 33): not given, nor from a
    # config file's os.environ.get of an unset variable; unless the script documents it (nullable:
    # sample.py's top_k)
    with pytest.raises(
        ConfigError, match=r"^dataset must be str \(default 'openwebtext'\), got NoneType None in "
    ):
        configure(defaults, ["--dataset=None"])
    cfg.write_text("import os\ndataset = os.environ.get('NANOGPT_JAX_NO_SUCH_VARIABLE')\n")
    with pytest.raises(ConfigError, match="dataset must be str .* got NoneType None in .*cfg.py"):
        configure(defaults, [str(cfg)])
    assert (
        configure(defaults, ["--batch_size=None"], nullable=("batch_size",))["batch_size"] is None
    )
    with pytest.raises(ConfigError, match="config file not found: nope.py"):
        configure(defaults, ["nope.py"])
    with pytest.raises(ConfigError, match="expected --key=value"):
        configure(defaults, ["--batch_size"])
    cfg.write_text("bacth_size = 3\n")
    with pytest.raises(ConfigError, match="unknown config key 'bacth_size' in .*cfg.py"):
        configure(defaults, [str(cfg)])


def test_every_shipped_config_is_valid():
    configs = [
        os.path.join(REPO, "config", f)
        for f in os.listdir(os.path.join(REPO, "config"))
        if f.endswith(".py")
    ]
    assert len(configs) >= 3
    for path in configs:
        # a config stacked after another (cpu.py, nanochat_gpt2.py) as the command its comment gives
        with open(path) as f:
            stacked = re.search(
                rf"python train\.py ((config/\S+\.py )+)config/{os.path.basename(path)}", f.read()
            )
        first = [os.path.join(REPO, p) for p in stacked.group(1).split()] if stacked else []
        validate(
            configure(DEFAULTS, [*first, path])
        )  # every range checked, not only names and types


# --- optimizer
# -------------------------------------------------------------------------------------


def nanogpt_get_lr(it, learning_rate, warmup_iters, lr_decay_iters, min_lr):
    """nanoGPT's get_lr, verbatim logic, as the reference."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)


def test_get_lr_matches_nanogpt():
    c = dict(DEFAULTS, learning_rate=6e-4, warmup_iters=100, lr_decay_iters=1000, min_lr=6e-5)
    for it in [0, 1, 50, 99, 100, 101, 550, 999, 1000, 1001, 5000]:
        ref = nanogpt_get_lr(it, 6e-4, 100, 1000, 6e-5)
        assert_close(train_step.get_lr(it, c), ref, rtol=1e-6, what=f"lr at {it}")
    assert_close(train_step.get_lr(0, c), 6e-4 / 101, rtol=1e-6)  # warmup start
    assert_close(train_step.get_lr(550, c), (6e-4 + 6e-5) / 2, rtol=1e-6)  # mid-cosine
    assert_close(train_step.get_lr(2000, dict(c, decay_lr=False)), 6e-4, rtol=1e-7)
    for it in range(13):  # a decay of a single step, as nanoGPT takes it
        ref = nanogpt_get_lr(it, 6e-4, 10, 11, 6e-5)
        assert_close(
            train_step.get_lr(it, dict(c, warmup_iters=10, lr_decay_iters=11)),
            ref,
            rtol=1e-6,
            what=f"{it}",
        )


def test_weight_decay_applies_to_2d_params_only(dataset, tmp_path):
    t = train.Trainer(settings(dataset, tmp_path))
    mask = train_step.decay_mask(t.params)
    flat = {"/".join(map(str, k)): v for k, v in jax.tree_util.tree_leaves_with_path(mask)}
    decayed = {k for k, v in flat.items() if v}
    # embeddings too, as nanoGPT
    assert any("wte" in k for k in decayed) and any("wpe" in k for k in decayed)
    assert all(("kernel" in k) or ("embedding" in k) for k in decayed)
    assert not any(("bias" in k) or ("scale" in k) for k in decayed)
    assert len(decayed) == 2 + 4 * 2  # wte, wpe, 4 kernels per block


# --- training
# --------------------------------------------------------------------------------------


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator")
def test_keep_freed_memory_serves_big_blocks_from_the_heap():
    """After keep_freed_memory, a 64 MB block gets no mmap of its own (glibc's mallinfo2: hblkhd,
    the bytes in mmapped blocks), so freeing it keeps its pages for the next step; before, it does
    (the control)."""
    script = """if True:
        import ctypes, numpy as np
        from compute import sharding
        class MallInfo2(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in
                        "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
        libc = ctypes.CDLL(None)
        libc.mallinfo2.restype = MallInfo2
        def mmapped_mb_while_holding_64mb():
            block = np.ones(64 << 20, np.uint8)
            return libc.mallinfo2().hblkhd >> 20
        before = mmapped_mb_while_holding_64mb()
        sharding.keep_freed_memory()
        print(before, mmapped_mb_while_holding_64mb())
    """  # noqa: E501
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True
    )
    before, after = map(int, out.stdout.split())
    assert before >= 64 and after < 64


# in chunks in make test-slow (CI runs it): tests/test_compute_settings.py holds chunks in make test
@pytest.mark.parametrize("loss_chunk", [0, pytest.param(5, marks=pytest.mark.slow)])
def test_batch_loss_in_halves_is_the_models_loss(loss_chunk):
    """train_step.batch_loss forwards the rows as two halves on one CPU device: still one mean over
    every valid target, also when the halves hold different numbers of ignored (-1) targets, and
    with the chunked loss."""
    from flax import nnx

    from model import GPT, GPTConfig

    model = GPT(
        GPTConfig(
            block_size=16, vocab_size=32, n_layer=2, n_head=2, n_embd=32, loss_chunk=loss_chunk
        ),
        nnx.Rngs(0),
    )
    rng = np.random.default_rng(0)
    x, y = (rng.integers(0, 32, (4, 16)).astype(np.int32) for _ in range(2))
    y[:2, :12] = -1  # the first half keeps 8 targets, the second 32
    loss_fn = jax.jit(lambda x, y: train_step.batch_loss(model, x, y))
    model_loss = jax.jit(lambda x, y: model(x, y)[1])  # jitted: op by op it compiles ~180 times

    def dots(f, *args):
        return f.lower(*args).compile().as_text().count(" dot(")

    # the model twice: halves
    assert dots(loss_fn, x, y) >= 2 * dots(jax.jit(lambda x: model(x)[0]), x)
    assert_close(loss_fn(x, y), model_loss(x, y), rtol=1e-6, what="loss in halves")
    assert_close(
        loss_fn(x[:3], y[:3]), model_loss(x[:3], y[:3]), rtol=1e-6, what="an odd batch: whole"
    )
    # with dropout, the whole batch's loss draws from the step's key
    model = GPT(dataclasses.replace(model.config, dropout=0.5), nnx.Rngs(0))
    key = jax.random.key(1)
    loss_with = jax.jit(lambda x, y, key: model.loss(x, y, key=key))
    loss_without = jax.jit(lambda x, y: model.loss(x, y))
    odd = jax.jit(lambda x, y, key: train_step.batch_loss(model, x, y, key))(x[:3], y[:3], key)
    assert_close(odd, loss_with(x[:3], y[:3], key), rtol=1e-6, what="an odd batch's dropout")
    assert abs(float(odd) - float(loss_without(x[:3], y[:3]))) > 1e-3
    # and the halves each draw theirs from it: dropout on, and another key another draw (the
    # untrained model's loss moves by ~1e-3 with the draw, float32's rounding by ~1e-6)
    even = jax.jit(lambda x, y, key: train_step.batch_loss(model, x, y, key))
    assert abs(float(even(x, y, key)) - float(loss_without(x, y))) > 1e-4
    assert abs(float(even(x, y, key)) - float(even(x, y, jax.random.key(2)))) > 1e-4


def test_the_step_draws_each_micro_batchs_dropout_from_its_key():
    """With dropout, the step's loss is the mean of batch_loss over its micro-batches, each with its
    own key of jax.random.split(key, accum): a step that lost its key would train without dropout
    and no other test would notice (resume is bit for bit either way)."""
    import optax

    from model import GPT, GPTConfig

    model = GPT(
        GPTConfig(block_size=16, vocab_size=32, n_layer=2, n_head=2, n_embd=32, dropout=0.5),
        nnx.Rngs(0),
    )
    graphdef, params = nnx.split(model)
    tx = optax.sgd(0.0)
    step = jax.jit(train_step.make_train_step(graphdef, tx, grad_clip=1.0))
    # 2 micro-batches of 3 rows
    x = np.random.default_rng(0).integers(0, 32, (2, 3, 16)).astype(np.int32)
    key = jax.random.key(7)
    _, _, metrics = step(params, tx.init(params), x, x, key)
    keys = jax.random.split(key, 2)
    # jitted, as the step is: op by op each compiles ~40 times
    batch_loss = jax.jit(lambda x, y, key: train_step.batch_loss(model, x, y, key))
    model_loss = jax.jit(lambda x, y: model.loss(x, y))
    losses = [batch_loss(x[i], x[i], keys[i]) for i in range(2)]
    assert_close(
        metrics["loss"],
        np.mean(losses),
        rtol=1e-6,
        what="the step's loss, with its micro-batches' keys",
    )
    assert (
        abs(float(metrics["loss"]) - float(np.mean([model_loss(x[i], x[i]) for i in range(2)])))
        > 1e-3
    )


def test_a_step_whose_gradient_is_not_finite_is_not_finite(monkeypatch):
    """The step's `finite` (what stops a diverged run before it saves) needs the loss and the
    gradient both finite: a loss that stays finite while its gradient does not (here a term sqrt(|0
    * w|), 0 in value, NaN in gradient) has already broken the params it returns."""
    import jax.numpy as jnp
    import optax

    from model import GPT, GPTConfig

    model = GPT(
        GPTConfig(block_size=16, vocab_size=32, n_layer=1, n_head=2, n_embd=32), nnx.Rngs(0)
    )
    monkeypatch.setattr(
        train_step,
        "batch_loss",
        lambda model, x, y, key=None, window=None: (
            model.loss(x, y) + jnp.sqrt(jnp.abs(0.0 * model.wte.embedding[...][0, 0]))
        ),
    )
    graphdef, params = nnx.split(model)
    tx = optax.sgd(0.1)
    x = np.zeros((1, 2, 16), np.int32)
    _, _, metrics = jax.jit(train_step.make_train_step(graphdef, tx, grad_clip=1.0))(
        params, tx.init(params), x, x, jax.random.key(0)
    )
    assert np.isfinite(metrics["loss"]) and not np.isfinite(metrics["grad_norm"])
    assert not metrics["finite"]


def test_restore_takes_compute_settings_from_the_run_not_the_checkpoint():
    """model_args hold the settings a checkpoint was trained with; a restore keeps its architecture
    only, so that attention='cudnn' saved on a GPU cannot stop a resume or a sample on a CPU."""
    from model import GPTConfig
    from run import checkpoint

    saved = GPTConfig(
        n_layer=3, dtype="bfloat16", dropout=0.1, attention="cudnn", remat="block", loss_chunk=64
    )
    meta = json.loads(json.dumps(checkpoint.meta_for(saved, {}, 0, 0.0, {})))
    assert checkpoint.model_config_from_meta(meta, remat="dots") == GPTConfig(
        n_layer=3, remat="dots"
    )
