import os
import pickle

import numpy as np
import pytest

# Tests run on one CPU device; multi-device tests start subprocesses with fake devices
# (helpers.fake_devices).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
# torch (and numpy's BLAS) start a thread per core in every process: with two pytest workers and the
# commands they start on 2 cores, those threads only contend (docs/benchmarks.md#the-test-suite)
os.environ.setdefault("OMP_NUM_THREADS", "1")
# JAX's persistent compilation cache, for this process and the scripts the tests start: a second run
# of the suite compiles little (the scripts turn it on themselves; here it stays out of the user's
# cache)
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".pytest_cache", "jax"
    ),
)
# every compilation, as the scripts cache them (sharding.use_compilation_cache): the two pytest
# workers and the scripts the tests start compile many of the same small programs
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# XLA:CPU compiles the suite's programs in about half the time with LLVM at -O0 and its older fusion
# code generator: in this process, the pytest workers and every command the tests start. Their
# numbers differ from XLA's defaults in the last bits (tanh by 5e-7); every parity test holds its
# tolerance either way, but for check_train's: its 10 training steps amplify them to its grad-norm
# tolerance (|Δgnorm|/gnorm vs PyTorch 1.04e-4 with 4 micro-batches, over 1e-4; 2.9e-5 at XLA's
# defaults). Tests marked xla_defaults compile at XLA's defaults, as users do.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK_COMPILE = ["--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false"]
XLA_DEFAULTS = {"xla_backend_optimization_level": 3, "xla_cpu_use_fusion_emitters": True}
# the user's XLA_FLAGS (a worker inherits this process's, QUICK_COMPILE included)
XLA_FLAGS_OUTSIDE = " ".join(
    f for f in os.environ.get("XLA_FLAGS", "").split() if f not in QUICK_COMPILE
)
os.environ["XLA_FLAGS"] = " ".join([XLA_FLAGS_OUTSIDE, *QUICK_COMPILE]).strip()


# Parametrized cases that make test leaves to make test-slow (CI runs both): each a heavier case of
# a claim that a cheaper case of the same test holds in make test (docs/tests.md#two-tiers). Whole
# tests left out carry @pytest.mark.slow where they are defined.
SLOW_CASES = {
    "test_attention.py::test_splash_matches_xla[1-1024]",
    "test_check_train.py::test_a_port_that_differs_from_nanogpt_fails[embeddings not decayed]",
    "test_compute_settings.py::test_each_setting_computes_the_same_logits_loss_and_gradients"
    "[gpt2-explicit attention]",
    "test_export.py::test_each_export_and_checkpoint_file_gets_the_umasks_mode[18]",
    "test_hellaswag.py::test_cli_and_parity_cli[resume]",
    "test_muon20.py::test_one_muon_update_in_the_momentum_warmup_equals_the_records[400]",
    "test_hellaswag.py::test_parity_cli_catches_a_bug_in_our_loader[nanogpt]",
    "test_compute_settings.py::test_each_setting_computes_the_same_logits_loss_and_gradients"
    "[gpt2-remat block]",
    "test_reliability.py::test_a_stop_during_the_first_compilation_is_one_line_and_exit_128_plus_the_signal"
    "[ctrl-c]",
    "test_nanochat_model.py::test_logits_and_loss_equal_the_references[even-depth]",
    "test_nanochat_optim.py::test_the_check_catches_a_broken_muon[no-caution]",
    "test_scan_layers.py::test_a_checkpoint_restores_into_the_other_layout_bit_for_bit[True]",
    "test_speedrun20_model.py::test_kv_cache_generation_is_the_full_forward[1728]",
    "test_speedrun20_model.py::test_the_banded_kernel_is_the_masked_one[0]",
    "test_speedrun20_parity.py::test_logits_loss_and_gradients_are_the_records[2]",
    "test_speedrun_model.py::test_every_attention_kernel_takes_the_rotated_normed_q_and_k[explicit]",
    "test_speedrun_model.py::test_scan_layers_remat_and_loss_chunk_compute_the_same_loss_and_grads"
    "[block-chunks]",
    "test_speedrun_model.py::test_scan_layers_remat_and_loss_chunk_compute_the_same_loss_and_grads"
    "[scan-dots-chunks]",
    "test_tpu.py::test_generate_compiles_for_a_tpu[auto_scan]",
    "test_tpu.py::test_train_step_compiles_for_a_tpu[auto_scan]",
    "test_train.py::test_batch_loss_in_halves_is_the_models_loss[0]",
    "test_window_attention.py::test_the_tables_visit_exactly_the_tiles_the_window_meets[256-7]",
    "test_window_attention.py::test_window_flash_is_the_masked_kernel[tiles0-0]",
    "test_window_attention.py::test_window_flash_is_the_masked_kernel[tiles2-8]",
    "test_window_attention.py::test_window_splash_is_the_masked_kernel[128-8-0]",
    "test_window_attention.py::test_window_splash_is_the_masked_kernel[512-3-2]",
}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """SLOW_CASES marked slow before -m selects (tryfirst: ahead of pytest's own selection)."""
    for item in items:
        if item.nodeid.split("/")[-1] in SLOW_CASES:
            item.add_marker(pytest.mark.slow)


# Modules whose tests share a module-scoped fixture that takes long to make, or (the browser's)
# go on from the page the test before left: pytest-xdist runs each on one worker.
ONE_WORKER = {
    "test_chat_web_browser.py",
    "test_sharding.py",
    "test_check_train.py",
    "test_compute_settings.py",
    "test_hellaswag.py",
    "test_sample.py",
    "test_fineweb.py",
    "test_eval.py",
    "test_core_eval.py",
    "test_nanochat_mesh.py",
    "test_nanochat_interop.py",
    "test_gcs_run.py",
}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """With pytest-xdist's --dist load (make test: -n auto), a module of ONE_WORKER is one unit of
    work, so that its fixtures are made once (--dist load's chunks of consecutive tests may split it
    between workers); every other test is a unit of its own. Workers take the next unit as they free
    up: the modules first, then the tests."""
    from xdist.scheduler import LoadScopeScheduling

    class Scheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            module = nodeid.split("::", 1)[0]
            return module if os.path.basename(module) in ONE_WORKER else nodeid

    return Scheduling(config, log) if config.getvalue("dist") == "load" else None


def compile_at_xla_defaults(on):
    """This process's compilations and the commands it starts: at XLA's defaults (on) or
    QUICK_COMPILE."""
    import jax
    from jax._src import compiler

    global mode, quick_compile_options
    if mode is None:
        # part of jit's cache keys: no program reused across modes
        mode = jax.make_user_context(False)
        jax.devices()  # XLA reads XLA_FLAGS once, as its backend starts: with QUICK_COMPILE
        quick_compile_options = compiler.get_compile_options
    if on == mode.get_global():
        return
    mode.set_global(on)
    compiler.get_compile_options = at_xla_defaults if on else quick_compile_options
    os.environ["XLA_FLAGS"] = " ".join([XLA_FLAGS_OUTSIDE, *([] if on else QUICK_COMPILE)]).strip()


def at_xla_defaults(*args, env_options_overrides=None, **kwargs):
    return quick_compile_options(
        *args, env_options_overrides={**XLA_DEFAULTS, **(env_options_overrides or {})}, **kwargs
    )


mode = quick_compile_options = None


@pytest.fixture(scope="module", autouse=True)
def xla_defaults_module(request):
    """A module marked xla_defaults (its pytestmark) compiles at XLA's defaults from its first
    fixture on."""
    compile_at_xla_defaults(request.node.get_closest_marker("xla_defaults") is not None)


@pytest.fixture(scope="module", autouse=True)
def matmul_precision_of_the_module():
    """parity's pin_numerics sets JAX's default matmul precision for the whole process; set it back
    after each module, so that what the next module compiles (and its key in the compilation cache,
    shared with the other worker and the scripts) does not depend on which modules this worker ran
    before."""
    import jax

    before = jax.config.jax_default_matmul_precision
    yield
    jax.config.update("jax_default_matmul_precision", before)


@pytest.fixture(scope="module")
def examples():
    """HellaSwag's test fixture as we render it (helpers/hellaswag.py), once a module."""
    from helpers import hellaswag

    return hellaswag.examples()


@pytest.fixture(scope="module")
def reference_rows():
    """HellaSwag's test fixture as build-nanogpt's reference renders it, once a module."""
    from helpers import hellaswag

    return hellaswag.reference_rows()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """A small character-level dataset: train.bin, val.bin, meta.pkl (64 characters)."""
    d = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    text = np.cumsum(rng.integers(1, 4, 30000)) % 64  # some structure to learn
    text.astype(np.uint16)[:27000].tofile(d / "train.bin")
    text.astype(np.uint16)[27000:].tofile(d / "val.bin")
    chars = [chr(48 + i) for i in range(64)]  # '0'..'o'
    with open(d / "meta.pkl", "wb") as f:  # as nanoGPT's data/shakespeare_char/prepare.py writes it
        pickle.dump(
            {
                "vocab_size": 64,
                "itos": dict(enumerate(chars)),
                "stoi": {c: i for i, c in enumerate(chars)},
            },
            f,
        )
    return str(d)


@pytest.fixture
def bin_file(tmp_path):
    """A train.bin of the tokens 0..4999."""
    path = tmp_path / "train.bin"
    np.arange(5000, dtype=np.uint16).tofile(path)
    return str(path)


@pytest.fixture
def shards(tmp_path):
    """Three train shards of different lengths holding consecutive integers, and one val shard."""
    sizes, start, paths = [100, 70, 130], 0, []
    for i, n in enumerate(sizes):
        p = tmp_path / f"edufineweb_train_{i + 1:06d}.npy"
        np.save(p, np.arange(start, start + n, dtype=np.uint16))
        paths.append(str(p))
        start += n
    np.save(tmp_path / "edufineweb_val_000000.npy", np.arange(1000, 1100, dtype=np.uint16))
    return tmp_path, paths


@pytest.fixture(scope="session")
def gcs():
    """A Cloud Storage emulator on loopback (tools/gcs_emulator.py), one per pytest worker, in
    memory: this process and the commands the tests start reach it through the environment it sets.
    Yields that environment."""
    import subprocess
    import sys
    import uuid

    from helpers import free_port

    from tools.gcs_emulator import client_env

    port = free_port()
    server = subprocess.Popen(
        [sys.executable, os.path.join(REPO, "tools", "gcs_emulator.py"), str(port)],
        # its per-request noise
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert server.stdout.readline().strip() == "ready", "the GCS emulator did not start"
    env = client_env(port)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    env["GCS_TEST_RUN"] = uuid.uuid4().hex[:8]
    try:
        yield env
    finally:
        server.kill()
        server.wait()
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


@pytest.fixture
def gcs_dir(gcs, request):
    """A folder of its own in the emulator's bucket: gs://nanogpt-test/<worker run>/<test>."""
    from tools.gcs_emulator import BUCKET

    name = "".join(ch if ch.isalnum() else "-" for ch in request.node.name)
    return f"gs://{BUCKET}/{gcs['GCS_TEST_RUN']}/{name}"
