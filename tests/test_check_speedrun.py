"""python -m pytest tests/test_check_speedrun.py -q

parity.check_speedrun, the proof of the speedrun recipe: train.py's step with arch='speedrun', Muon
and the trapezoid equals modded-nanogpt's record 5 in PyTorch (parity/speedrun_reference.py) for 12
steps on the same .bin shards, through the zero-initialised projections' first steps and a warmdown
to 0, in fp32; on one device and on 8 fake CPU devices (fsdp 4 x tensor 2, accumulation, the layers
under one scan); the fused QKV orthogonalised whole, the trap the record's Muon avoids, fails by a
wide margin; bad input is one line. bf16 is a docs/speedrun.md command."""

import re

import jax
import pytest
from helpers import one_torch_thread

from archs import muon
from parity import check_speedrun, check_train, train_report, train_sides

# as test_check_train: held to check_train's tolerances at XLA's defaults
pytestmark = pytest.mark.xla_defaults


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # the tiny model on 2 shared cores: one thread is faster (test_check_train)
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The run, its batches (our loader's, checked equal to the record's) and the reference's
    results, once."""
    check_train.pin_numerics()
    run, shards = check_speedrun.make_run(
        check_speedrun.parse_args([]), str(tmp_path_factory.mktemp("speedrun"))
    )
    batches = check_speedrun.make_batches(run, shards)
    reference = train_sides.train_side(check_speedrun.TorchSide(run.model_dir, run.c), batches)
    return run, batches, reference


def ours_against_reference(tiny):
    run, batches, reference = tiny
    ours = train_sides.train_side(check_speedrun.JaxSide(run, "float32"), batches)
    return train_report.report(run, {"torch": reference, "jax": ours})


def test_tiny_fp32_matches_the_record(tiny, capsys):
    ok, f = ours_against_reference(tiny)
    assert ok and "fp32 training parity" in capsys.readouterr().out
    assert f["ref_losses"][-1] < f["ref_losses"][0] - 2.0  # it trained
    final = tiny[2]["final"]
    # zero init, then moved
    assert all(abs(final[k]).max() > 0 for k in final if k.endswith("c_proj.weight"))
    lrs = [r["lr"] for r in tiny[2]["records"]]
    # constant until max_iters - warmdown, then down to 0
    assert lrs[0] == lrs[8] > lrs[9] > lrs[-1] > 0


@pytest.mark.slow  # a mesh computes what one device does: make test checks it (test_sharding.py)
def test_8_fake_devices_sharded(capfd):
    """main() with one device runs the check again on 8 fake CPU devices: fsdp 4 x tensor 2, 2
    micro-batches, the layers under one scan (Muon's Newton-Schulz gathered whole on every device,
    its momentum split as its param)."""
    assert jax.device_count() < 8
    code = check_speedrun.main(
        ["--fsdp", "4", "--tensor_parallel", "2", "--accum", "2", "--scan_layers"]
    )
    out = capfd.readouterr().out
    assert (
        "running on 8 fake CPU devices" in out
        and "ours on 8 cpu device(s) (fsdp 4, tensor 2;" in out
    )
    assert code == 0 and "fp32 training parity" in out and ": OK" in out, out[-3000:]


@pytest.mark.slow
def test_qkv_orthogonalised_whole_fails(tiny, monkeypatch, capsys):
    """A public JAX port's kind of slip: the fused (C, 3C) QKV update orthogonalised as one matrix,
    not as the record's three (C, C) ones. NOT OK, by far more than a tolerance's noise."""
    monkeypatch.setattr(muon, "FUSED_QKV", re.compile(r"matches no param$"))
    ok, f = ours_against_reference(tiny)
    assert not ok and "NOT OK" in capsys.readouterr().out
    assert (
        f["loss_rel"] > 10 * train_report.LOSS_TOL
        and f["param_norm_rel"] > 10 * train_report.PARAM_NORM_TOL
    ), f


def test_bad_input_is_one_line():
    from configurator import UsageError

    for args, message in [
        (["--steps", "4"], "--steps must be > the warmdown's 4"),
        (["--accum", "3"], "16 rows per step do not split into --accum 3"),
        (["--fsdp", "3", "--devices", "8"], "--fsdp 3 x --tensor_parallel 1 must divide"),
    ]:
        with pytest.raises(UsageError, match=message) as e:
            check_speedrun.parse_args(args)
        assert "\n" not in str(e.value)
