"""nanochat's pretraining run against nanochat's own (parity/check_nanochat_run.py), and the two
things a run from nanochat's own files needs: its shards folder read as it is, and its checkpoint's
window pattern kept unless one is typed.

    python -m pytest tests/test_nanochat_run.py -q
    NANOCHAT_CHECKOUT=../nanochat python -m pytest tests/test_nanochat_run.py -q -m slow
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from dataio.dataloader import make_loader
from run.train_setup import take_from_start
from tests.helpers import REPO
from tests.helpers.nanochat_data import shakespeare_folder

CHECKOUT = os.environ.get("NANOCHAT_CHECKOUT")
needs_checkout = pytest.mark.skipif(
    not CHECKOUT,
    reason="NANOCHAT_CHECKOUT is not set: nanochat's own base_train needs its checkout",
)


def check(*argv):
    return subprocess.run(
        [sys.executable, "-m", "parity.check_nanochat_run", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
    )


def test_nanochats_own_shards_folder_is_read_as_it_is(tmp_path):
    """base_data_climbmix/*.parquet (no shards/ below it) with --tokenizer: the rows are the ones
    our own layout's folder gives."""
    ours = shakespeare_folder(tmp_path / "ours", vocab=300, docs=300)
    theirs = tmp_path / "base_data_climbmix"
    theirs.mkdir()
    for shard in sorted((ours / "shards").iterdir()):
        os.link(shard, theirs / shard.name)
    tokenizer = str(ours / "tokenizer")
    (x, y), (x2, y2) = (
        make_loader(str(folder), "train", 32, 4, seed=0, tokenizer=tokenizer).next(3)
        for folder in (ours, theirs)
    )
    np.testing.assert_array_equal(x, x2)
    np.testing.assert_array_equal(y, y2)


def nanochat_start(folder, window_pattern):
    folder.mkdir()
    config = dict(sequence_len=64, vocab_size=300, n_layer=2, n_head=2, n_kv_head=2, n_embd=32)
    meta = {"step": 0, "model_config": {**config, "window_pattern": window_pattern}}
    (folder / "meta_000000.json").write_text(json.dumps(meta))
    (folder / "model_000000.pt").write_bytes(b"")  # only its name is read here
    return str(folder)


@pytest.mark.parametrize("typed", [(), ("window_pattern",)])
def test_a_nanochat_checkpoints_windows_hold_unless_typed(tmp_path, typed):
    c = {"init_from": nanochat_start(tmp_path / "ckpt", "SSL"), "window_pattern": "L"}
    c |= {"tokenizer": "given", "lr_schedule": "warmdown"}
    take_from_start(c, str(tmp_path), typed)
    assert c["window_pattern"] == ("L" if typed else "SSL")
    c = {"init_from": "scratch", "window_pattern": "L", "lr_schedule": "warmdown"}
    take_from_start(c, str(tmp_path))
    assert c["window_pattern"] == "L"


def test_the_tokenizer_beside_a_nanochat_checkpoint_serves_where_none_is_given(tmp_path):
    """nanochat's base dir: base_checkpoints/d2/ and tokenizer/ two folders up; a --tokenizer or
    the dataset's own tokenizer/ wins."""
    (tmp_path / "base_checkpoints").mkdir()
    ckpt = nanochat_start(tmp_path / "base_checkpoints" / "d2", "L")
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "tokenizer.pkl").write_bytes(b"")
    data = tmp_path / "data"
    data.mkdir()
    c = {"init_from": ckpt, "window_pattern": "L", "tokenizer": "", "lr_schedule": "warmdown"}
    take_from_start(c, str(data))
    assert c["tokenizer"] == str(tmp_path / "tokenizer")
    c = {"init_from": ckpt, "window_pattern": "L", "tokenizer": "mine", "lr_schedule": "warmdown"}
    take_from_start(c, str(data))
    assert c["tokenizer"] == "mine"
    (data / "tokenizer").mkdir()
    (data / "tokenizer" / "tokenizer.pkl").write_bytes(b"")
    c = {"init_from": ckpt, "window_pattern": "L", "tokenizer": "", "lr_schedule": "warmdown"}
    take_from_start(c, str(data))
    assert c["tokenizer"] == ""


def test_the_check_without_a_checkout_is_one_line(tmp_path):
    done = check("--own", str(tmp_path))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"error: --own {tmp_path}: no scripts/base_train.py there (a nanochat checkout?)"
    ]


@pytest.mark.slow
@needs_checkout
def test_train_py_runs_nanochats_own_base_train_loss_by_loss():
    """8 steps from nanochat's own init (projections drawn), through warmup, the constant phase
    and warmdown: every loss within 1e-5 relative, the export's tensors within 1e-3 (or 10x the
    spread between two of nanochat's own runs)."""
    done = check("--own", CHECKOUT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().endswith("nanochat's pretraining run: OK")


@pytest.mark.slow
@needs_checkout
def test_a_window_pattern_given_to_our_side_only_is_caught():
    done = check("--own", CHECKOUT, "--slip=window_pattern=SL")
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.strip().endswith("nanochat's pretraining run: NOT OK")
