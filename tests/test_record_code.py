"""python -m pytest tests/test_record_code.py -q

`parity.check_speedrun --own CHECKOUT`: the records' own code as the torch side
(parity/record_code.py, parity/own_sides.py). Without a checkout: the dense path that stands in for
FlexAttention's GPU kernel equals FlexAttention's forward where every causal block is present and an
explicit window mask elsewhere; a bad checkout, log or record is one line. With a modded-nanogpt
checkout (MODDED_NANOGPT=PATH, or ../modded-nanogpt beside the repo; marked slow): ours equals
record 20's and record 5's own code, a short window one block longer fails, and the record's own
init is reported beside its float64 run."""

import os

import numpy as np
import pytest
import torch
from helpers import REPO, assert_close, one_torch_thread
from torch.nn.attention import flex_attention as flex
from torch.nn.attention.flex_attention import BlockMask

from archs import record20
from configurator import UsageError
from parity import check_speedrun, own_sides, speedrun20_check, train_report, train_sides
from parity import speedrun20_reference as ref
from parity.common import pin_numerics
from parity.record_code import RECORDS, RecordCode, dense_flex_attention, visited_pairs

EOT = 50256
CHECKOUT = os.environ.get("MODDED_NANOGPT", os.path.join(os.path.dirname(REPO), "modded-nanogpt"))


def record_block_mask(seq, window, block_size, long=True):
    """The record's BlockMask (its block lists, as the reference reads them, with its mask_mod)."""
    tensors = ref.record_block_tensors(seq, window, block_size)[0 if long else 1]
    mask_mod = ref.document_causal_mod(ref.documents(seq))
    return BlockMask.from_kv_blocks(*tensors, BLOCK_SIZE=block_size, mask_mod=mask_mod)


def sequence(n, eots, seed=0):
    seq = torch.randint(0, EOT, (n,), generator=torch.Generator().manual_seed(seed))
    seq[list(eots)] = EOT
    return seq


def test_dense_path_is_flex_attentions_forward_over_every_causal_block(monkeypatch):
    # the eager hop itself (no dynamo around it): FlexAttention's CPU forward, mask_mod everywhere
    monkeypatch.setattr(flex, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)
    bs, nb = 16, 6
    seq = sequence(bs * nb, eots=[5, 37, 48, 70])  # mid-block, and one on a block's first token
    q, k, v = torch.randn(3, 1, 2, bs * nb, 8, generator=torch.Generator().manual_seed(1))
    bm = record_block_mask(seq, nb, bs)
    expected = flex.flex_attention(q, k, v, block_mask=bm, scale=0.12)
    assert_close(dense_flex_attention(q, k, v, bm, 0.12), expected, atol=2e-6)


def test_dense_path_is_the_explicit_window_elsewhere():
    """At windows 0-5, long and short: the query's document, causally, in its own block and the
    max(w, 1) - 1 before it (w // 2 for the short one), where FlexAttention's CPU path would see
    the whole document."""
    bs, nb = 16, 6
    seq = sequence(bs * nb, eots=[5, 37, 48, 70])
    T = len(seq)
    pos, docs = np.arange(T), np.cumsum(seq.numpy() == EOT)
    document_causal = (pos[:, None] >= pos) & (docs[:, None] == docs)
    block = pos // bs
    q, k, v = torch.randn(3, 1, 2, T, 8, generator=torch.Generator().manual_seed(2))
    for w in range(6):
        for long, blocks in ((True, w), (False, w // 2)):
            explicit = torch.from_numpy(document_causal & (block[:, None] - block < max(blocks, 1)))
            bm = record_block_mask(seq, w, bs, long)
            assert torch.equal(visited_pairs(bm), explicit), (w, long)
            assert_close(
                dense_flex_attention(q, k, v, bm, 0.12), ref.dense_attention(q, k, v, explicit)
            )
    windowed = visited_pairs(record_block_mask(seq, 2, bs))
    assert not torch.equal(windowed, torch.from_numpy(document_causal))  # the window cuts


# ----------------------------------------------------------------------------- bad input
def fake_checkout(tmp_path, record, text):
    path = tmp_path / RECORDS[record].path
    path.parent.mkdir(parents=True)
    path.write_text(text)
    return str(tmp_path)


def test_bad_checkouts_are_one_line(tmp_path):
    with pytest.raises(UsageError, match="^--own .*nowhere: no such directory"):
        RecordCode(str(tmp_path / "nowhere"), 20)
    with pytest.raises(UsageError, match="^--own .*: no records/.*Sub3Min/.*txt .record 20's log"):
        RecordCode(str(tmp_path), 20)
    with pytest.raises(UsageError, match="^--own: record 7 is not ported .records 5, 20.$"):
        RecordCode(str(tmp_path), 7)
    with pytest.raises(SystemExit):  # argparse's own line
        check_speedrun.parse_args(["--record", "7", "--own", str(tmp_path)])


def test_a_log_without_its_code_is_one_line(tmp_path):
    checkout = fake_checkout(tmp_path, 20, "step:1/1393 train_time:100ms\n" * 3)
    with pytest.raises(UsageError, match=r"\.txt: no code part found \(the record's code, then"):
        RecordCode(checkout, 20)


def test_other_code_is_one_line(tmp_path):
    """A file whose text is not the record's as ported (here record 5 without its bf16 cast)."""
    checkout = fake_checkout(tmp_path, 5, "import sys\nwith open(sys.argv[0]) as f: pass\n")
    with pytest.raises(UsageError, match=r"0 x '@torch.compile\\n' where record 5's code has 1"):
        RecordCode(checkout, 5)


def test_own_refuses_what_it_cannot_run():
    with pytest.raises(UsageError, match="^--own runs the record's code in fp32"):
        check_speedrun.parse_args(["--own", "x", "--dtype", "bfloat16"])
    with pytest.raises(UsageError, match="^--record-init is for --own --record 20"):
        check_speedrun.parse_args(["--record", "20", "--record-init"])


# ----------------------------------------------------------------------------- with a checkout
checkout = pytest.mark.skipif(
    not os.path.isdir(os.path.join(CHECKOUT, "records")),
    reason="no modded-nanogpt checkout (MODDED_NANOGPT=PATH, or ../modded-nanogpt): "
    "parity.check_speedrun --own not run",
)


@pytest.fixture(scope="module")
def own20(tmp_path_factory):
    """Record 20's own code from the checkout, its run and its results, once."""
    with one_torch_thread():
        pin_numerics()
        args = check_speedrun.parse_args(["--record", "20", "--own", CHECKOUT])
        code = RecordCode(CHECKOUT, 20)
        run = speedrun20_check.make_run(args, str(tmp_path_factory.mktemp("own20")), code)
        batches = speedrun20_check.make_batches(run)
        own_sides.check_record20_loader(code, run.data_dir, batches)
        side = own_sides.Record20Own(code, run.model_dir, run, 1)
        theirs = train_sides.train_side(side, batches)
    return run, batches, theirs


def ours_against_own(own20):
    run, batches, theirs = own20
    ours = train_sides.train_side(speedrun20_check.jax_side(run), batches)
    return train_report.report(run, {"torch": theirs, "jax": ours})


@checkout
@pytest.mark.slow
@pytest.mark.xla_defaults
def test_record20_equals_its_own_code(own20):
    ok, f = ours_against_own(own20)
    assert ok and f["ref_losses"][-1] < f["ref_losses"][0] - 1.0  # it trained


@checkout
@pytest.mark.slow
def test_the_reference_is_the_records_own_code(own20):
    """parity/speedrun20_reference.py, which make test and CI run without a checkout, trains as the
    record's own code does: the same params after 12 steps, bit for bit."""
    run, batches, theirs = own20
    with one_torch_thread():
        reference = train_sides.train_side(
            speedrun20_check.TorchSide(run.model_dir, run, 1), batches
        )
    for name, value in theirs["final"].items():
        assert np.array_equal(reference["final"][name], value), name
    for r, t in zip(reference["records"], theirs["records"]):
        assert abs(r["loss"] - t["loss"]) <= 1e-6 * t["loss"]


@checkout
@pytest.mark.slow
@pytest.mark.xla_defaults
def test_a_short_window_one_block_longer_fails(own20, monkeypatch):
    window = record20.Record20Block.window
    monkeypatch.setattr(
        record20.Record20Block,
        "window",
        lambda self, blocks: window(self, blocks) + (0 if self.long else 1),
    )
    ok, f = ours_against_own(own20)
    assert not ok and f["loss_rel"] > 1e-5


@checkout
@pytest.mark.slow
def test_record5s_reference_is_its_own_code(tmp_path):
    """parity/speedrun_reference.py trains as record 5's own train_gpt2.py does, to fp32's last
    bits."""
    with one_torch_thread():
        pin_numerics()
        code = RecordCode(CHECKOUT, 5)
        run, shards = check_speedrun.make_run(check_speedrun.parse_args([]), str(tmp_path), code)
        batches = check_speedrun.make_batches(run, shards)
        theirs = own_sides.Record5Own(code, run.model_dir, check_speedrun.TINY, run)
        reference = check_speedrun.TorchSide(run.model_dir, dict(run.c, muon_ns_dtype="float32"))
        theirs, reference = (train_sides.train_side(s, batches) for s in (theirs, reference))
    for name, value in theirs["final"].items():
        assert_close(reference["final"][name], value, atol=2e-7, what=name)
    for r, t in zip(reference["records"], theirs["records"]):
        assert abs(r["loss"] - t["loss"]) <= 1e-6 * t["loss"]


@checkout
@pytest.mark.slow
def test_record5_equals_its_own_code_on_a_mesh(capfd):
    """main(): record 5's own train_gpt2.py against ours on 8 fake CPU devices (fsdp 4 x tensor 2,
    2 micro-batches); the edits printed."""
    argv = ["--own", CHECKOUT, "--fsdp", "4", "--tensor_parallel", "2", "--accum", "2"]
    code = check_speedrun.main(argv)
    out = capfd.readouterr().out
    assert "'X = G.bfloat16()' -> 'X = G.clone()'" in out and "loaders' batches equal" in out
    assert code == 0 and "fp32 training parity" in out and ": OK" in out, out[-3000:]


@checkout
@pytest.mark.slow
def test_the_records_own_init_is_reported_beside_float64(capfd):
    code = check_speedrun.main(
        ["--record", "20", "--own", CHECKOUT, "--record-init", "--seq-len", "256", "--steps", "6"]
    )
    out = capfd.readouterr().out
    assert code == 0 and "record fp32 vs fp64" in out and "steps 0-1: worst" in out, out[-3000:]
