"""python -m pytest tests/test_check_train.py -q

parity.check_train on the tiny random GPT-2 (fp32, 10 steps): train.py's step equals nanoGPT's
PyTorch step, with gradient accumulation and on 8 fake CPU devices (fsdp 4 x tensor 2); the check
fails, exit 1, on an lr off by 10x its tolerance and on each way JAX ports have differed from
nanoGPT (weight decay grouping, warmup, clipping: all but the first are marked slow); bad input is
one line and exit code 2. bf16 and the golden run are README commands (too slow for every run)."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_close, one_torch_thread

from parity import check_train, train_report, train_sides
from run import train_step

# conftest: quick compilation moves 10 steps to the edge of the tolerances
pytestmark = pytest.mark.xla_defaults

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 16 rows x 32 tokens (2 micro-batches x 8 devices x 1 row fits); warmup 2 steps, cosine to step 8,
# then min_lr; clipping active at steps 2-4
TINY = ["--steps", "10", "--batch-size", "16"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Torch's OpenMP threads spin at barriers: on 2 shared cores they slow the tiny model 10x; one
    thread is enough (the 8-device run's fresh python too)."""
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny run, its batches and the PyTorch reference's results, trained once for every test
    here."""
    check_train.pin_numerics()
    run = check_train.make_run(
        check_train.parse_args(TINY), str(tmp_path_factory.mktemp("check_train"))
    )
    batches = train_sides.make_batches(run)
    return (
        run,
        batches,
        train_sides.train_side(train_sides.make_trainers(run, "float32")["torch"](), batches),
    )


def ours_against_reference(tiny):
    run, batches, reference = tiny
    ours = train_sides.train_side(train_sides.make_trainers(run, "float32")["jax"](), batches)
    return train_report.report(run, {"torch": reference, "jax": ours})


def test_tiny_fp32_matches_pytorch(tiny, capsys):
    ok, f = ours_against_reference(tiny)
    assert ok and "fp32 training parity" in capsys.readouterr().out
    # it trained: not a comparison of a standing model
    assert f["ref_losses"][-1] < f["ref_losses"][0] - 1.0


@pytest.mark.slow
def test_a_slightly_wrong_step_exits_1(monkeypatch, capsys):
    """The check is tight, and main() says so in its exit code: our learning rate 1e-5 too large
    (10x LR_TOL; the losses of 10 steps do not show it) is NOT OK, exit 1."""
    monkeypatch.setattr(train_step, "get_lr", lambda it, c: get_lr(it, c) * (1 + 1e-5))
    assert check_train.main(TINY) == 1
    out = capsys.readouterr().out
    assert "fp32 training parity" in out and ": NOT OK" in out, out[-3000:]


# make test-slow (CI runs it): make test holds the default setting against PyTorch (above) and
# each setting computing what the default does (test_compute_settings.py)
@pytest.mark.slow
@pytest.mark.parametrize(
    "setting",
    [
        dict(remat="block", loss_chunk=8),
        dict(remat="dots"),
        dict(scan_layers=True, remat="qkv_proj"),
    ],
    ids=["remat block, loss_chunk 8", "remat dots", "scan_layers, remat qkv_proj"],
)
def test_tiny_fp32_matches_pytorch_with_each_compute_setting(setting, tiny, capsys):
    """train.py's remat, loss_chunk and scan_layers settings (--remat, --loss-chunk, --scan_layers)
    change how ours computes, not what: the same tolerances hold (attention 'auto' is 'xla' on a
    CPU: the test above). remat block and loss_chunk 8 in one run: one compilation fewer, seconds
    each at XLA's defaults."""
    run, batches, reference = tiny
    run = run._replace(c=dict(run.c, **setting))
    ours = train_sides.train_side(train_sides.make_trainers(run, "float32")["jax"](), batches)
    ok, _ = train_report.report(run, {"torch": reference, "jax": ours})
    assert ok and "fp32 training parity" in capsys.readouterr().out


# make test-slow (CI runs it): make test holds accumulation equal to one batch
# (tests/test_train_loop.py)
@pytest.mark.slow
def test_accumulation_changes_nothing(tiny, capsys):
    """The whole check with each step's 16 rows as 4 micro-batches of 4: OK, and the losses of one
    batch of 16."""
    ok, f = check_train.check(tiny[0]._replace(accum=4))
    assert ok and "(4 micro-batch(es))" in capsys.readouterr().out
    assert_close(
        f["ref_losses"],
        [r["loss"] for r in tiny[2]["records"]],
        rtol=1e-5,
        what="torch losses, accum 4 vs 1",
    )
    assert_close(
        f["losses"],
        f["ref_losses"],
        rtol=train_report.LOSS_TOL,
        what="jax vs torch losses, accum 4",
    )


@pytest.mark.slow  # a mesh computes what one device does: make test checks it (test_sharding.py)
def test_8_fake_devices_sharded(capfd):
    """main() in a process with one device runs the check again on 8 fake CPU devices, as fsdp 4 x
    tensor 2 (with accumulation too, and the layers under one scan)."""
    assert jax.device_count() < 8
    code = check_train.main(
        [*TINY, "--fsdp", "4", "--tensor_parallel", "2", "--accum", "2", "--scan_layers"]
    )
    out = capfd.readouterr().out
    assert (
        "running on 8 fake CPU devices" in out
        and "ours on 8 cpu device(s) (fsdp 4, tensor 2;" in out
    )
    assert code == 0 and "fp32 training parity" in out and ": OK" in out, out[-3000:]


def no_decay_on_embeddings(params):
    return jax.tree_util.tree_map_with_path(
        lambda path, p: p.ndim >= 2 and "embedding" not in jax.tree_util.keystr(path), params
    )


get_lr, make_train_step = train_step.get_lr, train_step.make_train_step
# The ways JAX ports of nanoGPT have differed from it (the list), each applied to our side
# only; each is another compile, so only the first runs in the fast suite
BUGS = {
    "embeddings not decayed": ("decay_mask", no_decay_on_embeddings),
    "every tensor decayed": ("decay_mask", lambda params: jax.tree.map(lambda p: True, params)),
    "no warmup": ("get_lr", lambda it, c: get_lr(jnp.maximum(it, c["warmup_iters"]), c)),
    "no clipping": (
        "make_train_step",
        lambda graphdef, tx, grad_clip: make_train_step(graphdef, tx, 0.0),
    ),
}


@pytest.mark.parametrize(
    "bug", [pytest.param(b, marks=[] if i == 0 else pytest.mark.slow) for i, b in enumerate(BUGS)]
)
def test_a_port_that_differs_from_nanogpt_fails(bug, tiny, monkeypatch, capsys):
    monkeypatch.setattr(train_step, *BUGS[bug])
    ok, f = ours_against_reference(tiny)
    assert not ok and "NOT OK" in capsys.readouterr().out
    # caught by a wide margin, not by noise at the edge of a tolerance
    assert (
        f["loss_rel"] > 10 * train_report.LOSS_TOL
        or f["param_norm_rel"] > 10 * train_report.PARAM_NORM_TOL
        or f["lr_rel"] > 10 * train_report.LR_TOL
    ), f


def cli(*args):
    r = subprocess.run(
        [sys.executable, "-m", "parity.check_train", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return r.returncode, r.stderr.strip()


def test_bad_input_is_one_line_exit_2():
    for args, message in [
        (["--accum", "3"], "32 rows per step do not split into --accum 3"),
        (["--steps", "0"], "must be >= 1"),
        (["--model", "nowhere"], "--model takes tiny, a size"),
        (["--config", "nope"], "no config"),
        (["--config", "shakespeare_char", "--model", "gpt2"], "--config sets the model"),
        (["--loss-chunk", "-1"], "--loss-chunk must be >= 0"),
    ]:
        code, err = cli(*args)
        assert code == 2 and err.startswith("error: ") and message in err and "\n" not in err, (
            args,
            err,
        )
