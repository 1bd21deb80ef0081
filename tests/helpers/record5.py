"""Record 5's model in both frameworks, for test_speedrun_model.py and test_speedrun_files.py: the
record's GPT (parity/speedrun_reference.py) with every matrix random, ours holding its weights, its
logits, tokens of its tiny vocabulary, fp32 matmuls as written."""

import math

import jax
import numpy as np
import pytest
import torch

from archs.models import model_from
from dataio.pretrained import from_modded_state, modded_config
from model import GPTConfig
from parity import speedrun_reference as record

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
    """Our GPT holding the record's weights, through dataio/weights.py's state_step*.pt mapping."""
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
