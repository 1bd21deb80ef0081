"""
python -m pytest -q tests/test_stop.py

A stop stops: the loop runs at most train.STEPS_AHEAD steps ahead of the device, so SIGTERM saves
and exits within that many slow steps (plus the one running) and the save, not after every step the
host had dispatched by then.
"""

import os
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import settings

import train

NAP = 0.3  # seconds each step takes on the device, a slow step's


def napping(signal_at):
    """(a jitted identity on a step's tokens that first sleeps NAP on the device's time, the times
    it ran); at its `signal_at`-th run it sends SIGTERM."""
    runs, signalled = [], {}

    def nap(first_token):
        time.sleep(NAP)
        runs.append(time.monotonic())
        if len(runs) == signal_at:
            signalled.update(at=time.monotonic(), runs=len(runs))
            os.kill(os.getpid(), signal.SIGTERM)
        return np.zeros((), np.int32)

    # the tokens pass through the nap (+ 0): the step runs after it
    slowed = jax.jit(
        lambda x: x + jax.pure_callback(nap, jax.ShapeDtypeStruct((), jnp.int32), x.reshape(-1)[0])
    )
    return slowed, runs, signalled


def saved_line(capsys, t, out_dir):
    saved = [x for x in capsys.readouterr().out.splitlines() if x.startswith("SIGTERM: ")]
    assert saved == [
        f"SIGTERM: checkpoint saved at iter {t.iter_num}; resume with --init_from=resume "
        f"--out_dir={out_dir}"
    ]


def test_sigterm_stops_within_the_steps_dispatched_ahead(dataset, tmp_path, capsys):
    slowed, runs, signalled = napping(signal_at=3)
    t = train.Trainer(
        settings(dataset, tmp_path, "--max_iters=60", "--log_interval=100", "--eval_interval=1000")
    )
    step = t.train_step
    t.train_step = lambda params, opt_state, x, y, key: step(params, opt_state, slowed(x), y, key)
    t.run()
    stopped = time.monotonic()
    saved_line(capsys, t, tmp_path)
    # steps the device ran after the signal: the one dispatched ahead, then the one the loop's
    # check of the stop follows
    assert len(runs) - signalled["runs"] <= train.STEPS_AHEAD + 1
    assert t.iter_num == len(runs) < 60
    # the whole stop: those steps and the save
    assert stopped - signalled["at"] < (train.STEPS_AHEAD + 1) * NAP + 5


@pytest.mark.slow
def test_sigterm_during_a_long_eval_ends_it(dataset, tmp_path, capsys):
    """The first eval (before step 0) of 40 slow batches, signalled at its third: the loop leaves
    the eval within a batch or two, takes one step and saves it."""
    slowed, runs, signalled = napping(signal_at=3)
    t = train.Trainer(settings(dataset, tmp_path, "--max_iters=60", "--eval_iters=20"))
    eval_step = t.eval_step
    t.eval_step = lambda params, x, y, window: eval_step(params, slowed(x), y, window)
    t.run()
    saved_line(capsys, t, tmp_path)
    assert t.iter_num == 1
    assert len(runs) - signalled["runs"] <= train.STEPS_AHEAD + 1  # of the 37 batches left
