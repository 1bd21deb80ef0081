"""
The settings the compiler picks: remat and loss_chunk 'auto' become, for the devices of the mesh the
step is compiled for, the least-recomputing pair whose compiled step fits the memory a program may
use there. Decided from the compiled programs' own memory analysis (the TPU compiler refuses a step
that does not fit), candidate by candidate in the order of CANDIDATES: the first that fits is the
step the run uses, so the common case compiles once. A second start finds the compiled candidates in
JAX's compilation cache and the TPU compiler's refusals in a record beside it (REFUSALS). Also the
one line that says what every 'auto' became and why (line).
"""

import hashlib
import json
import os
from dataclasses import dataclass, replace
from functools import partial

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from archs import models
from compute import accelerators, sharding
from configurator import UsageError
from run.train_step import compiler_options, lower_step, make_train_step, step_peak

# the loss's positions at a time when chunked: (B, 128, vocab) logits, 0.8 GiB at B=64 in bf16
LOSS_CHUNK = 128
# (remat, loss_chunk), fastest first as measured: the 124M step at batch 64 on an H200 took 138.5 ms
# at none/0, 150.5 at dots/0, 152.9 at none/128 (docs/benchmarks.md); then ever more recompute, the
# whole loss before the chunked one
CANDIDATES = (
    ("none", 0),
    ("dots", 0),
    ("none", LOSS_CHUNK),
    ("dots", LOSS_CHUNK),
    ("qkv_proj", 0),
    ("qkv_proj", LOSS_CHUNK),
    ("block", 0),
    ("block", LOSS_CHUNK),
)
# How far the real peak may exceed XLA's analysis: on an H100 the 124M step at none/0 peaked at
# 39.59 GiB where XLA compiling it without a GPU (an older jax) said 31.78 (docs/gpu.md), so a GPU's
# step fits when its compiled peak x 1.25 does; the host's RAM is shared with Python and the
# runtime. The TPU compiler's peak is what it allocates the program by (it refuses one over it), and
# the runtime's own share is outside the HBM it counts: no margin.
MARGIN = {"gpu": 0.25, "cpu": 0.25, "tpu": 0.0}
# in the compilation cache's folder: {program fingerprint: [bytes needed, available]}
REFUSALS = "refusals.json"


def candidates(remat, loss_chunk):
    """The (remat, loss_chunk) pairs to try, in CANDIDATES' order; an explicit setting keeps its
    value."""
    pairs = [
        (remat if remat != "auto" else r, loss_chunk if loss_chunk != "auto" else c)
        for r, c in CANDIDATES
    ]
    return list(dict.fromkeys(pairs))


def first_candidate(c):
    """{remat, loss_chunk} of the first candidate for settings `c`: what a GPTConfig holds until the
    step compiles."""
    return dict(zip(("remat", "loss_chunk"), candidates(c["remat"], c["loss_chunk"])[0]))


@dataclass
class Fit:
    step: object  # the compiled step (None where the TPU compiler refused every candidate)
    graphdef: object  # the model's, with the remat and loss_chunk chosen
    config: object  # its GPTConfig
    state_bytes: int  # params + optimizer state per device
    peak: int  # the compiled step's peak per device (the bytes the refusal names, where refused)
    limit: int | None  # bytes a program may use per device; None where nothing says
    tried: list  # [(remat, loss_chunk, bytes needed)] of the candidates passed over, in order

    def check(self):
        """The one line for a step too big for its device: train.py's, before anything runs."""
        if self.limit is not None and (self.step is None or self.peak > self.limit):
            raise UsageError(
                f"the train step needs {self.peak / 2**30:.2f} GiB per device, the device has "
                f"{self.limit / 2**30:.2f} GiB: lower --batch_size (raise "
                "gradient_accumulation_steps to keep the tokens per step; total_batch_size does "
                "it for you), choose a remat that recomputes more, or raise --fsdp / "
                "--tensor_parallel"
            )


def margin_of(device):
    """MARGIN for `device`'s platform (a GPU compiled for without one: 'gpu' too)."""
    return MARGIN.get(device.platform, MARGIN["gpu"])


def with_settings(graphdef, params, **settings):
    """(graphdef, GPTConfig) of the same model with GPTConfig's run settings changed (remat,
    loss_chunk): the params' tree is the same, only the forward and backward passes differ."""
    model = nnx.merge(graphdef, params)
    model.config = replace(model.config, **settings)
    return nnx.graphdef(model), model.config


def compile_fitting(
    make_step, graphdef, params, opt_state, batch_shape, batch_sharding, remat, loss_chunk
):
    """Compile make_step(graphdef) for each candidate (remat, loss_chunk) until one fits the usable
    memory of the mesh's devices with MARGIN to spare -> Fit. Where none does, the last (the least
    memory), for the caller to refuse in one line. params and opt_state may be abstract
    (bench/train.py --memory)."""
    mesh = batch_sharding.mesh
    device = mesh.devices.flat[0]
    limit, margin = accelerators.usable_bytes(device), margin_of(device)
    # one decision for all: the least memory of any host's, in MiB
    if limit is not None and jax.process_count() > 1:
        # (int32: JAX's default)
        limit = int(np.min(multihost_utils.process_allgather(np.int32(limit >> 20)))) << 20
    record, pairs, tried = refusal_record(device), candidates(remat, loss_chunk), []
    state_bytes = sharding.bytes_per_device([params, opt_state])
    for i, (r, chunk) in enumerate(pairs):
        g, config = with_settings(graphdef, params, remat=r, loss_chunk=chunk)
        lowered = lower_step(make_step(g), params, opt_state, batch_shape, batch_sharding)
        key = record.key(lowered) if record else None
        refusal = record.get(key) if record else None
        if refusal is None:
            try:
                step = lowered.compile(compiler_options(mesh))
            # the TPU compiler's refusal of a step that does not fit
            except jax.errors.JaxRuntimeError as e:
                if (refusal := accelerators.tpu_out_of_memory(e)) is None:
                    raise
                if record:
                    record.put(key, *refusal)
        if refusal is not None:
            needs, limit = refusal
            if i == len(pairs) - 1:
                return Fit(None, g, config, state_bytes, needs, limit, tried)
            tried.append((r, chunk, needs))
            continue
        peak = step_peak(step, mesh)
        if i == len(pairs) - 1 or limit is None or peak * (1 + margin) <= limit:
            return Fit(step, g, config, state_bytes, peak, limit, tried)
        tried.append((r, chunk, peak))


def compile_train_step(
    graphdef,
    params,
    opt_state,
    tx,
    batch_shape,
    batch_sharding,
    settings,
    grad_clip,
    lr_schedule=None,
    **step_inputs,
):
    """train.py's step (train_step.make_train_step) through compile_fitting, for the remat and
    loss_chunk of `settings` (train.py's) -> (Fit, line: what each 'auto' of `settings` became, or
    None). step_inputs: make_train_step's inputs and grad_scale, the architecture's
    (Arch.step_inputs)."""
    make_step = partial(
        make_train_step, tx=tx, grad_clip=grad_clip, lr_schedule=lr_schedule, **step_inputs
    )
    fit = compile_fitting(
        make_step,
        graphdef,
        params,
        opt_state,
        batch_shape,
        batch_sharding,
        settings["remat"],
        settings["loss_chunk"],
    )
    return fit, line(settings, fit, batch_sharding.mesh.devices.flat[0])


def refusal_record(device):
    """The record of the TPU compiler's refusals for `device`'s kind and memory (None off a TPU, or
    without a compilation cache): JAX caches no failed compile, and on a v5e the 124M step is
    refused thrice before one fits."""
    folder = jax.config.jax_compilation_cache_dir
    if device.platform != "tpu" or not folder or "://" in folder:
        return None
    return RefusalRecord(
        os.path.join(folder, REFUSALS), f"{device.device_kind} {accelerators.usable_bytes(device)}"
    )


class RefusalRecord:
    """{fingerprint of (lowered program, device kind, its memory): [bytes needed, available]} in a
    JSON file."""

    def __init__(self, path, target):
        self.path, self.target = path, target

    def key(self, lowered):
        return hashlib.sha256((lowered.as_text() + self.target).encode()).hexdigest()

    def get(self, key):
        try:
            with open(self.path) as f:
                return json.load(f).get(key)
        except (OSError, ValueError):
            return None

    def put(self, key, needs, available):
        try:
            with open(self.path) as f:
                record = json.load(f)
        except (OSError, ValueError):
            record = {}
        record[key] = [needs, available]
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        tmp = f"{self.path}.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, self.path)


def line(settings, fit, device):
    """'auto settings: attention=cudnn, scan_layers=off, remat=none, loss_chunk=0 (step peak 31.78
    of 59.33 GiB usable on NVIDIA H100 80GB HBM3, +25% margin)': what each 'auto' of `settings`
    became for the step `fit` compiled, and why; None where nothing was 'auto'."""
    config = fit.config
    chosen = {
        "dtype": config.dtype,
        "attention": kernel(config, device),
        "scan_layers": "on" if config.scan_layers else "off",
        "remat": config.remat,
        "loss_chunk": config.loss_chunk,
    }
    autos = [f"{k}={v}" for k, v in chosen.items() if settings.get(k) == "auto"]
    if not autos:
        return None
    gib = lambda n: f"{n / 2**30:.2f}"  # noqa: E731
    usable = f" of {gib(fit.limit)} GiB usable" if fit.limit is not None else " GiB"
    why = f"step peak {gib(fit.peak)}{usable} on {device.device_kind}"
    if margin_of(device) and fit.limit is not None:
        why += f", +{margin_of(device):.0%} margin"
    if fit.tried:
        why += "; too big: " + ", ".join(f"{r}/{c} {gib(n)}" for r, c, n in fit.tried)
    return f"auto settings: {', '.join(autos)} ({why})"


def kernel(config, device):
    """The attention kernel the training step runs at block_size on `device` (dropout: the explicit
    one, 'xla'; else its architecture's, Arch.kernel)."""
    if config.dropout > 0:
        return "xla"
    return models.arch_of(config.arch).kernel(config, device)
