"""python -m pytest tests/test_step_time.py -q

Each logged time is the step's: the loop reads a step's metrics after dispatching the next step, and
that dispatch can hold the host for much of a step (a speedrun step on an H200: the last iteration's
line said 458 ms for a ~1,225 ms step). step_clock.StepClock.watch notes the time each step's
outputs become ready, as they do, so a late read makes no step longer and none shorter. The same
clock says how long the run has left: an eta in each log line, and a line after three steps when the
run will take very long here."""

import json
import os
import re
import time

import jax
import jax.numpy as jnp
import pytest
from helpers import run, settings

from run import runlog, step_clock


@jax.jit
def slow_step(x):
    """~0.1-0.5 s of matmuls on the CPU: a step the host can outlast."""
    return jax.lax.fori_loop(0, 40, lambda i, x: jnp.tanh(x @ x), x)


def test_a_step_read_late_logs_its_own_time(dataset, tmp_path):
    x = jnp.ones((512, 512)) / 512
    slow_step(x).block_until_ready()  # compiled
    t0 = time.time()
    slow_step(x).block_until_ready()
    step_s = time.time() - t0
    out = runlog.RunLog(
        settings(dataset, tmp_path),
        True,
        tokens_per_iter=1,
        flops_per_iter=1,
        devices=jax.devices(),
    )
    out.clock.start(0)
    late = 1.0 + 2 * step_s  # the host busy well past both steps' ends before it reads them
    y0 = slow_step(x)
    out.clock.watch(0, {"loss": y0[0, 0]})
    y1 = slow_step(y0)  # the next step, dispatched before the first is read (the loop's order)
    out.clock.watch(1, {"loss": y1[0, 0]})
    time.sleep(late)
    for it, y in enumerate((y0, y1)):
        out.step(it, {"loss": float(y[0, 0]), "lr": 0.1, "grad_norm": 1.0})
    with open(os.path.join(tmp_path, runlog.LOG_FILE)) as f:
        ms = [r["ms"] for r in map(json.loads, f)]
    # each its step's time, not the 1 s and more until the host read them (then ~0 for the second)
    for t in ms:
        assert 1000 * step_s / 3 < t < 1000 * (step_s + late) / 2, (ms, step_s)
    # without watch, the time of the read: what train.py logged before
    out.clock.start(2)
    y = slow_step(x)
    time.sleep(late)
    out.step(2, {"loss": float(y[0, 0]), "lr": 0.1, "grad_norm": 1.0})
    with open(os.path.join(tmp_path, runlog.LOG_FILE)) as f:
        assert [r["ms"] for r in map(json.loads, f)][-1] >= 1000 * late


def test_eta_counts_the_steps_and_evals_left():
    clock = step_clock.StepClock(max_iters=100, eval_interval=30)
    clock.eval_s = 2.0
    # after 10 steps: 90 steps of 0.5 s, and the evals at 30, 60, 90 and the last, 100
    assert clock.eta(10, step_s=0.5) == 90 * 0.5 + 4 * 2.0
    assert clock.eta(90, step_s=0.5) == 10 * 0.5 + 2 * 2.0  # 90's own eval, then 100's
    assert [step_clock.duration(s) for s in (67_912, 725, 45.4)] == ["18h51m", "12m05s", "45s"]


def test_a_long_run_is_said_after_three_steps_once(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(step_clock.time, "time", lambda: now[0])
    clock = step_clock.StepClock(max_iters=5000, eval_interval=250)
    clock.start(0)
    now[0] += 2 * 34.0
    assert clock.first_estimate(1) is None  # two steps: too few to say
    now[0] += 34.0
    assert clock.first_estimate(2) == (  # 4,997 steps x 34 s
        "iterations 0..2 took 34.00 s each: the run's 5,000 iterations and evals end in about "
        "47h11m here"
    )
    assert clock.first_estimate(3) is None  # once
    quick = step_clock.StepClock(max_iters=100, eval_interval=50)
    quick.start(0)
    now[0] += 3 * 0.05
    assert quick.first_estimate(2) is None  # 5 s: nothing to warn of
    exact = step_clock.StepClock(max_iters=3603, eval_interval=10_000)
    exact.start(0)
    now[0] += 3 * 1.0
    assert exact.first_estimate(2) is None  # 3,600 s, LONG_RUN_S itself: not longer, no line


def test_mfu_is_the_flops_over_the_devices_summed_peak():
    class Device:
        def __init__(self, kind):
            self.device_kind = kind

    h100, a100 = Device("NVIDIA H100 80GB HBM3"), Device("NVIDIA A100-SXM4-80GB")
    assert step_clock.mfu(989e12, 2.0, [h100]) == 0.5
    assert step_clock.mfu(2 * 1301e12, 2.0, [h100, a100]) == 1.0  # 989 + 312 TFLOP/s
    assert step_clock.mfu(1e12, 1.0, [h100, Device("cpu")]) is None  # no made-up number


@pytest.mark.slow
def test_each_log_line_ends_with_the_eta(dataset, tmp_path, capsys):
    run(dataset, tmp_path, "--max_iters=3", "--log_interval=1")
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("iter ")]
    assert len(lines) == 3 and all(re.search(r", eta \d+s$", x) for x in lines), lines


def test_a_long_first_eval_is_said_at_its_second_batch_once():
    clock = step_clock.StepClock(max_iters=5000, eval_interval=250)
    assert clock.first_eval_estimate(2, 400, 22.0) == (
        "eval: 2 of 400 batches took 11.00 s each: this eval ends in about 1h13m here (fewer "
        "batches: --eval_iters)"
    )
    assert clock.eval_said
    assert step_clock.StepClock(100, 50).first_eval_estimate(2, 40, 1.0) is None  # 20 s


@pytest.mark.slow
def test_the_first_eval_of_a_run_says_its_time_when_long(dataset, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(step_clock, "LONG_EVAL_S", 0)  # every eval is long
    run(dataset, tmp_path, "--max_iters=2", "--eval_interval=1", "--eval_iters=3")
    said = [x for x in capsys.readouterr().out.splitlines() if x.startswith("eval: ")]
    assert len(said) == 1 and said[0].startswith("eval: 2 of 6 batches took "), said
