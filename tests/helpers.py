"""Shared test helpers."""

import numpy as np


def assert_close(actual, expected, rtol=0.0, atol=0.0, what=""):
    """np.testing-style closeness, but the failure message reports max and mean abs diff."""
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert a.shape == e.shape, f"{what} shape {a.shape} != {e.shape}"
    diff = np.abs(a - e)
    bad = diff > atol + rtol * np.abs(e)
    assert not bad.any(), (f"{what} not close: max abs diff {diff.max():.3g}, mean abs diff {diff.mean():.3g}, "
                           f"{bad.sum()} of {bad.size} beyond atol={atol:g} rtol={rtol:g}")


def tiny_config(**kw):
    from model import GPTConfig

    return GPTConfig(**{"block_size": 32, "vocab_size": 128, "n_layer": 2, "n_head": 2, "n_embd": 64, **kw})
