"""python -m pytest tests/test_optimizer.py -q

lr_schedule='trapezoid' (train_step.get_lr, get_muon_lr) against modded-nanogpt's record 5
(parity/speedrun_reference.py) at every step, and the cosine schedule scaling Muon's rate alike; the
optimizer settings' one-line errors and the arch a checkpoint fixes; optimizer='adamw' against
torch's AdamW; the step's key reaching the loss, and its finite flag (Muon's steps against the
record's: test_muon.py)."""

from dataclasses import asdict

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import MUON_SETTINGS, assert_close

from configurator import UsageError, configure
from model import GPTConfig
from run import train_step
from run.settings import DEFAULTS, fixed_by_checkpoint, validate


# 1: a step of each, at their bounds
@pytest.mark.parametrize("warmup, warmdown", [(0, 7), (3, 7), (1, 1)])
def test_trapezoid_equals_the_records_schedule_at_every_step(warmup, warmdown):
    from parity.speedrun_reference import get_lr

    c = dict(MUON_SETTINGS, max_iters=20, warmup_iters=warmup, warmdown_iters=warmdown)
    for it in range(c["max_iters"] + 1):
        multiplier = get_lr(it, c["max_iters"], warmup, c["warmdown_iters"])
        assert_close(
            train_step.get_lr(it, c),
            c["learning_rate"] * multiplier,
            rtol=1e-6,
            what=f"Adam's lr at {it}",
        )
        assert_close(
            train_step.get_muon_lr(it, c),
            c["muon_learning_rate"] * multiplier,
            rtol=1e-6,
            what=f"Muon's lr at {it}",
        )
    assert float(train_step.get_lr(c["max_iters"], dict(c, warmdown_iters=0))) == 0.0  # not 0/0
    assert train_step.get_lr(5, dict(c, decay_lr=False)) == np.float32(c["learning_rate"])


def test_cosine_schedule_scales_muons_rate_alike():
    c = dict(MUON_SETTINGS, lr_schedule="cosine", warmup_iters=2, lr_decay_iters=5, min_lr=0.001)
    for it in range(7):
        assert_close(
            train_step.get_muon_lr(it, c),
            train_step.get_lr(it, c) * 2,
            rtol=1e-6,
            what=f"lr at {it}",
        )


MUON = ["--optimizer=muon", "--arch=speedrun", "--bias=False", "--muon_learning_rate=0.00036"]
BAD = [
    (["--optimizer=sgd"], "optimizer must be 'adamw' or 'muon'"),
    (["--lr_schedule=linear"], "lr_schedule must be 'cosine' or 'trapezoid'"),
    (
        ["--lr_schedule=trapezoid", "--max_iters=100", "--warmdown_iters=101", "--warmup_iters=0"],
        "warmdown_iters=101 exceeds max_iters=100",
    ),
    (
        ["--lr_schedule=trapezoid", "--max_iters=100", "--warmdown_iters=60", "--warmup_iters=50"],
        r"warmup_iters=50 \+ warmdown_iters=60 exceed max_iters=100",
    ),
    ([*MUON, "--muon_ns_dtype=float16"], "muon_ns_dtype must be 'bfloat16' or 'float32'"),
    ([*MUON, "--muon_momentum=1.0"], r"muon_momentum must be in \[0, 1\)"),
    ([*MUON, "--muon_momentum=-0.1"], r"muon_momentum must be in \[0, 1\)"),
    (
        [*MUON, "--arch=gpt2"],
        "GPT-2's blocks also hold biases and LayerNorm weights: use it with --arch=speedrun",
    ),
    ([*MUON, "--muon_learning_rate=0.0"], "needs --muon_learning_rate > 0"),
    ([*MUON, "--learning_rate=0.0"], "learning_rate must be > 0"),
    (["--arch=llama"], "arch must be 'gpt2', 'speedrun', 'speedrun20' or 'nanochat'"),
    (["--arch=speedrun", "--bias=True"], "set bias=False"),
    (["--arch=speedrun20", "--block_size=200"], "block_size must be a multiple of 128, got 200"),
    (["--arch=speedrun20", "--fp8_head=1"], "fp8_head must be bool"),
    (["--fp8_head=True"], "fp8_head is record 20's FP8 head: it needs arch='speedrun20'"),
    (
        ["--arch=speedrun20", "--fp8_head=True", "--block_size=256"],
        "a micro-batch of 3072 tokens would overflow FP8; it needs batch_size x block_size >= 9363",
    ),
    (
        ["--arch=speedrun20", "--window_size=0"],
        r"^window_size must be an integer >= 1 \(tokens\), got 0$",
    ),
    (["--arch=speedrun20", "--window_size=1.5"], "window_size must be int"),
    (
        ["--window_size=256"],
        "window_size is record 20's attention window: it needs arch='speedrun20'",
    ),
    (
        ["--embed_dtype=bfloat16"],
        "embed_dtype is record 20's bf16 embedding tables: it needs arch='speedrun20'",
    ),
    (["--arch=speedrun20", "--embed_dtype=fp16"], "embed_dtype must be 'float32' or 'bfloat16'"),
    (["--val_tokens=-1"], "val_tokens must be >= 0"),
    (["--warmdown_iters=-1"], "warmdown_iters must be >= 0"),
]


@pytest.mark.parametrize("args, message", BAD)
def test_bad_setting_is_one_line(args, message):
    validate(configure(DEFAULTS, MUON))  # the base of most: valid
    with pytest.raises(UsageError, match=message) as e:
        validate(configure(DEFAULTS, args))
    assert "\n" not in str(e.value)


def test_start_up_says_how_the_fp8_head_multiplies_and_which_tables_are_bf16():
    from compute import sharding
    from run import runlog

    def parameters_line(*args):
        # the baby config at the record's 64K tokens a micro-batch, which FP8 takes
        c = configure(
            DEFAULTS, ["config/speedrun20_shakespeare_char.py", "--batch_size=256", *args]
        )
        validate(c)
        lines = runlog.startup_lines(
            c, sharding.make_mesh(), (1, 12), None, 1e6, GPTConfig(arch="speedrun20"), (0, 0)
        )
        return next(line for line in "\n".join(lines).splitlines() if "parameters" in line)

    fp8 = "; FP8 head in training (the record's e4m3/e5m2 rounding, multiplied in bf16)"
    assert parameters_line("--fp8_head=True").endswith(f"cooldown schedule{fp8}")
    assert fp8 not in parameters_line()
    tables = "; dtype auto, embedding tables bfloat16; Muon"
    assert tables in parameters_line("--embed_dtype=bfloat16") and "tables" not in parameters_line()


def test_checkpoint_fixes_arch():
    speedrun = asdict(GPTConfig(arch="speedrun", bias=False))
    c = dict(DEFAULTS)
    assert fixed_by_checkpoint(c, speedrun, typed={"arch"}) == {"arch": "gpt2"}
    assert c["arch"] == "speedrun"
    c = dict(DEFAULTS)  # not typed: a config file's or the default, followed without a word
    assert fixed_by_checkpoint(c, speedrun) == {} and c["arch"] == "speedrun"
    # a checkpoint from before arch
    older = {k: v for k, v in asdict(GPTConfig()).items() if k != "arch"}
    c = dict(DEFAULTS, arch="speedrun")
    assert fixed_by_checkpoint(c, older, typed={"arch"}) == {"arch": "speedrun"}
    assert c["arch"] == "gpt2"


def test_adamw_takes_the_runs_betas_and_weight_decay_as_torch_does():
    """optimizer='adamw' with betas and a weight decay that are neither optax's defaults nor
    torch's: three steps equal torch.optim.AdamW's, the matrix decayed, the bias not (nanoGPT's
    groups)."""
    import torch

    c = dict(
        DEFAULTS,
        optimizer="adamw",
        beta1=0.5,
        beta2=0.8,
        weight_decay=0.3,
        learning_rate=0.1,
        decay_lr=False,
    )
    rng = np.random.default_rng(0)
    params = {
        "kernel": rng.normal(size=(3, 4)).astype(np.float32),
        "bias": rng.normal(size=4).astype(np.float32),
    }
    grads = [
        {k: rng.normal(size=v.shape).astype(np.float32) for k, v in params.items()}
        for _ in range(3)
    ]
    tx, ours = train_step.make_optimizer(c), jax.tree.map(jnp.asarray, params)
    state = tx.init(ours)
    for g in grads:
        updates, state = tx.update(jax.tree.map(jnp.asarray, g), state, ours)
        ours = optax.apply_updates(ours, updates)
    theirs = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    opt = torch.optim.AdamW(
        [
            {"params": [theirs["kernel"]], "weight_decay": 0.3},
            {"params": [theirs["bias"]], "weight_decay": 0.0},
        ],
        lr=0.1,
        betas=(0.5, 0.8),
        eps=1e-8,
    )
    for g in grads:
        for k, p in theirs.items():
            p.grad = torch.tensor(g[k])
        opt.step()
    for k, p in theirs.items():
        assert_close(ours[k], p.detach().numpy(), atol=1e-6, what=k)


def linear_step():
    """train_step's step (AdamW) on a Linear(2, 3), whose loss a test sets by patching
    train_step.batch_loss: key -> the step's metrics on a batch of zeros."""
    graphdef, params = nnx.split(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
    tx = train_step.make_optimizer(dict(DEFAULTS, optimizer="adamw"))
    step, opt_state, x = (
        train_step.make_train_step(graphdef, tx, grad_clip=1.0),
        tx.init(params),
        jnp.zeros((1, 2, 8)),
    )
    return lambda key: step(params, opt_state, x, x, key)[2]


def test_a_step_hands_its_key_to_the_loss(monkeypatch):
    """The step's key reaches the loss, whose dropout draws its masks from it: the same key, the
    same loss; another key, another loss."""
    monkeypatch.setattr(
        train_step,
        "batch_loss",
        lambda model, x, y, key, window=None: jnp.mean(model.bias[...]) + jax.random.uniform(key),
    )
    step = linear_step()
    losses = [float(step(jax.random.key(k))["loss"]) for k in (0, 0, 1)]
    assert losses[0] == losses[1] != losses[2], losses


def test_a_step_is_finite_only_where_its_loss_and_gradient_norm_both_are(monkeypatch):
    """A loss of sqrt(b) at b = 0 (a Linear's bias starts at zeros): 0, finite, with an infinite
    gradient; such a step is not finite (train.py stops the run before it is saved), nor is one
    whose loss is not."""
    step = linear_step()
    for loss, finite in [
        (lambda m: jnp.mean(m.bias[...] ** 2), True),
        (lambda m: jnp.sqrt(m.bias[...][0]), False),
        (lambda m: jnp.log(m.bias[...][0]), False),
    ]:
        monkeypatch.setattr(
            train_step, "batch_loss", lambda model, x, y, key, window=None: loss(model)
        )
        metrics = step(jax.random.key(0))
        assert bool(metrics["finite"]) is finite, (metrics, finite)
