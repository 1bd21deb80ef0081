"""python -m pytest tests/test_gcs_run.py -q

A run whose out_dir is on Cloud Storage (gs:// on the emulator of tools/gcs_emulator.py, on
loopback): checkpoints, log and lock there, a kill -9 and a resume bit for bit, sample.py,
export.py, plot.py and hellaswag.py reading the run; rotation keeping the best and checksums
refusing other arrays; a second run refused by the lock; --start_over moving the previous run aside.
A bucket missing, refused or unreachable, no credentials, the network gone, hosts that share no
disk: tests/test_gcs_failures.py. Two processes resuming on gs://: tests/test_sharding.py."""

import json
import math
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import HELLASWAG_FIXTURE, REPO, TINY, settings, tiny_config, train_cli

import export
import hellaswag
import plot
import sample
import train
from configurator import UsageError
from dataio import storage
from run import checkpoint, run_lock, runlog
from tools.gcs_emulator import FORBIDDEN

STEPS = ["--max_iters=8", "--checkpoint_interval=2"]


@pytest.fixture(scope="module")
def straight(dataset, tmp_path_factory):
    """8 steps straight through, on local disk, as a command as the run on gs:// is (in this
    process, what other modules set in the worker, as the matmul precision, would be part of the
    comparison)."""
    out = str(tmp_path_factory.mktemp("straight"))
    result = train_cli([*TINY, f"--dataset={dataset}", f"--out_dir={out}", *STEPS])
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def killed_and_resumed(dataset, gcs):
    """The same 8 steps on gs://: killed (kill -9) once past the save of step 4, which may still be
    in flight, then resumed. (out_dir, the resume's result)."""
    out = f"gs://nanogpt-test/{gcs['GCS_TEST_RUN']}/killed-and-resumed"
    args = [*TINY, f"--dataset={dataset}", f"--out_dir={out}", *STEPS]
    killed = subprocess.Popen(
        [sys.executable, "train.py", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        for line in killed.stdout:
            if line.startswith("iter 5:"):
                break
    finally:
        killed.kill()
        killed.communicate()
    return out, train_cli([*args, "--init_from=resume"])


def log_of(out_dir):
    """iter -> the last loss logged for it (a resume logs the steps after its checkpoint again)."""
    text = storage.read_bytes(storage.join(out_dir, runlog.LOG_FILE)).decode()
    return {r["iter"]: r["loss"] for r in map(json.loads, text.splitlines()) if "loss" in r}


# make test-slow (CI runs it): make test holds its parts, a run on gs://
# (tests/test_gcs_data.py) and a killed run resumed bit for bit (tests/test_train_loop.py)
@pytest.mark.slow
def test_a_run_on_gs_killed_mid_run_resumes_bit_for_bit(killed_and_resumed, straight):
    out, resumed = killed_and_resumed
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert not os.path.exists(os.path.join(REPO, "gs:")), "a local folder named gs:"
    final = checkpoint.restore(out)["meta"]
    assert final["iter_num"] == 8
    # every array, bit for bit
    assert final["digests"] == checkpoint.restore(straight)["meta"]["digests"]
    assert log_of(out) == log_of(straight)  # every step logged, with the straight run's loss
    assert not storage.exists(storage.join(out, run_lock.LOCK_FILE))  # released at the end


# four commands on gs://: 10 s; make test has each on a local run, and train.py on gs://
@pytest.mark.slow
def test_sample_export_plot_and_hellaswag_read_a_run_on_gs(
    killed_and_resumed, straight, gcs_dir, tmp_path, capsys
):
    """The scripts' commands on the run on gs://; the local run's side, and what is one line, in
    this process."""
    out, _ = killed_and_resumed

    def script(*args):
        result = subprocess.run(
            [sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout

    sample_args = ["--start='0'", "--num_samples=2", "--max_new_tokens=12", "--seed=3"]
    on_gs = script("sample.py", *sample_args, f"--out_dir={out}")
    capsys.readouterr()
    sample.main([*sample_args, f"--out_dir={straight}"])
    # the text after the model's line
    assert on_gs.split("\n", 1)[1] == capsys.readouterr().out.split("\n", 1)[1]
    script("export.py", f"--out_dir={out}", "--format=hf", f"--to={gcs_dir}/hf")
    export.main([f"--out_dir={straight}", "--format=hf", f"--to={tmp_path / 'hf'}"])
    for name in ("config.json", "model.safetensors", "meta.json"):
        assert (
            storage.read_bytes(f"{gcs_dir}/hf/{name}") == (tmp_path / "hf" / name).read_bytes()
        ), name
    with pytest.raises(UsageError, match="holds an earlier export"):
        export.main([f"--out_dir={out}", "--format=hf", f"--to={gcs_dir}/hf"])
    plot.main([out, f"--out={tmp_path / 'loss.png'}"])  # the log, read from gs://
    assert (tmp_path / "loss.png").stat().st_size > 0
    # HellaSwag reads the run from gs:// too, and refuses its character-level vocabulary
    with pytest.raises(UsageError, match="killed-and-resumed is a character-level model"):
        hellaswag.main(["--init_from=resume", f"--out_dir={out}", f"--path={HELLASWAG_FIXTURE}"])


def write_lock(out, **holder):
    storage.write_bytes(
        storage.join(out, run_lock.LOCK_FILE), json.dumps({"run": "another", **holder}).encode()
    )


def test_the_lock_on_gs_refuses_a_live_run_and_takes_over_a_dead_ones(
    dataset, gcs_dir, monkeypatch
):
    out = f"{gcs_dir}/locked"
    monkeypatch.setattr(run_lock, "LOCK_REFRESH_S", 0.2)
    first = run_lock.ObjectLock(out)
    held = json.loads(storage.read_bytes(storage.join(out, run_lock.LOCK_FILE)))
    time.sleep(1)
    assert (
        json.loads(storage.read_bytes(storage.join(out, run_lock.LOCK_FILE)))["refreshed"]
        > held["refreshed"]
    )
    with pytest.raises(
        UsageError,
        match=r"locked is in use by another run \(pid \d+ on .*, lock refreshed 0 s ago\): wait "
        r"for it to end \(a run that died leaves a lock taken over after \d+ s\), or give this one "
        r"another --out_dir$",
    ):
        run_lock.ObjectLock(out)
    # the lock's own write refused: one line naming it
    with pytest.raises(
        UsageError, match=rf"^out_dir lock gs://{FORBIDDEN}/run/run\.lock: permission"
    ):
        run_lock.ObjectLock(f"gs://{FORBIDDEN}/run")
    with pytest.raises(UsageError, match="is in use by another run"):
        train.Trainer(settings(dataset, out))
    assert not storage.exists(storage.join(out, runlog.LOG_FILE))
    first.close()
    assert not storage.exists(storage.join(out, run_lock.LOCK_FILE))

    # a process of this host that has ended: its lock is a killed run's
    gone = subprocess.Popen(["true"])
    gone.wait()
    write_lock(out, host=socket.gethostname(), pid=gone.pid, refreshed=time.time())
    run_lock.ObjectLock(out).close()
    # another host's, refreshed: alive
    write_lock(out, host="another-host", pid=1, refreshed=time.time())
    with pytest.raises(UsageError, match="in use by another run"):
        run_lock.ObjectLock(out)
    # not refreshed
    write_lock(out, host="another-host", pid=1, refreshed=time.time() - run_lock.LOCK_STALE_S - 1)
    run_lock.ObjectLock(out).close()
    # another run created it between this one's look and its own create: that run has it
    monkeypatch.setattr(run_lock.ObjectLock, "_create", lambda self: False)
    monkeypatch.setattr(run_lock.ObjectLock, "_read", lambda self: (None, None))
    with pytest.raises(
        UsageError,
        match=r"locked was taken by another run starting at the same time: give this one another "
        r"--out_dir$",
    ):
        run_lock.ObjectLock(out)


def test_start_over_on_gs_moves_the_previous_run_aside(gcs_dir, capsys):
    out = f"{gcs_dir}/again"
    for name in ("ckpt/4/meta", "log.jsonl", "keep.txt"):
        storage.write_bytes(f"{out}/{name}", name.encode())
    lock = runlog.claim_out_dir(out, move_aside=("ckpt", runlog.LOG_FILE))
    lock.close()
    aside = storage.glob(f"{out}/previous-*")
    assert len(aside) == 1 and f"moved to {aside[0]}" in capsys.readouterr().out
    assert storage.read_bytes(f"{aside[0]}/ckpt/4/meta") == b"ckpt/4/meta"
    assert storage.read_bytes(f"{aside[0]}/log.jsonl") == b"log.jsonl"
    assert not storage.exists(f"{out}/ckpt/4/meta") and not storage.exists(f"{out}/log.jsonl")
    assert storage.read_bytes(f"{out}/keep.txt") == b"keep.txt"


@pytest.mark.slow
def test_on_gs_rotation_keeps_the_best_and_arrays_not_saved_with_a_step_never_restore(gcs_dir):
    """Local disk's guarantees on gs://: rotation keeps the latest and the best (keep 1), across a
    reopening; a step whose array objects are another step's (same shapes, other values) is refused
    by the checksums in its meta."""
    out = f"{gcs_dir}/rotation"
    mngr = checkpoint.manager(out, keep=1)

    def save(step, val_loss=None):
        meta = checkpoint.meta_for(tiny_config(), {}, step, math.inf, {})
        checkpoint.save(
            mngr,
            step,
            {"w": np.full(8, step, np.float32)},
            {"n": np.zeros((), np.int32)},
            meta,
            val_loss,
        )
        checkpoint.wait_saved(mngr)
        return mngr.all_steps()

    assert [save(1, 1.0), save(2), save(3)] == [[1], [1, 2], [1, 3]]  # 1: the best
    mngr.close()
    assert checkpoint.all_steps(out) == [1, 3]
    template = {"w": np.zeros(8, np.float32)}
    assert checkpoint.restore(out, params=template)["params"]["w"].tolist() == [3.0] * 8
    storage.remove(f"{out}/ckpt/3/params", recursive=True)
    for path in storage.glob(f"{out}/ckpt/1/params/**"):
        if storage.isfile(path):
            storage.write_bytes(path.replace("/ckpt/1/", "/ckpt/3/"), storage.read_bytes(path))
    with pytest.raises(
        checkpoint.CheckpointError,
        match=r"ckpt/3 did not restore \(params/w differs from the checksum "
        r"saved with it: the checkpoint is corrupt\); move it away to resume from step 1$",
    ):
        checkpoint.restore(out, params=template)
