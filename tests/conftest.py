import os
import pickle

import numpy as np
import pytest

# Tests run on one CPU device; multi-device tests start subprocesses with their own XLA_FLAGS.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
# JAX's persistent compilation cache, for this process and the scripts the tests start: a second run of
# the suite compiles little (the scripts turn it on themselves; here it stays out of the user's cache)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".pytest_cache", "jax"))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """A small character-level dataset: train.bin, val.bin, meta.pkl (vocab 64)."""
    d = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    text = np.cumsum(rng.integers(1, 4, 30000)) % 64  # some structure to learn
    text.astype(np.uint16)[:27000].tofile(d / "train.bin")
    text.astype(np.uint16)[27000:].tofile(d / "val.bin")
    with open(d / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 64, "itos": {}, "stoi": {}}, f)
    return str(d)
