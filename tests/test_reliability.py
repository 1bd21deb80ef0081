"""python -m pytest tests/test_reliability.py -q

What can go wrong in a run, and what train.py guarantees then: bad settings fail before anything is
written, a diverged run never saves, a full disk stops the run in one line, one out_dir holds one
run at a time, the last step is evaluated and saved, and the log survives a crash (a preempted
multi-process run, which stops in step: test_sharding.py)."""

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from helpers import REPO, TINY, one_line_error, read_log, run, settings, snapshot, train_cli

import plot
import train
from configurator import ConfigError, RunStopped, UsageError, exit_on_bad_input
from run import checkpoint, run_lock, runlog

BAD_SETTINGS = {
    "--batch_size=0": "batch_size must be >= 1",
    "--batch_size=-4": "batch_size must be >= 1",
    "--block_size=0": "block_size must be >= 1",
    "--n_head=0": "n_head must be >= 1",
    "--n_layer=0": "n_layer must be >= 1",
    "--n_head=3": "n_embd=32 must be divisible by n_head=3",
    "--eval_interval=0": "eval_interval must be >= 1",
    "--log_interval=0": "log_interval must be >= 1",
    "--eval_iters=0": "eval_iters must be >= 1",
    "--gradient_accumulation_steps=0": "gradient_accumulation_steps must",
    "--keep_checkpoints=0": "keep_checkpoints must be >= 1",
    "--checkpoint_interval=-1": r"must be >= 0 \(0: off\)",
    "--dropout=1.5": r"dropout must be in \[0, 1\)",
    "--learning_rate=-1.0": "learning_rate must be >= 0",
    "--beta2=1.0": r"beta2 must be in \[0, 1\)",
    "--dtype=float16": "dtype must be",
    "--profile=5:2": "profile must be START:STOP",
    "--profile=a:b": "profile must be START:STOP",
    "--attention=bogus": "attention must be one of",
    "--remat=bogus": "remat must be 'auto' or one of",
    "--gelu=bogus": "gelu must be 'tanh'",
    "--loss_chunk=-1": "loss_chunk must be 'auto' or an integer >= 0",
    "--scan_layers=maybe": "scan_layers must be True, False or 'auto'",
    "--attention=cudnn": "attention='cudnn' cannot run here: it runs on NVIDIA GPUs only",
    "--attention=splash --dropout=0.1": "attention='splash' cannot run here: the kernel has no "
    "attention dropout",
    "--attention=splash": "attention='splash' cannot run here: block_size must be a multiple of "
    "128, got 16",
    "--attention=splash --block_size=128 --n_embd=1024 --n_head=2": "the head size .* must be <= "
    "256, got 512",
}


def test_every_bad_setting_is_one_error_before_anything_is_written(dataset, tmp_path):
    out = tmp_path / "out"
    for args, message in BAD_SETTINGS.items():
        with pytest.raises(UsageError, match=message):
            train.Trainer(settings(dataset, out, *args.split()))
    assert not out.exists()
    bad_config = tmp_path / "bad_config.py"
    bad_config.write_text("batch_size = 4\nn_layer = = 2\n")
    with pytest.raises(ConfigError, match=r"bad_config.py:2: invalid syntax"):
        settings(dataset, out, str(bad_config))
    with pytest.raises(UsageError, match=r"--dataset=.*train.bin is a file"):
        train.Trainer(settings(dataset, out, f"--dataset={os.path.join(dataset, 'train.bin')}"))
    empty = tmp_path / "empty"
    shutil.copytree(dataset, empty)
    open(empty / "train.bin", "w").close()
    with pytest.raises(UsageError, match=r"empty.train.bin is empty: rerun"):
        train.Trainer(settings(str(empty), out, "--max_iters=1"))
    assert not os.path.exists(out)
    # the script: the same check is one line on stderr, exit 2
    one_line_error(
        train_cli([*TINY, f"--dataset={dataset}", f"--out_dir={out}", "--eval_interval=0"]), 2
    )
    assert not os.path.exists(out)


def test_token_ids_beyond_the_vocabulary_are_one_error_naming_the_data(dataset, tmp_path):
    # the tests' data moved up by 32: ids 32..95, where meta.pkl says 64 (the tests' tiny model,
    # whose step the compilation cache holds)
    data = tmp_path / "data"
    shutil.copytree(dataset, data)
    for split in ("train", "val"):
        (np.fromfile(data / f"{split}.bin", np.uint16) + 32).tofile(data / f"{split}.bin")
    out = tmp_path / "out"
    with pytest.raises(
        UsageError,
        match=r"train.bin holds token id 95, outside the model's vocabulary "
        r"\(vocab_size 64\)|val.bin holds token id 95, .*\(vocab_size 64\)",
    ):
        run(str(data), out, "--max_iters=2")
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):
        checkpoint.all_steps(out)[-1]


@pytest.mark.slow
def test_an_unexpected_error_in_the_loop_keeps_its_traceback(dataset, tmp_path):
    script = f"""if True:
        import train
        from configurator import exit_on_bad_input
        def estimate_loss(self):
            raise ValueError("an error of ours, not of the input")
        train.Trainer.estimate_loss = estimate_loss
        exit_on_bad_input(lambda: train.main({[*TINY, f"--dataset={dataset}", f"--out_dir={tmp_path}"]!r}))
    """  # noqa: E501
    r = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 1 and "Traceback" in r.stderr and "in estimate_loss" in r.stderr, (
        r.stderr[-3000:]
    )
    # and the helper's two one-line kinds
    for error, code in ((UsageError("bad input"), 2), (RunStopped("stopped"), 1)):

        def main():
            raise error

        with pytest.raises(SystemExit) as e:
            exit_on_bad_input(main)
        assert e.value.code == code


@pytest.mark.slow
def test_a_diverged_run_never_saves_and_keeps_the_good_checkpoints(dataset, tmp_path):
    out = tmp_path / "out"
    run(dataset, out, "--max_iters=6", "--eval_interval=2", "--always_save_checkpoint=True")
    assert checkpoint.all_steps(out) == [2, 4, 6]
    before = snapshot(os.path.join(out, "ckpt"))  # every file of every checkpoint
    # resumed with a learning rate that blows up; no log line reads the loss before the next save
    # (at 8)
    r = train_cli(
        [
            *TINY,
            f"--dataset={dataset}",
            f"--out_dir={out}",
            "--init_from=resume",
            "--max_iters=20",
            "--eval_interval=2",
            "--log_interval=1000",
            "--learning_rate=1e6",
            "--grad_clip=0.0",
        ]
    )
    err = one_line_error(r, 1)
    assert "is not finite" in err and f"{os.path.join(out, 'ckpt')}/6, is from before" in err, err
    assert snapshot(os.path.join(out, "ckpt")) == before
    template = train.Trainer(settings(dataset, tmp_path / "t")).params
    newest = checkpoint.restore(out, params=template)["params"]
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(newest))

    # a checkpoint whose meta lacks model_args: one line (train and sample), naming the step to fall
    # back on
    meta_file = os.path.join(out, "ckpt", "6", "meta", "metadata")
    with open(meta_file) as f:
        meta = json.load(f)
    del meta["model_args"]
    with open(meta_file, "w") as f:
        json.dump(meta, f)
    message = (
        r"ckpt/6 did not restore \(its meta lacks model_args\); move it away to resume from step 4"
    )
    with pytest.raises(checkpoint.CheckpointError, match=message):
        train.Trainer(settings(dataset, out, "--init_from=resume"))
    with pytest.raises(checkpoint.CheckpointError, match=message):
        checkpoint.load_model("resume", out)


@pytest.mark.slow
def test_a_full_disk_stops_the_run_in_one_line_and_the_previous_checkpoint_loads(
    dataset, tmp_path, monkeypatch
):
    from orbax.checkpoint._src.handlers.json_checkpoint_handler import JsonCheckpointHandler

    write = JsonCheckpointHandler._save_fn
    saves = []

    async def disk_full_after_the_first_save(self, item, directory):
        saves.append(directory)
        if len(saves) > 1:
            raise OSError(errno.ENOSPC, "No space left on device", str(directory))
        return await write(self, item, directory)

    monkeypatch.setattr(JsonCheckpointHandler, "_save_fn", disk_full_after_the_first_save)
    t = train.Trainer(settings(dataset, tmp_path, "--max_iters=12", "--checkpoint_interval=2"))
    with pytest.raises(RunStopped) as e:
        t.run()
    message = str(e.value)
    assert (
        "\n" not in message
        and "No space left on device" in message
        and "Checkpoint 2 is intact" in message
    )
    # the failed save at 4: reported after the next step, or at the latest at the next save
    assert t.iter_num in (5, 6)
    assert checkpoint.all_steps(tmp_path)[-1] == 2
    restored = checkpoint.restore(tmp_path, params=t.params)
    assert restored["meta"]["iter_num"] == 2


@pytest.mark.slow
def test_last_step_is_evaluated_and_saved_and_a_crashed_log_resumes_clean(dataset, tmp_path):
    run(dataset, tmp_path, "--max_iters=7", "--eval_interval=5", "--always_save_checkpoint=False")
    assert [i for i, _ in read_log(tmp_path, "val_loss")] == [0, 5, 7]
    assert checkpoint.all_steps(tmp_path) == [5, 7]
    # what a kill -9 after iteration 8 leaves: log lines past the checkpoint (7), the last one cut
    # mid-write
    with open(tmp_path / "log.jsonl", "a") as f:
        f.write('{"iter": 7, "loss": 99.0}\n{"iter": 8, "loss": 99.0}\n{"iter": 9, "lo')
    resumed = run(
        dataset,
        tmp_path,
        "--init_from=resume",
        "--max_iters=10",
        "--eval_interval=5",
        "--n_layer=4",
    )
    series, _ = plot.read_log(os.path.join(tmp_path, "log.jsonl"))
    assert sorted(series["loss"]) == list(range(10)) and 99.0 not in series["loss"].values()
    # where the run started, where it resumed
    assert [i for i, _ in read_log(tmp_path, "event")] == [0, 7]
    # resume kept the checkpoint's 2 layers and saved a config that says so
    assert resumed.model_config.n_layer == 2
    meta = checkpoint.restore(tmp_path)["meta"]
    assert (
        meta["iter_num"] == 10 and meta["config"]["n_layer"] == meta["model_args"]["n_layer"] == 2
    )


def test_more_bad_settings_are_one_line_before_out_dir_is_made(dataset, tmp_path):
    (tmp_path / "a_file").write_text("")
    cases = {
        "--seed=-1": r"seed must be in \[0, 2\*\*32\), got -1",
        "--wandb_log=True": "wandb_log=True needs wandb: pip install wandb",
        "--init_from=resume --start_over=True": "start_over=True moves the checkpoints that "
        "init_from='resume'",
        f"--out_dir={tmp_path / 'a_file'}": "a_file is a file: give a directory",
        f"--out_dir={tmp_path / 'a_file' / 'out'}": "cannot be created: .*a_file is a file",
    }
    for args, message in cases.items():
        with pytest.raises(UsageError, match=message):
            train.Trainer(settings(dataset, tmp_path / "out", *args.split()))
    assert sorted(os.listdir(tmp_path)) == ["a_file"]
    # a path the OS refuses however it looks (a UsageError: one line, exit 2)
    with pytest.raises(UsageError, match="/proc/nanogpt-jax-out"):
        train.Trainer(settings(dataset, "/proc/nanogpt-jax-out"))


def test_a_new_run_into_an_old_out_dir_is_refused_before_anything_is_written(
    dataset, tmp_path, monkeypatch
):
    out = tmp_path / "out"
    run(dataset, out, "--max_iters=4", "--checkpoint_interval=2")
    before = snapshot(out)
    built = []
    monkeypatch.setattr(train, "init_state", lambda *a, **k: built.append(a))
    with pytest.raises(
        UsageError,
        match=r"out holds the checkpoints of another run \(steps 2, 4\): continue it with "
        r"--init_from=resume, give this run a new --out_dir, or --start_over=True",
    ):
        train.Trainer(settings(dataset, out, "--max_iters=8"))
    assert snapshot(out) == before and not built
    monkeypatch.undo()
    # an eval of the checkpoint's run is no new run; start_over moves the old run aside, whole
    train.Trainer(settings(dataset, out, "--eval_only=True", "--init_from=resume")).run()
    t = train.Trainer(
        settings(dataset, out, "--max_iters=2", "--start_over=True", "--seed=7")
    ).run()
    aside = [p for p in os.listdir(out) if p.startswith("previous-")]
    assert len(aside) == 1 and checkpoint.all_steps(out / aside[0]) == [2, 4]
    assert (
        checkpoint.all_steps(out) == [2] and checkpoint.restore(out)["meta"]["config"]["seed"] == 7
    )
    assert [i for i, _ in read_log(out, "event")] == [0] and t.iter_num == 2


def test_a_locked_out_dir_is_refused_before_the_model_is_built(dataset, tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    # another run's lock (flock: per open file, so one process shows it)
    held = run_lock.lock_out_dir(str(out))
    monkeypatch.setattr(train, "init_state", lambda *a, **k: pytest.fail("the model was built"))
    with pytest.raises(
        UsageError,
        match=r"out is in use by another run \(pid \d+ on .+, since \d{4}-\d\d-\d\d \d\d:\d\d:"
        r"\d\d\): wait for it to end, or give this one another --out_dir$",
    ):
        train.Trainer(settings(dataset, out))
    held.close()


@pytest.mark.slow
def test_resume_lists_every_ignored_setting_and_saves_a_config_that_agrees(
    dataset, tmp_path, capsys
):
    run(dataset, tmp_path, "--max_iters=2", "--gelu=tanh")
    run(dataset, tmp_path, "--init_from=resume", "--max_iters=4", "--gelu=exact", "--n_embd=64")
    assert "ignored --n_embd=64, --gelu=exact" in capsys.readouterr().out
    meta = checkpoint.restore(tmp_path)["meta"]
    assert meta["iter_num"] == 4 and meta["config"]["gelu"] == meta["model_args"]["gelu"] == "tanh"
    assert meta["config"]["n_embd"] == meta["model_args"]["n_embd"] == 32


@pytest.mark.slow
def test_a_full_disk_at_start_or_at_a_log_line_is_one_line_naming_the_path(
    dataset, tmp_path, monkeypatch
):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "out" / "run.lock"))

    monkeypatch.setattr(run_lock, "lock_out_dir", full)
    with pytest.raises(
        RunStopped,
        match=r"cannot write .*out/run.lock \(No space left on device\): the run stopped, "
        r"nothing was saved; free space and run again$",
    ):
        train.Trainer(settings(dataset, tmp_path / "out"))
    monkeypatch.undo()

    append, lines = runlog.append_line, []

    def full_after_the_first_save(path, line):
        lines.append(line)
        if len(lines) > 4:
            raise OSError(errno.ENOSPC, "No space left on device")
        append(path, line)

    monkeypatch.setattr(runlog, "append_line", full_after_the_first_save)
    t = train.Trainer(
        settings(dataset, tmp_path / "log", "--max_iters=20", "--checkpoint_interval=2")
    )
    with pytest.raises(
        RunStopped,
        match=r"cannot write .*log/log.jsonl \(No space left on device\): the run stopped, "
        r"checkpoint 2 in .*log/ckpt is intact; free space and resume with "
        r"--init_from=resume$",
    ):
        t.run()
    assert checkpoint.all_steps(tmp_path / "log")[-1] == 2


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_stop_during_the_first_compilation_is_one_line_and_exit_128_plus_the_signal(
    signum, dataset, tmp_path
):
    """The signal arrives while XLA compiles (no cache: the compilation takes seconds): no
    traceback, no crash, no C++ stack dump (SIGTERM's, before issue 33)."""
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": "", "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen(
        [
            sys.executable,
            "train.py",
            *TINY,
            f"--dataset={dataset}",
            f"--out_dir={tmp_path}",
            "--n_layer=6",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in p.stdout:  # printed as the model is about to be built and compiled
        if line.startswith("found vocab_size"):
            break
    time.sleep(1.0)
    p.send_signal(signum)
    stdout, stderr = p.communicate(timeout=60)
    assert p.returncode == 128 + signum, stderr[-3000:]
    assert stderr == "error: interrupted before the first step: nothing saved\n", stderr[-3000:]
    assert "iter 0:" not in stdout and not os.path.exists(tmp_path / "ckpt")


def test_a_dangling_link_as_out_dir_is_one_line_naming_its_target(tmp_path):
    """It said "File exists" (issue 33)."""
    os.symlink(tmp_path / "gone", tmp_path / "out")
    with pytest.raises(
        UsageError,
        match=r"^out_dir .*/out is a link to .*/gone, which does not exist: create it, or "
        r"give another --out_dir$",
    ):
        runlog.check_out_dir(str(tmp_path / "out"))
