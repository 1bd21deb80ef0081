"""python -m pytest tests/test_gcs_run.py -q

A run whose out_dir is on Cloud Storage (gs:// on the emulator of tools/gcs_emulator.py, on
loopback): checkpoints, log and lock there, a kill -9 and a resume bit for bit, sample.py,
export.py, plot.py and hellaswag.py reading the run; rotation keeping the best and checksums
refusing other arrays; a second run refused by the lock; a bucket missing, refused or unreachable
and no credentials, each one line before anything is written; and hosts that share no disk, told so.
Two processes resuming on gs://: tests/test_sharding.py."""

import ast
import json
import math
import os
import re
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import (
    HELLASWAG_FIXTURE,
    REPO,
    TINY,
    fake_devices,
    free_port,
    one_line_error,
    settings,
    tiny_config,
    train_cli,
)

import checkpoint
import export
import hellaswag
import plot
import runlog
import sample
import storage
import train
from configurator import RunStopped, UsageError
from tools.gcs_emulator import FORBIDDEN, client_env

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


def one_line(result, code):
    """helpers.one_line_error, but for tensorstore's note that it uses the emulator's test token
    (tests only)."""
    result.stderr = "".join(
        line for line in result.stderr.splitlines(True) if "AUTH_TOKEN_FOR_TESTING" not in line
    )
    return one_line_error(result, code)


def log_of(out_dir):
    """iter -> the last loss logged for it (a resume logs the steps after its checkpoint again)."""
    text = storage.read_bytes(storage.join(out_dir, runlog.LOG_FILE)).decode()
    return {r["iter"]: r["loss"] for r in map(json.loads, text.splitlines()) if "loss" in r}


def test_a_run_on_gs_killed_mid_run_resumes_bit_for_bit(killed_and_resumed, straight):
    out, resumed = killed_and_resumed
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert not os.path.exists(os.path.join(REPO, "gs:")), "a local folder named gs:"
    final = checkpoint.restore(out)["meta"]
    assert final["iter_num"] == 8
    # every array, bit for bit
    assert final["digests"] == checkpoint.restore(straight)["meta"]["digests"]
    assert log_of(out) == log_of(straight)  # every step logged, with the straight run's loss
    assert not storage.exists(storage.join(out, runlog.LOCK_FILE))  # released at the end


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
        storage.join(out, runlog.LOCK_FILE), json.dumps({"run": "another", **holder}).encode()
    )


def test_the_lock_on_gs_refuses_a_live_run_and_takes_over_a_dead_ones(
    dataset, gcs_dir, monkeypatch
):
    out = f"{gcs_dir}/locked"
    monkeypatch.setattr(runlog, "LOCK_REFRESH_S", 0.2)
    first = runlog.ObjectLock(out)
    held = json.loads(storage.read_bytes(storage.join(out, runlog.LOCK_FILE)))
    time.sleep(1)
    assert (
        json.loads(storage.read_bytes(storage.join(out, runlog.LOCK_FILE)))["refreshed"]
        > held["refreshed"]
    )
    with pytest.raises(
        UsageError, match=r"locked is in use by another run \(pid \d+ on .*, lock refreshed 0 s ago"
    ):
        runlog.ObjectLock(out)
    with pytest.raises(UsageError, match="is in use by another run"):
        train.Trainer(settings(dataset, out))
    assert not storage.exists(storage.join(out, runlog.LOG_FILE))
    first.close()
    assert not storage.exists(storage.join(out, runlog.LOCK_FILE))

    # a process of this host that has ended: its lock is a killed run's
    gone = subprocess.Popen(["true"])
    gone.wait()
    write_lock(out, host=socket.gethostname(), pid=gone.pid, refreshed=time.time())
    runlog.ObjectLock(out).close()
    # another host's, refreshed: alive
    write_lock(out, host="another-host", pid=1, refreshed=time.time())
    with pytest.raises(UsageError, match="in use by another run"):
        runlog.ObjectLock(out)
    # not refreshed
    write_lock(out, host="another-host", pid=1, refreshed=time.time() - runlog.LOCK_STALE_S - 1)
    runlog.ObjectLock(out).close()


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


def test_a_save_failing_on_gs_with_no_cause_named_asks_the_store_why(gcs_dir, monkeypatch):
    """orbax's error as the network goes mid-save may name no cause: 'Path is not a directory'
    (fsspec answers False to isdir on any error). The failed save's line then says what listing the
    bucket says: nothing more while the store answers; the lost connection and 'check the network'
    where it does not (the clients' retries here without their waits)."""
    import asyncio
    from types import SimpleNamespace

    import gcsfs

    out = f"{gcs_dir}/no-cause"
    mngr = checkpoint.manager(out)
    checkpoint.save(
        mngr,
        2,
        {"w": np.ones(3, np.float32)},
        {"n": np.zeros((), np.int32)},
        checkpoint.meta_for(tiny_config(), {}, 2, math.inf, {}),
    )
    checkpoint.wait_saved(mngr)

    def failed_save():
        with pytest.raises(RunStopped) as e, checkpoint._save_errors(mngr):
            raise NotADirectoryError(f"Path is not a directory: {out}/ckpt/4")
        return str(e.value)

    assert failed_save() == (
        f"saving a checkpoint to {out}/ckpt failed (Path is not a directory: {out}/ckpt/4); the "
        "run stopped. Checkpoint 2 is intact: fix the cause above and resume from it"
    )
    # nothing listens there
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{free_port()}")
    no_wait = asyncio.sleep
    monkeypatch.setattr(gcsfs.retry, "asyncio", SimpleNamespace(sleep=lambda seconds: no_wait(0)))
    gcsfs.GCSFileSystem.clear_instance_cache()  # fsspec's cached client talks to the emulator
    try:
        line = failed_save()
    finally:
        gcsfs.GCSFileSystem.clear_instance_cache()
        mngr.close()
    assert re.fullmatch(
        rf"saving a checkpoint to {out}/ckpt failed \(Cannot connect to host 127\.0\.0\.1:\d+ "
        r".*\); "
        "the run stopped. Checkpoint 2 is intact: check the network and resume from it",
        line,
    ), line


@pytest.mark.parametrize(
    ("bucket", "message"),
    [
        ("no-such-bucket", "the bucket gs://no-such-bucket does not exist: create it"),
        (FORBIDDEN, f"permission denied on gs://{FORBIDDEN} .*roles/storage.objectAdmin"),
    ],
)
def test_a_missing_or_refused_bucket_is_one_line_before_anything(dataset, gcs, bucket, message):
    with pytest.raises(UsageError, match=message):
        train.Trainer(settings(dataset, f"gs://{bucket}/run"))


def test_no_credentials_is_one_line(dataset, gcs):
    bare = {k: v for k, v in os.environ.items() if k not in gcs}
    no_credentials = {
        **bare,
        "GOOGLE_APPLICATION_CREDENTIALS": "/no/such/key.json",
        "NO_GCE_CHECK": "True",
    }
    err = one_line_error(
        subprocess.run(
            [
                sys.executable,
                "train.py",
                *TINY,
                f"--dataset={dataset}",
                "--out_dir=gs://nanogpt-test/unreached",
            ],
            cwd=REPO,
            env=no_credentials,
            capture_output=True,
            text=True,
            timeout=120,
        ),
        2,
    )
    assert "no Google Cloud credentials to reach gs://nanogpt-test" in err and "gcloud auth" in err


@pytest.mark.slow
def test_no_network_at_start_is_one_line(dataset, gcs):
    """After gcsfs's retries, about 30 s of waiting: slow."""
    unreachable = {**os.environ, "STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{free_port()}"}
    err = one_line_error(
        subprocess.run(
            [
                sys.executable,
                "train.py",
                *TINY,
                f"--dataset={dataset}",
                "--out_dir=gs://nanogpt-test/unreached",
            ],
            cwd=REPO,
            env=unreachable,
            capture_output=True,
            text=True,
            timeout=300,
        ),
        1,
    )
    assert "cannot reach gs://nanogpt-test" in err


def test_hosts_that_share_no_disk_are_told_so(dataset, tmp_path):
    """Two processes, each with a tmpfs of its own mounted at the same out_dir (its own mount
    namespace): each host's own disk. Both stop, in one line naming out_dir and the way out."""
    if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip(
            "unshare -m (a mount namespace per process) is not permitted here: it needs root"
        )
    out = tmp_path / "out"
    out.mkdir()
    port = free_port()
    private = f'mount -t tmpfs tmpfs "{out}" && exec "$0" "$@"'

    def process(i):
        env = {
            **fake_devices(2),
            "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
            "JAX_NUM_PROCESSES": "2",
            "JAX_PROCESS_ID": str(i),
        }
        return subprocess.Popen(
            [
                "unshare",
                "-m",
                "sh",
                "-c",
                private,
                sys.executable,
                "train.py",
                *TINY,
                f"--dataset={dataset}",
                f"--out_dir={out}",
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    procs = [process(i) for i in range(2)]
    try:
        results = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, results):
        line = one_line_error(subprocess.CompletedProcess(p.args, p.returncode, "", err), 2)
        assert f"out_dir {out} is not shared by the run's hosts: process(es) 1 do not see" in line
        assert "gs://bucket/run" in line
    assert os.listdir(out) == []  # the mounts went with the processes: nothing on this disk


@pytest.mark.slow
def test_the_network_gone_mid_run_is_one_line_and_the_last_checkpoint_restores(dataset, tmp_path):
    """An emulator of its own, kept on disk, stopped once the save of step 50 completed: the run
    stops at a later save, after the clients' retries, in one line naming the last checkpoint it saw
    complete: the newest on the store, or the one before it when that one's save was in flight as
    the network went (its files may be whole, its finalizing failed); never the one that failed.
    Restarted, the emulator serves it, and it restores. Slow: python -m pytest -m slow
    tests/test_gcs_run.py -k network"""
    port, out = free_port(), "gs://nanogpt-test/network-gone"
    env = {**{k: v for k, v in os.environ.items() if k not in client_env(0)}, **client_env(port)}

    def emulator():
        server = subprocess.Popen(
            [sys.executable, "tools/gcs_emulator.py", str(port), str(tmp_path)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert server.stdout.readline().strip() == "ready"
        return server

    def steps():  # in a process of its own: this one's clients talk to the suite's emulator
        code = f"import checkpoint; print(checkpoint.all_steps('{out}'))"
        return subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True
        ).stdout

    server = emulator()
    run = subprocess.Popen(
        [
            sys.executable,
            "train.py",
            *TINY,
            f"--dataset={dataset}",
            f"--out_dir={out}",
            "--max_iters=100000",
            "--checkpoint_interval=50",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for line in run.stdout:
            if line.startswith("iter 60:"):
                break
        while "50" not in steps():
            time.sleep(0.2)
        server.kill()
        server.wait()
        # gcsfs's retries: about 100 s; tensorstore's, when the network goes while it writes a
        # save's arrays: 15 min
        _, err = run.communicate(timeout=1200)
    finally:
        run.kill()
        server.kill()
    line = one_line(subprocess.CompletedProcess(run.args, run.returncode, "", err), 1)
    assert (
        f"saving a checkpoint to {out}/ckpt failed" in line and "cannot connect" in line.lower()
    ), line
    server = emulator()
    try:
        intact = re.search(
            r"Checkpoint (\d+) is intact: check the network and resume from it$", line
        )
        assert intact, line
        named, there = int(intact[1]), ast.literal_eval(steps())
        # 50: the interval
        assert named >= 50 and named in there and max(there) - named in (0, 50), (line, there)
        code = (
            f"import checkpoint; "
            f"print(checkpoint.restore('{out}', step={named})['meta']['iter_num'])"
        )
        restored = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True
        )
        assert restored.stdout.strip() == str(named), restored.stderr[-3000:]
    finally:
        server.kill()
