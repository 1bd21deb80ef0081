"""python -m pytest tests/test_gcs_failures.py -q

A run on Cloud Storage (gs:// on the emulator of tools/gcs_emulator.py, on loopback) when the store
fails it: a bucket missing or refused, no credentials, the network gone at start, each one line
before anything is written; a save that fails naming no cause asks the store why; the network gone
mid-run stops it at the next save in one line naming the last checkpoint that completed, which
restores; and hosts that share no disk, told so (the run on gs:// that goes well:
test_gcs_run.py)."""

import ast
import math
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import REPO, TINY, fake_devices, free_port, one_line_error, settings, tiny_config

import train
from configurator import RunStopped, UsageError
from run import checkpoint
from tools.gcs_emulator import FORBIDDEN, client_env


def one_line(result, code):
    """helpers.one_line_error, but for tensorstore's note that it uses the emulator's test token
    (tests only)."""
    result.stderr = "".join(
        line for line in result.stderr.splitlines(True) if "AUTH_TOKEN_FOR_TESTING" not in line
    )
    return one_line_error(result, code)


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


@pytest.mark.slow
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
    tests/test_gcs_failures.py -k network"""
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
        code = f"from run import checkpoint; print(checkpoint.all_steps('{out}'))"
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
            f"from run import checkpoint; "
            f"print(checkpoint.restore('{out}', step={named})['meta']['iter_num'])"
        )
        restored = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True
        )
        assert restored.stdout.strip() == str(named), restored.stderr[-3000:]
    finally:
        server.kill()
