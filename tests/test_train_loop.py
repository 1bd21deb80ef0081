"""python -m pytest tests/test_train_loop.py -q

train.py's loop, run tiny: the loss goes down and the log is written, the device is read only at log
steps, the logged learning rate, the profile, exact resume, accumulation equivalence, eval only,
preemption, bad input, config/train_gpt2.py on shards, HellaSwag in the loop (its pieces:
test_train.py; meshes and processes: test_sharding.py)."""

import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import (
    HELLASWAG_FIXTURE,
    REPO,
    TINY,
    assert_close,
    read_log,
    run,
    settings,
    snapshot,
    train_cli,
)

import hellaswag
import train
from configurator import UsageError, configure, exit_on_bad_input
from dataio import hellaswag_data
from run import train_step
from run.settings import DEFAULTS


def params_of(trainer):
    return [np.asarray(x) for x in jax.tree.leaves(trainer.params)]


def test_loss_goes_down_and_log_is_written(dataset, tmp_path):
    t = run(dataset, tmp_path, "--max_iters=30", "--eval_interval=15")
    losses = [loss for _, loss in read_log(tmp_path, "loss")]
    assert len(losses) == 30 and losses[-1] < losses[0] - 0.5
    evals = read_log(tmp_path, "val_loss")
    assert [i for i, _ in evals] == [0, 15, 30]
    assert t.best_val_loss == min(v for _, v in evals)
    # the memory line's state: every byte of the params and the optimizer state (one device holds
    # them whole)
    state = sum(x.nbytes for x in jax.tree.leaves((t.params, t.opt_state)))
    assert [v for _, v in read_log(tmp_path, "state_bytes_per_device")] == [state]


@pytest.mark.slow
def test_loop_reads_the_device_only_at_log_steps(dataset, tmp_path, monkeypatch):
    """The device never waits for the host: between log lines (and evals, saves) the loop reads no
    device value. The loop runs under JAX's device-to-host transfer guard, which fires on GPU/TPU;
    XLA:CPU's reads are zero-copy and pass it (jax#16602), so here every read of a jax.Array's value
    fails the same way."""
    from jax._src.array import ArrayImpl

    guarded = {"on": False}
    read_value = ArrayImpl._value.fget

    def value(self):
        assert not guarded["on"], (
            "the training loop read a device value outside a log step, eval or save"
        )
        return read_value(self)

    def with_guard(method, on):
        def wrapped(*args, **kwargs):
            before, guarded["on"] = guarded["on"], on
            try:
                with jax.transfer_guard_device_to_host("disallow_explicit" if on else "allow"):
                    return method(*args, **kwargs)
            finally:
                guarded["on"] = before

        return wrapped

    monkeypatch.setattr(ArrayImpl, "_value", property(value))
    # run: the start-up lines, then the loop
    monkeypatch.setattr(train.Trainer, "run", with_guard(train.Trainer.run, True))
    for allowed in ("_log_unlogged", "evaluate", "save"):
        monkeypatch.setattr(
            train.Trainer, allowed, with_guard(getattr(train.Trainer, allowed), False)
        )
    run(
        dataset,
        tmp_path,
        "--max_iters=8",
        "--log_interval=3",
        "--eval_interval=4",
        "--checkpoint_interval=5",
    )
    # each logged after the next step's dispatch
    assert [i for i, _ in read_log(tmp_path, "loss")] == [2, 5, 7]


@pytest.mark.slow
def test_logged_learning_rate_is_the_steps(dataset, tmp_path):
    """The step returns its learning rate (the loop computes none on the host): get_lr of its
    iteration."""
    run(dataset, tmp_path, "--max_iters=5")
    c = configure(DEFAULTS, TINY)
    assert [(i, pytest.approx(lr, rel=1e-6)) for i, lr in read_log(tmp_path, "lr")[1:-1]] == [
        (i, float(train_step.get_lr(i, c))) for i in range(5)
    ]


@pytest.mark.slow
def test_profile_writes_a_trace_of_the_steps_asked_for(dataset, tmp_path, capsys):
    run(dataset, tmp_path, "--max_iters=5", "--profile=2:4")
    assert "profile of iterations 2..3 written to" in capsys.readouterr().out
    [trace] = os.listdir(tmp_path / "profile" / "plugins" / "profile")
    files = os.listdir(tmp_path / "profile" / "plugins" / "profile" / trace)
    assert "perfetto_trace.json.gz" in files and any(f.endswith(".xplane.pb") for f in files)


# the trapezoid's warmdown ends at max_iters, which the test's first run shortens: a warmup only,
# which a step count restored wrong would run again
SPEEDRUN_RECIPE = [
    "--arch=speedrun",
    "--bias=False",
    "--optimizer=muon",
    "--muon_learning_rate=0.02",
    "--lr_schedule=trapezoid",
    "--warmup_iters=2",
    "--warmdown_iters=0",
    "--grad_clip=0.0",
]


# record 20's: its cooldown starts after the runs' steps, its windows cover their one block
SPEEDRUN20_RECIPE = [
    "--arch=speedrun20",
    "--bias=False",
    "--optimizer=muon20",
    "--muon_learning_rate=0.02",
    "--lr_schedule=cooldown",
    "--cooldown_frac=0.01",
    "--muon_momentum_warmup=4",
    "--beta1=0.8",
    "--weight_decay=0.0",
    "--grad_clip=0.0",
    "--dropout=0.0",
    "--block_size=128",
    "--embed_dtype=bfloat16",  # the record's tables and their Adam state
]


# the records' in make test-slow (CI runs them): the same claim as GPT-2's with other optimizer
# states; record 20's loader resumes bit for bit in make test (tests/test_speedrun20_data.py)
@pytest.mark.parametrize(
    "recipe",
    [
        [],
        pytest.param(SPEEDRUN_RECIPE, marks=pytest.mark.slow),
        pytest.param(SPEEDRUN20_RECIPE, marks=pytest.mark.slow),
    ],
    ids=["gpt2", "speedrun", "speedrun20"],
)
def test_exact_resume_bit_for_bit(recipe, dataset, tmp_path):
    """The prefetching loader has read two batches past the stop; the checkpoint holds the position
    after the last batch a step took, so the resumed run sees the same batches as the uninterrupted
    one. The speedrun recipes' too: Muon's momentum (record 20's warmup count) and the schedule's
    step count come back with the checkpoint."""
    extra = ["--dropout=0.1", "--eval_interval=3", "--always_save_checkpoint=True", *recipe]
    straight = run(dataset, tmp_path / "a", "--max_iters=6", *extra)
    run(dataset, tmp_path / "b", "--max_iters=3", *extra)
    resumed = run(dataset, tmp_path / "b", "--max_iters=6", "--init_from=resume", *extra)
    # appended across the resume
    assert read_log(tmp_path / "a", "loss") == read_log(tmp_path / "b", "loss")
    for a, b in zip(params_of(straight), params_of(resumed)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_best_val_loss_is_never_overwritten_by_a_worse_value(dataset, tmp_path, monkeypatch):
    vals = iter([3.0, 2.0, 2.5, 2.7])
    monkeypatch.setattr(
        train.Trainer, "estimate_loss", lambda self: {"train": 1.0, "val": next(vals)}
    )
    t = run(
        dataset, tmp_path, "--max_iters=3", "--eval_interval=1", "--always_save_checkpoint=True"
    )
    assert t.best_val_loss == 2.0
    from run import checkpoint

    assert checkpoint.restore(tmp_path)["meta"]["best_val_loss"] == 2.0
    vals = iter([2.9, 2.9])  # a resume's evals, worse than the checkpoint's best: not forgotten
    t = run(dataset, tmp_path, "--max_iters=4", "--eval_interval=1", "--init_from=resume")
    assert t.best_val_loss == 2.0


# make test-slow (CI runs it): make test holds accumulation equal to one batch on a mesh
# (test_sharding.py: fsdp 4 x tensor 2's 4 micro-batches of 2 against 1 device's one batch of 8)
@pytest.mark.slow
def test_gradient_accumulation_equivalence(dataset, tmp_path):
    """accum 4 x micro-batch 2 == accum 1 x micro-batch 8: the same tokens, the same update."""
    a = run(
        dataset,
        tmp_path / "a",
        "--gradient_accumulation_steps=4",
        "--batch_size=2",
        "--max_iters=3",
    )
    b = run(
        dataset,
        tmp_path / "b",
        "--gradient_accumulation_steps=1",
        "--batch_size=8",
        "--max_iters=3",
    )
    for pa, pb in zip(params_of(a), params_of(b)):
        assert_close(pa, pb, atol=1e-5, what="params")
    assert_close(
        [loss for _, loss in read_log(tmp_path / "a", "loss")],
        [loss for _, loss in read_log(tmp_path / "b", "loss")],
        atol=1e-5,
        what="losses",
    )


@pytest.mark.slow
def test_eval_only_does_not_train(dataset, tmp_path):
    t = run(dataset, tmp_path, "--eval_only=True")
    assert (
        t.iter_num == 0
        and read_log(tmp_path, "loss") == []
        and len(read_log(tmp_path, "val_loss")) == 1
    )


@pytest.mark.slow
def test_eval_only_evaluates_a_run_resumed_at_any_step(dataset, tmp_path):
    """A checkpoint at step 3, eval_interval 1000: eval_only evaluates it all the same (it exited 0
    without a word), and writes no checkpoint over the one it reads."""
    run(dataset, tmp_path, "--max_iters=3")
    before = snapshot(tmp_path / "ckpt")
    t = run(dataset, tmp_path, "--eval_only=True", "--init_from=resume")
    assert t.iter_num == 3 and [i for i, _ in read_log(tmp_path, "val_loss")] == [0, 3, 3]
    assert snapshot(tmp_path / "ckpt") == before


# --- several devices and processes (subprocesses with fake CPU devices)
# ----------------------------

# --- preemption and bad input
# ----------------------------------------------------------------------


# make test-slow (CI runs it): train.py as a command, SIGTERM'd. make test holds its pieces: a
# SIGTERM'd loop saves (test_stop.py), a resume continues bit for bit
# (test_exact_resume_bit_for_bit), a killed command stops in one line (test_multiprocess.py)
@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_resume_continues(dataset, tmp_path):
    out = tmp_path / "out"
    args = TINY + [f"--dataset={dataset}", f"--out_dir={out}", "--max_iters=100000"]
    p = subprocess.Popen(
        [sys.executable, "train.py", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        stderr=subprocess.PIPE,
    )
    deadline = time.time() + 120
    for line in p.stdout:
        if line.startswith("iter 5:") or time.time() > deadline:
            break
    p.send_signal(signal.SIGTERM)
    out_text, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-2000:]
    saved = [x for x in out_text.splitlines() if x.startswith("SIGTERM: checkpoint saved at iter")]
    assert saved, out_text
    stopped_at = int(saved[0].split("iter ")[1].split(";")[0])
    t = train.Trainer(settings(dataset, out, "--init_from=resume", f"--max_iters={stopped_at + 2}"))
    assert t.iter_num == stopped_at
    t.run()
    assert t.iter_num == stopped_at + 2
    iters = [i for i, _ in read_log(out, "loss")]
    assert iters == list(range(stopped_at + 2))  # nothing lost, nothing repeated


def test_bad_input_is_one_line_and_writes_nothing(dataset, tmp_path, capsys):
    def cli(*args):
        r = train_cli(list(args))
        return r.returncode, r.stderr.strip()

    # what `python train.py` does with settings configure refuses, before anything else
    def cli_in_process(*args):
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            exit_on_bad_input(lambda: train.main(list(args)))
        return e.value.code, capsys.readouterr().err.strip()

    code, err = cli_in_process("--batch_szie=3")
    assert (
        code == 2 and err.startswith("error: unknown config key 'batch_szie'") and "\n" not in err
    )
    code, err = cli_in_process("--batch_size=3.5")
    assert code == 2 and "batch_size must be int" in err
    code, err = cli_in_process("--dataset=nowhere", f"--out_dir={tmp_path / 'x'}")
    assert (
        code == 2
        and err.startswith("error: no dataset 'nowhere': no such folder (")
        and "\n" not in err
    )
    code, err = cli_in_process(
        *TINY, f"--dataset={dataset}", f"--out_dir={tmp_path / 'none'}", "--init_from=resume"
    )
    assert code == 2 and err.startswith("error: no checkpoint in") and "\n" not in err
    assert not os.path.exists(tmp_path / "x") and not os.path.exists(tmp_path / "none")
    with pytest.raises(
        UsageError,
        match=r"meta\.pkl has 64 characters, more than the model's vocab_size 10: set "
        r"--vocab_size=64 or more \(or 0: the data's\)$",
    ):
        # refused before out_dir, its log or ckpt/ exist
        run(dataset, tmp_path / "small", "--vocab_size=10")
    assert not os.path.exists(tmp_path / "small")

    # a corrupt checkpoint: clear error, and nothing in out_dir is touched
    out = tmp_path / "out"
    run(dataset, out, "--max_iters=2", "--eval_interval=2")
    params_dir = os.path.join(out, "ckpt", "2", "params")
    victim = max(
        (os.path.join(r, f) for r, _, fs in os.walk(params_dir) for f in fs), key=os.path.getsize
    )
    with open(victim, "r+b") as f:
        f.truncate(8)
    before = snapshot(out)
    code, err = cli(
        *TINY, f"--dataset={dataset}", f"--out_dir={out}", "--init_from=resume", "--max_iters=4"
    )
    assert (
        code == 2
        and "did not restore" in err
        and err.endswith("; no earlier checkpoint to fall back on")
    ), err
    assert "\n" not in err
    # taken (rewritten) before the checkpoint is read; nothing else written
    lock = os.path.join(out, "run.lock")
    assert {k: v for k, v in snapshot(out).items() if k != lock} == {
        k: v for k, v in before.items() if k != lock
    }


# make test-slow (CI runs it): on 2 devices, a larger repeat of what make test holds one piece at
# a time (the shards' loader, auto settings, the chunked loss, meshes in tests/test_sharding.py)
@pytest.mark.slow
def test_train_gpt2_config_runs_tiny_on_fixture_shards(tmp_path):
    """The real config/train_gpt2.py, tiny model overrides, on .npy shards: tokens per step stay
    fixed; its 'auto' remat and a chunked loss (shortened to fit block_size 32) run on 2 devices."""
    d = tmp_path / "edu_fineweb10B"
    d.mkdir()
    rng = np.random.default_rng(0)
    for name in [
        "edufineweb_val_000000.npy",
        "edufineweb_train_000001.npy",
        "edufineweb_train_000002.npy",
    ]:
        np.save(d / name, rng.integers(0, 50257, 3000).astype(np.uint16))
    r = train_cli(
        [
            "config/train_gpt2.py",
            f"--dataset={d}",
            f"--out_dir={tmp_path / 'out'}",
            "--n_layer=2",
            "--n_head=2",
            "--n_embd=32",
            "--block_size=32",
            "--batch_size=2",
            "--total_batch_size=256",
            "--max_iters=3",
            "--eval_interval=2",
            "--eval_iters=2",
            "--hellaswag_interval=0",
            "--dtype=float32",
            "--warmup_iters=1",
            "--loss_chunk=12",
        ],
        devices=2,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert (
        "accumulation 2 x micro-batch 4" in r.stdout
        and "tokens per iteration will be: 256" in r.stdout
    )
    assert [i for i, _ in read_log(tmp_path / "out", "loss")] == [0, 1, 2]
    with pytest.raises(UsageError, match="python fineweb.py"):
        train.main(["config/train_gpt2.py", f"--dataset={tmp_path / 'edu_fineweb10B_missing'}"])


# make test-slow (CI runs it): make test holds the scorer (tests/test_hellaswag.py) and the loop
@pytest.mark.slow
def test_hellaswag_in_the_training_loop(dataset, tmp_path, capsys):
    extra = ["--vocab_size=50304", "--block_size=64", "--max_iters=2", "--hellaswag_interval=2"]
    with pytest.raises(
        UsageError,
        match=r"HellaSwag is scored in GPT-2's BPE, and this run's data is character-level "
        r"\(.*meta.pkl\): set --hellaswag_interval=0",
    ):
        train.Trainer(
            settings(dataset, tmp_path / "x", *extra, f"--hellaswag_path={HELLASWAG_FIXTURE}")
        )
    bpe = tmp_path / "bpe"  # the same token ids without the meta.pkl: GPT-2's BPE
    bpe.mkdir()
    for split in ("train.bin", "val.bin"):
        shutil.copy(os.path.join(dataset, split), bpe / split)
    with pytest.raises(FileNotFoundError, match="hellaswag_path nowhere.jsonl does not exist"):
        train.Trainer(settings(str(bpe), tmp_path / "x", *extra, "--hellaswag_path=nowhere.jsonl"))

    def offline(split):
        raise OSError("no network")

    with pytest.MonkeyPatch.context() as patch:  # no hellaswag_path: the download, offline
        patch.setattr(hellaswag_data, "download", offline)
        with pytest.raises(
            FileNotFoundError,
            match=r"^could not download HellaSwag \(offline\?\): set --hellaswag_path=FILE.jsonl "
            r"or --hellaswag_interval=0$",
        ):
            train.Trainer(settings(str(bpe), tmp_path / "x", *extra))
    assert not os.path.exists(tmp_path / "x")
    capsys.readouterr()
    t = run(str(bpe), tmp_path, *extra, f"--hellaswag_path={HELLASWAG_FIXTURE}")
    assert "%|" not in capsys.readouterr().err  # no progress bar in the training log
    # the last logged score is hellaswag.evaluate's on the run's final params, examples loaded apart
    # from the run's
    examples = hellaswag_data.load_examples(HELLASWAG_FIXTURE, max_len=64)
    final = hellaswag.evaluate(nnx.merge(t.graphdef, t.params), examples, t.mesh)
    logged = [read_log(tmp_path, f"hellaswag_{k}") for k in ("acc", "acc_norm", "count")]
    assert [[i for i, _ in scores] for scores in logged] == [[0, 2]] * 3
    assert [scores[-1][1] for scores in logged] == [
        final.acc,
        final.acc_norm,
        final.count,
    ] and final.count == 20
