"""nanochat's finetuning schedules (archs/nanochat_sft.py): chat_sft's learning-rate multiplier of
progress and Muon's momentum, and the steps and progress its loop takes over a mixture; with
NANOCHAT_CHECKOUT, against chat_sft.py's own functions and its own loader's loop.

    python -m pytest tests/test_nanochat_sft.py -q
"""

import os
import random
from types import SimpleNamespace

import numpy as np
import pytest

from archs import nanochat_sft
from dataio.sft_loader import ConversationLoader
from parity import chat_sft_code

CHECKOUT = os.environ.get("NANOCHAT_CHECKOUT")
needs_checkout = pytest.mark.skipif(
    not CHECKOUT, reason="NANOCHAT_CHECKOUT is not set: chat_sft.py's own code needs its checkout"
)
PROGRESS = [0.0, 0.1, 0.25, 0.5, 0.5000001, 0.6, 0.75, 0.9, 1.0, 1.05]


def test_the_rate_holds_then_falls_to_zero_over_the_second_half():
    found = [float(nanochat_sft.lr_multiplier(p)) for p in PROGRESS]
    np.testing.assert_allclose(found, [1, 1, 1, 1, 1 - 2e-7, 0.8, 0.5, 0.2, 0, -0.1], atol=1e-6)
    warm = [float(nanochat_sft.lr_multiplier(p, warmup_ratio=0.2)) for p in (0.0, 0.1, 0.2)]
    np.testing.assert_allclose(warm, [5e-8, 0.5, 1.0], rtol=1e-6)


def test_muons_momentum_warms_from_085_to_095_over_300_steps():
    found = [float(nanochat_sft.muon_momentum(it)) for it in (0, 150, 300, 1000)]
    np.testing.assert_allclose(found, [0.85, 0.90, 0.95, 0.95], rtol=1e-6)


def fake_loader(n, accum, max_iters=0, seed=0):
    rng = random.Random(seed)
    lengths = [rng.randint(2, 20) for _ in range(n)]
    render = lambda i: ([0] * lengths[i], [1] * lengths[i])  # noqa: E731
    iterations = max_iters * accum + 1 if max_iters else 0
    return ConversationLoader(list(range(n)), render, 0, 31, 2, num_iterations=iterations)


def test_the_table_counts_the_steps_until_the_mixture_is_consumed():
    steps, progress = nanochat_sft.progress_table(fake_loader(200, accum=2), accum=2)
    assert progress == sorted(progress) and progress[-2] < 1 <= progress[-1]
    replay = fake_loader(200, accum=2)
    for step in range(steps):
        assert not replay.last_step
        replay.next(2)
        assert replay.progress == progress[step]
    assert replay.last_step
    steps, progress = nanochat_sft.progress_table(fake_loader(200, 2, max_iters=5), accum=2)
    assert steps == 5 and progress == [(2 * s + 3) / 11 for s in range(5)]


@needs_checkout
def test_chat_sfts_own_schedules_are_ours():
    args = SimpleNamespace(warmup_ratio=0.0, warmdown_ratio=0.5, final_lr_frac=0.0)
    own = chat_sft_code.definitions(CHECKOUT, ["get_lr_multiplier", "get_muon_momentum"], args=args)
    for p in PROGRESS:
        np.testing.assert_allclose(
            nanochat_sft.lr_multiplier(p), own["get_lr_multiplier"](p), atol=1e-7
        )
    for it in (0, 1, 77, 299, 300, 5000):
        np.testing.assert_allclose(
            nanochat_sft.muon_momentum(it), own["get_muon_momentum"](it), rtol=1e-7
        )


@needs_checkout
@pytest.mark.parametrize("max_iters", [0, 4])
def test_chat_sfts_own_loop_takes_the_steps_of_the_table(max_iters):
    """Its loop over its own loader: the same number of steps, each at the same progress."""
    accum, n = 2, 150
    rng = random.Random(1)
    lengths = [rng.randint(2, 20) for _ in range(n)]
    tokenizer = SimpleNamespace(
        get_bos_token_id=lambda: 0,
        render_conversation=lambda i: ([0] * lengths[i], [1] * lengths[i]),
    )
    iterations = max_iters * accum + 1 if max_iters else -1
    args = SimpleNamespace(device_batch_size=2, max_seq_len=31, num_iterations=iterations)
    loader, scope = chat_sft_code.loader(CHECKOUT, tokenizer, list(range(n)), args)
    next(loader)
    theirs, progress = [], 0
    while not scope["last_step"]:  # chat_sft's loop, its model left out
        for _ in range(accum):
            next(loader)
            progress = max(progress, scope["approx_progress"])
        theirs.append(progress)
    ours = ConversationLoader(
        list(range(n)),
        tokenizer.render_conversation,
        0,
        31,
        2,
        num_iterations=max(iterations, 0),
    )
    assert nanochat_sft.progress_table(ours, accum) == (len(theirs), theirs)


@pytest.mark.slow
def test_bits_per_byte_leaves_the_ignored_targets_out():
    """Finetuning's val batches hold targets of -1 (not learned): they carry no nats and no bytes
    (nanochat's evaluate_bpb: never index token_bytes with them), and the loss is the mean over
    the others."""
    import math

    import jax
    from flax import nnx
    from helpers import tiny_config

    from archs.models import build
    from run.train_step import bits_per_byte, make_eval_step

    model = build(tiny_config(arch="nanochat", bias=False, n_embd=32), nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    rng = np.random.default_rng(0)
    token_bytes = rng.integers(1, 5, 128)
    token_bytes[:8] = 0  # special tokens
    x = rng.integers(0, 128, (2, 16))
    y = np.where(rng.random((2, 16)) < 0.4, -1, rng.integers(0, 128, (2, 16)))
    loss, bpb = bits_per_byte(
        [make_eval_step(graphdef, params, token_bytes)(jax.tree.leaves(params), x, y)]
    )
    logits = np.asarray(model(x)[0], np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, np.maximum(y, 0)[..., None], -1)[..., 0]
    learned = y >= 0
    spells = learned & (token_bytes[np.maximum(y, 0)] > 0)
    assert math.isclose(loss, nll[learned].mean(), rel_tol=1e-5)
    assert math.isclose(
        bpb, nll[spells].sum() / (math.log(2) * token_bytes[y[spells]].sum()), rel_tol=1e-5
    )
