"""python -m pytest tests/test_runlog.py -q

run/runlog.py's pieces in process, where a whole run would not look: the start record and each log
step's record as log.jsonl keeps them, a results path that is a directory, and the shared out_dir's
check on one process (a run of several: tests/test_multiprocess.py's commands)."""

import json
import os

import jax
import pytest
from helpers import settings

from configurator import UsageError
from dataio import storage
from run import runlog


def records(out_dir):
    with open(os.path.join(out_dir, runlog.LOG_FILE)) as f:
        return [json.loads(line) for line in f]


def test_the_logs_records_name_the_dataset_and_the_tokens_per_second(dataset, tmp_path):
    c = settings(dataset, tmp_path)
    log = runlog.RunLog(c, True, tokens_per_iter=512, flops_per_iter=1, devices=jax.devices())
    log.start(c, [], 0, False, (10, 20), None)
    log.clock.start(0)
    log.step(0, {"loss": 2.0, "lr": 0.1, "grad_norm": 1.0})
    start, step = records(tmp_path)
    assert (start["event"], start["dataset"], start["step_peak_bytes_per_device"]) == (
        "start",
        c["dataset"],
        20,
    )
    assert step["tok_per_s"] == pytest.approx(512 / (step["ms"] / 1000))


def test_a_results_path_that_is_a_directory_is_one_line(tmp_path):
    with pytest.raises(UsageError, match=r"^--out=.* is a directory: give a file's path$"):
        runlog.check_results_file(str(tmp_path), "--out")


def test_one_process_shares_its_out_dir_and_a_marker_not_read_back_is_named(tmp_path, monkeypatch):
    out = str(tmp_path / "out")
    runlog.check_shared(out, True)  # one process: it reads what it wrote
    assert os.path.exists(os.path.join(out, runlog.SHARED_MARKER))

    def unreadable(path):
        raise OSError("not this host's disk")

    monkeypatch.setattr(storage, "read_bytes", unreadable)
    with pytest.raises(UsageError, match=r"not shared by the run's hosts: process\(es\) 0 do not"):
        runlog.check_shared(out, True)
