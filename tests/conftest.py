import os
import pickle

import numpy as np
import pytest

# Tests run on one CPU device; multi-device tests start subprocesses with fake devices (helpers.fake_devices).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
# JAX's persistent compilation cache, for this process and the scripts the tests start: a second run of
# the suite compiles little (the scripts turn it on themselves; here it stays out of the user's cache)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".pytest_cache", "jax"))
# every compilation, as the scripts cache them (checkpoint.use_compilation_cache): the two pytest workers and the
# scripts the tests start compile many of the same small programs
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


# Modules whose tests share a module-scoped fixture that takes long to make: pytest-xdist runs each on one worker.
ONE_WORKER = {"test_sharding.py", "test_check_train.py", "test_compute_settings.py", "test_hellaswag.py",
              "test_sample.py", "test_fineweb.py"}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """With pytest-xdist's --dist load (make test: -n auto), a module of ONE_WORKER is one unit of work, so that its
    fixtures are made once (--dist load's chunks of consecutive tests may split it between workers); every other
    test is a unit of its own. Workers take the next unit as they free up: the modules first, then the tests."""
    from xdist.scheduler import LoadScopeScheduling

    class Scheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            module = nodeid.split("::", 1)[0]
            return module if os.path.basename(module) in ONE_WORKER else nodeid

    return Scheduling(config, log) if config.getvalue("dist") == "load" else None


@pytest.fixture(scope="module", autouse=True)
def matmul_precision_of_the_module():
    """parity's pin_numerics sets JAX's default matmul precision for the whole process; set it back after each
    module, so that what the next module compiles (and its key in the compilation cache, shared with the other
    worker and the scripts) does not depend on which modules this worker ran before."""
    import jax

    before = jax.config.jax_default_matmul_precision
    yield
    jax.config.update("jax_default_matmul_precision", before)


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
