"""python -m pytest tests/test_check_speedrun20.py -q

parity.check_speedrun --record 20, the proof of record 20's recipe: train.py's step with
arch='speedrun20', optimizer='muon20' and the cooldown equals the record in PyTorch
(parity/speedrun20_reference.py, parity/speedrun20_training.py) for 12 steps on the same shards,
across the windows' growth, the momentum's warmup and the cooldown, in fp32, on one device and on
8 fake CPU devices as fsdp 4 x tensor 2; the long and short windows swapped fails; bad input is one
line."""

import pytest
from helpers import one_torch_thread

from archs import record20
from configurator import UsageError
from parity import check_speedrun, speedrun20_check, train_report, train_sides
from parity.common import pin_numerics

pytestmark = pytest.mark.xla_defaults  # held to check_train's tolerances at XLA's defaults


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The run (2 blocks a sequence: the windows still change), its steps (our loader's, checked
    equal to the record's) and the reference's results, once."""
    with one_torch_thread():
        pin_numerics()
        args = check_speedrun.parse_args(["--record", "20", "--seq-len", "256"])  # 12 steps
        run = speedrun20_check.make_run(args, str(tmp_path_factory.mktemp("speedrun20")))
        batches = speedrun20_check.make_batches(run)
        reference = train_sides.train_side(
            speedrun20_check.TorchSide(run.model_dir, run, 1), batches
        )
    return run, batches, reference


def ours_against_reference(tiny):
    run, batches, reference = tiny
    ours = train_sides.train_side(speedrun20_check.jax_side(run), batches)
    return train_report.report(run, {"torch": reference, "jax": ours})


# slow (make test-slow; CI runs it): ~50 s, the 50304-row head of 12 steps on each side; make test
# holds each piece against the record (test_speedrun20_*.py, test_muon20.py)
@pytest.mark.slow
def test_tiny_fp32_matches_the_record(tiny):
    ok, f = ours_against_reference(tiny)
    assert ok and f["ref_losses"][-1] < f["ref_losses"][0] - 1.0  # it trained
    lrs = [r["lr"] for r in tiny[2]["records"]]
    assert lrs[0] == lrs[7] > lrs[8] > lrs[-1] > 0  # constant, then the last 40% down


@pytest.mark.slow
def test_the_long_and_short_windows_swapped_fail(tiny, monkeypatch):
    layout = record20.record20_layout
    monkeypatch.setattr(
        record20,
        "record20_layout",
        lambda n: [(table, attends, not long) for table, attends, long in layout(n)],
    )
    ok, f = ours_against_reference(tiny)
    assert not ok and f["loss_rel"] > 1e-4


@pytest.mark.slow
def test_8_fake_devices_sharded(capfd):
    """main() with one device runs the check again on 8 fake CPU devices as fsdp 4 x tensor 2,
    torch standing for the record's 4 ranks (our batch shards)."""
    import jax

    assert jax.device_count() < 8
    code = check_speedrun.main(["--record", "20", "--fsdp", "4", "--tensor_parallel", "2"])
    out = capfd.readouterr().out
    assert (
        "torch on cpu as 4 rank(s), ours on 8 cpu device(s) (fsdp 4, tensor 2; attention auto)"
        in out
    )
    assert code == 0 and "fp32 training parity" in out and ": OK" in out, out[-3000:]


def test_bad_input_is_one_line():
    """Record 20's 4 sequences a step do not split into 3 micro-batches."""
    with pytest.raises(UsageError, match="^4 rows per step do not split into --accum 3"):
        check_speedrun.parse_args(["--record", "20", "--accum", "3"])
    with pytest.raises(UsageError, match="--seeds >= 1, got .* 0$"):
        check_speedrun.parse_args(["--record", "20", "--seeds", "0"])


def test_bf16_over_seeds_is_judged_by_the_medians(capsys):
    """--seeds N in bf16: each seed's drift from fp32 side by side, judged by the medians (one
    seed's own, ours or the record's, can be an outlier of 10x or more)."""

    def figures(ours, theirs):
        side = lambda x: dict.fromkeys(train_report.BF16_JUDGED, x)  # noqa: E731
        return {"jax bf16": side(ours), "torch autocast-bf16": side(theirs)}

    outlier_each = {0: figures(2.5e-4, 3e-5), 1: figures(3e-5, 1.2e-3), 2: figures(4e-5, 9e-5)}
    ok, median = train_report.report_bf16_seeds(outlier_each)
    assert ok and median["jax bf16"]["mean_loss_rel"] == 4e-5
    assert "median" in capsys.readouterr().out
    ours_worse = {0: figures(2.5e-4, 3e-5), 1: figures(1e-4, 4e-5), 2: figures(4e-5, 9e-5)}
    assert not train_report.report_bf16_seeds(ours_worse)[0]  # 1e-4 > 2 x 4e-5
