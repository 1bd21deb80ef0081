"""python -m pytest tests/test_failed_saves.py -q

A save that fails loses nothing and says so in one line: a full disk, writes past a file size limit,
a read-only folder, a failure as the save starts or in the background; the line names the checkpoint
still intact (one whose save was seen to complete and whose folder is still there) and the fix its
first cause calls for; orbax's noise of normal and failed saves stays off stderr."""

import errno
import logging
import os
import shlex
import shutil
import subprocess
import sys
import time
import types

import jax
import pytest
from helpers import REPO, TINY, one_line_error, run, train_cli

from configurator import RunStopped
from dataio import storage
from run import checkpoint


@pytest.mark.slow
def test_a_full_disk_during_a_save_is_one_line_on_stderr(dataset, tmp_path):
    """A disk that fills while tensorstore writes the array files: each write still in flight fails
    after orbax has closed its event loop, which was dozens of tracebacks before the one line. A
    tmpfs of 600 kB (where mount is permitted: root) fills during the first save."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(disk)], capture_output=True
    ).returncode:
        pytest.skip("mount -t tmpfs is not permitted here (not root)")
    try:
        r = train_cli(
            [
                *TINY,
                f"--dataset={dataset}",
                f"--out_dir={disk / 'out'}",
                "--max_iters=200",
                "--checkpoint_interval=1",
                "--keep_checkpoints=100",
            ]
        )
    finally:
        subprocess.run(["umount", str(disk)], check=True)
    err = one_line_error(r, 1)
    assert "No space left on device" in err or "RESOURCE_EXHAUSTED" in err, err


# train.py, whose checkpoint files may grow to 4 kB only (RLIMIT_FSIZE, set as the first save
# starts, when every compilation, and its cache file, is done): a write past it fails in
# tensorstore's threads, as on a full disk
FILE_SIZE_LIMIT = r"""if True:
    import resource, signal, sys
    import jax
    import orbax.checkpoint as ocp
    import train
    from run import train_step
    from configurator import exit_on_bad_input
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails (EFBIG) instead of ending the process
    save = ocp.CheckpointManager.save
    def limited_save(self, *args, **kwargs):
        jax.config.update("jax_enable_compilation_cache", False)  # a cache file written from now on could be cut
        resource.setrlimit(resource.RLIMIT_FSIZE, (4000, resource.RLIM_INFINITY))
        return save(self, *args, **kwargs)
    ocp.CheckpointManager.save = limited_save
    exit_on_bad_input(lambda: train.main(sys.argv[1:]))
"""  # noqa: E501


@pytest.mark.slow
def test_writes_failing_during_a_save_are_one_line_on_stderr(dataset, tmp_path):
    """The same without root: the files of a checkpoint may not grow past 4 kB."""
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            FILE_SIZE_LIMIT,
            *TINY,
            f"--dataset={dataset}",
            f"--out_dir={tmp_path}",
            "--max_iters=20",
            "--checkpoint_interval=2",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    err = one_line_error(r, 1)
    assert "saving a checkpoint to" in err and "No checkpoint is left there" in err, err


@pytest.mark.slow
def test_a_read_only_checkpoint_folder_stops_the_run_in_one_line_and_it_exits(dataset, tmp_path):
    """OUT/ckpt read-only under a resumed run (a read-only bind mount, in a private mount namespace:
    root): the failed save is one line with the advice for a permission error, and the process
    exits; it waited forever for orbax's writer threads (issue 33). The timeout fails this test, not
    the suite."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a read-only bind mount needs root and unshare")
    out = tmp_path / "out"
    run(dataset, out, "--checkpoint_interval=2")
    ckpt = out / "ckpt"
    resume = shlex.join(
        [
            sys.executable,
            "train.py",
            *TINY,
            f"--dataset={dataset}",
            f"--out_dir={out}",
            "--init_from=resume",
            "--max_iters=8",
            "--checkpoint_interval=2",
        ]
    )
    script = f"mount --bind {ckpt} {ckpt} && mount -o remount,bind,ro {ckpt} && exec {resume}"
    r = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if r.returncode and "mount" in r.stderr and "error:" not in r.stderr:
        pytest.skip(f"a private read-only mount is not permitted here: {r.stderr.strip()[:200]}")
    err = one_line_error(r, 1)
    assert (
        "Read-only file system" in err
        and f"Checkpoint 4 is intact: make {ckpt} writable and resume" in err
    ), err
    assert checkpoint.all_steps(out)[-1] == 4


def test_a_failed_save_names_as_intact_only_a_checkpoint_still_there(tmp_path):
    """out_dir's target deleted under a run: the line of the failed save claims no checkpoint that
    is gone."""
    mngr = checkpoint.manager(tmp_path)
    for step in (2, 4):
        checkpoint.save(
            mngr, step, {"w": jax.numpy.ones(3)}, {"m": jax.numpy.zeros(3)}, {"iter_num": step}
        )
        checkpoint.wait_saved(mngr)

    def failed_save():
        with pytest.raises(RunStopped) as e, checkpoint._save_errors(mngr):
            raise OSError(errno.EACCES, "Permission denied", str(tmp_path))
        return str(e.value)

    assert failed_save().endswith(
        f"Checkpoint 4 is intact: make {tmp_path / 'ckpt'} writable and resume from it"
    )
    shutil.rmtree(tmp_path / "ckpt" / "4")
    assert "Checkpoint 2 is intact" in failed_save()
    shutil.rmtree(tmp_path / "ckpt")
    assert failed_save().endswith("the run stopped. No checkpoint is left there")
    mngr.close()


def test_a_failed_save_names_the_checkpoints_that_completed_while_the_next_ones_were_saved(
    tmp_path,
):
    """Saves back to back, as on a slow store where one is always in flight when the run checks:
    each save waits for the one before, which is then whole. A failure names the last of those, not
    'no checkpoint', nor the last save, which the run has not seen complete (its folder there or
    not)."""
    mngr = checkpoint.manager(tmp_path)
    for step in (2, 4, 6):
        checkpoint.save(
            mngr, step, {"w": jax.numpy.ones(3)}, {"m": jax.numpy.zeros(3)}, {"iter_num": step}
        )
    deadline = time.time() + 60
    while not (tmp_path / "ckpt" / "6").is_dir() and time.time() < deadline:
        time.sleep(0.01)
    with pytest.raises(RunStopped) as e, checkpoint._save_errors(mngr):
        raise OSError(errno.EACCES, "Permission denied", str(tmp_path))
    # 6: still in flight, not seen to complete
    assert "Checkpoint 4 is intact" in str(e.value), e.value
    mngr.close()


def test_a_save_that_fails_as_it_starts_is_one_line(tmp_path, monkeypatch):
    mngr = checkpoint.manager(tmp_path)
    checkpoint.save(mngr, 2, {"w": jax.numpy.ones(3)}, {"m": jax.numpy.zeros(3)}, {"iter_num": 2})

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(mngr, "save", disk_full)
    with pytest.raises(
        RunStopped,
        match=r"failed \(\[Errno 28\] No space left on device\); the run stopped. "
        "Checkpoint 2 is intact: free space and resume from it$",
    ):
        checkpoint.save(
            mngr, 4, {"w": jax.numpy.ones(3)}, {"m": jax.numpy.zeros(3)}, {"iter_num": 4}
        )
    mngr.close()


def test_orbax_warnings_of_normal_saves_stay_off_stderr(tmp_path, monkeypatch, caplog):
    """A save without a val loss, and one that waited for the one before (a slow store; orbax warns
    past 1 s, here past -1 s): no warning on stderr, where a failed run's one line is all there
    is."""
    from orbax.checkpoint import checkpoint_manager

    monkeypatch.setattr(checkpoint_manager, "_WAIT_FOR_PREV_SAVE_WARNING_THRESHOLD_SECS", -1.0)
    mngr = checkpoint.manager(tmp_path)
    with caplog.at_level(logging.WARNING):
        for step in (2, 4):
            checkpoint.save(
                mngr, step, {"w": jax.numpy.ones(3)}, {"m": jax.numpy.zeros(3)}, {"iter_num": step}
            )
        checkpoint.wait_saved(mngr)
        logging.getLogger("absl").warning("Disk quota exceeded")  # any other warning is still shown
    mngr.close()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        "Disk quota exceeded"
    ]


def test_only_the_closed_loop_errors_of_a_failed_save_are_quieted(tmp_path, monkeypatch):
    """Orbax's writes that complete after a failed save closed its event loop raise
    RuntimeError('Event loop is closed') as unraisable errors: dropped. Any other goes to the hook
    as before, which is wrapped once however many managers a process opens."""
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    checkpoint.manager(tmp_path / "a").close()
    hook = sys.unraisablehook
    checkpoint.manager(tmp_path / "b").close()
    assert sys.unraisablehook is hook
    closed, other, same_words = (
        types.SimpleNamespace(exc_value=e)
        for e in (
            RuntimeError("Event loop is closed"),
            RuntimeError("boom"),
            ValueError("Event loop is closed"),
        )
    )
    for unraisable in (closed, other, same_words):
        hook(unraisable)
    assert seen == [other, same_words]


def test_a_failed_background_save_stops_the_run_at_the_first_check_once_it_is_done(
    tmp_path, monkeypatch
):
    """check_saved, called each step, waits for nothing while the save is in flight; once it is
    done, its failure is the one line, before the next step."""
    mngr = checkpoint.manager(tmp_path)

    def failed():
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(mngr, "wait_until_finished", failed)
    monkeypatch.setattr(mngr, "is_saving_in_progress", lambda: True)
    checkpoint.check_saved(mngr)
    monkeypatch.setattr(mngr, "is_saving_in_progress", lambda: False)
    with pytest.raises(
        RunStopped,
        match=r"failed \(\[Errno 28\] No space left on device\); the run stopped. No "
        "checkpoint is left there$",
    ):
        checkpoint.check_saved(mngr)
    monkeypatch.undo()
    mngr.close()


def test_an_errors_line_is_its_first_200_characters_without_orbaxs_pointer_to_the_details():
    assert checkpoint._first_line(ValueError("a" * 300 + "\nmore")) == "a" * 200
    read = Exception(
        "Encountered error while reading array index: (0,). See full TensorStore details: "
        "{'driver': 1}."
    )
    assert checkpoint._first_line(read) == "Encountered error while reading array index: (0,)."
    assert checkpoint._first_line(OSError()) == "OSError"  # no words: its type


def test_a_failed_saves_fix_is_named_by_the_first_cause_that_says(gcs):
    """The cause named is the first in the chain that says what to do; where none does, the error
    raised (a URL's bucket, listed on the emulator, answering)."""

    def raised(cause):  # orbax's error, raised from the storage's
        try:
            raise RuntimeError("save failed") from cause
        except RuntimeError as e:
            return e

    for cause, where, fix in [
        (OSError(errno.ENOSPC, "No space left"), "out/ckpt", "free space"),
        (OSError(errno.EROFS, "Read-only file system"), "out/ckpt", "make out/ckpt writable"),
        (PermissionError("403 Forbidden"), "gs://b/run/ckpt", "fix the bucket's access"),
        (ConnectionError("reset by peer"), "gs://b/run/ckpt", "check the network"),
        (ConnectionError("reset by peer"), "out/ckpt", None),
        (ValueError("not a storage failure"), "gs://b/run/ckpt", None),
    ]:
        error = raised(cause)
        expected = (cause, fix) if fix else (error, "fix the cause above")
        assert storage.write_failure(where, error) == expected, (cause, where)
