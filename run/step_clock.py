"""
A run's clock: each step's time, read without stalling the device (a thread notes when a log step's
outputs become ready), MFU over the devices' bf16 peak, and the time the run has left: an eta in
each log line and, when the run will take very long here, a line as soon as three steps have run.
"""

import concurrent.futures
import time

import jax

# a run that the first steps say will take longer than this here gets a line saying so at once
LONG_RUN_S = 3600
# an eval the first of whose batches say it will take longer than this gets a line saying so
LONG_EVAL_S = 300


class StepClock:
    """Step times (from start, or the last lap, to a watched step's end) and the eta, from the
    logged steps' mean time and the last eval's (evals: every eval_interval and at max_iters)."""

    def __init__(self, max_iters, eval_interval):
        self.max_iters, self.eval_interval = max_iters, eval_interval
        self.eval_s = 0.0  # the last eval's seconds (RunLog.eval_line)
        self._step_s, self._steps = 0.0, 0  # the laps' seconds and steps, evals left out
        self._estimated = False  # first_estimate made
        self.eval_said = False  # first_eval_estimate made
        # watch: {iteration: future of the time its step ended}
        self._waiter, self._ended = None, {}

    def start(self, it):
        """Step times count from here (after an eval: its time is not step time)."""
        self._t0, self._since = time.time(), it
        if not self._estimated:
            self._origin = (self._t0, it)

    def watch(self, it, outputs):
        """Note when step `it` ends on the device, as it ends: a thread waits for its outputs. The
        loop reads them later, after dispatching the next step, and that dispatch may hold the host
        for much of the next step's time (a speedrun step on an H200: the last iteration's line said
        458 ms for a 1,225 ms step)."""
        if self._waiter is None:
            self._waiter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="step-clock")
        self._ended[it] = self._waiter.submit(ended_at, outputs)

    def lap(self, it):
        """Seconds per step from the start or the last lap to step `it`'s end (watched), or to now
        (not watched)."""
        done = it + 1
        ended = self._ended.pop(it).result() if it in self._ended else time.time()
        dt = (ended - self._t0) / (done - self._since)
        self._step_s, self._steps = (
            self._step_s + ended - self._t0,
            self._steps + done - self._since,
        )
        self._t0, self._since = ended, done
        return dt

    def eta(self, done, step_s=None):
        """Seconds left after `done` iterations at `step_s` a step (by default, the laps' mean):
        the steps, and the evals still to come at the last eval's time."""
        step_s = self._step_s / self._steps if step_s is None else step_s
        evals = self.max_iters // self.eval_interval - (done - 1) // self.eval_interval
        evals += self.max_iters % self.eval_interval != 0
        return (self.max_iters - done) * step_s + evals * self.eval_s

    def first_estimate(self, it):
        """Step `it` has run. Three steps in, once: a line when the run as configured will take
        longer than LONG_RUN_S here, said before the first log line, which may be many steps away;
        else None."""
        t0, since = self._origin
        if self._estimated or it + 1 - since < 3:
            return None
        self._estimated = True
        step_s = (time.time() - t0) / (it + 1 - since)
        eta = self.eta(it + 1, step_s)
        if eta <= LONG_RUN_S:
            return None
        return (
            f"iterations {since}..{it} took {step_s:.2f} s each: the run's {self.max_iters:,} "
            f"iterations and evals end in about {duration(eta)} here"
        )

    def first_eval_estimate(self, done, batches, seconds):
        """The run's first eval has run `done` of its `batches` in `seconds`: once, a line when that
        eval will take longer than LONG_EVAL_S here (nanoGPT's GPU recipe on a CPU: 29 minutes,
        before its first step), else None."""
        self.eval_said = True
        eval_s = seconds / done * batches
        if eval_s <= LONG_EVAL_S:
            return None
        return (
            f"eval: {done} of {batches} batches took {seconds / done:.2f} s each: this eval ends "
            f"in about {duration(eval_s)} here (fewer batches: --eval_iters)"
        )


def duration(seconds):
    """18h52m, 12m05s or 45s."""
    s = round(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def ended_at(outputs):
    """The time at which a step's outputs are ready."""
    jax.block_until_ready(outputs)
    return time.time()


# bf16 dense peak FLOP/s per device, by substrings of jax's device_kind (first match wins). TPUs:
# Google Cloud's figure per chip over the devices a chip shows (accelerators.TPUS: v2, v3 and TPU7x
# show each TensorCore as a device)
PEAK_BF16_FLOPS = [
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("TPU v2", 45e12 / 2),
    ("TPU v3", 123e12 / 2),
    ("TPU v4", 275e12),
    ("TPU v5 lite", 197e12),  # v5e
    ("TPU v5e", 197e12),
    ("TPU v5p", 459e12),
    ("TPU v5", 459e12),
    ("TPU v6 lite", 918e12),  # v6e (Trillium)
    ("TPU v6e", 918e12),
    ("TPU7x", 2307e12 / 2),  # Ironwood
]


def peak_flops(device):
    """A JAX device's bf16 peak FLOP/s, or None where unknown (CPU)."""
    return peak_flops_of(getattr(device, "device_kind", ""))


def peak_flops_of(kind):
    """By a device's name (jax's device_kind, torch.cuda.get_device_name())."""
    return next((flops for name, flops in PEAK_BF16_FLOPS if name in kind), None)


def mfu(flops, seconds, devices):
    """Model FLOPs utilization: `flops` (the model's count, GPT.flops_per_token x tokens) done in
    `seconds` over the bf16 peak of `devices`; None where a device's peak is unknown (CPU), rather
    than a made-up number."""
    peaks = [peak_flops(d) for d in devices]
    return None if None in peaks else flops / seconds / sum(peaks)
