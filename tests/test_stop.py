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
from helpers import settings

import train

NAP = 0.3  # seconds each step takes on the device, a slow step's


def test_sigterm_stops_within_the_steps_dispatched_ahead(dataset, tmp_path, capsys):
    runs, signalled = [], {}

    def nap(first_token):
        """On the device's time: sleeps, counts the step, and at the third sends SIGTERM."""
        time.sleep(NAP)
        runs.append(time.monotonic())
        if len(runs) == 3:
            signalled.update(at=time.monotonic(), steps_run=len(runs))
            os.kill(os.getpid(), signal.SIGTERM)
        return np.zeros((), np.int32)

    # the step's tokens pass through the nap (+ 0): the step runs after it
    slowed = jax.jit(
        lambda x: x + jax.pure_callback(nap, jax.ShapeDtypeStruct((), jnp.int32), x[0, 0, 0])
    )
    t = train.Trainer(
        settings(dataset, tmp_path, "--max_iters=60", "--log_interval=100", "--eval_interval=1000")
    )
    step = t.train_step
    t.train_step = lambda params, opt_state, x, y, key: step(params, opt_state, slowed(x), y, key)
    t.run()
    stopped = time.monotonic()

    saved = [x for x in capsys.readouterr().out.splitlines() if x.startswith("SIGTERM: ")]
    assert saved == [
        f"SIGTERM: checkpoint saved at iter {t.iter_num}; resume with --init_from=resume "
        f"--out_dir={tmp_path}"
    ]
    # steps the device ran after the signal: the one dispatched ahead, then the one the loop's
    # check of the stop follows
    assert len(runs) - signalled["steps_run"] <= train.STEPS_AHEAD + 1
    assert t.iter_num == len(runs) < 60
    # the whole stop: those steps and the save
    assert stopped - signalled["at"] < (train.STEPS_AHEAD + 1) * NAP + 5
