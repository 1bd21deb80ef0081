"""python -m pytest tests/test_step_time.py -q

Each logged time is the step's: the loop reads a step's metrics after dispatching the next step, and
that dispatch can hold the host for much of a step (a speedrun step on an H200: the last iteration's
line said 458 ms for a ~1,225 ms step). step_clock.StepClock.watch notes the time each step's
outputs become ready, as they do, so a late read makes no step longer and none shorter."""

import json
import os
import time

import jax
import jax.numpy as jnp
from helpers import settings

import runlog


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
