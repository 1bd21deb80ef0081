"""
Where the train step's time goes, op by op: bench/train.py's step (its presets and settings) run in
this process under jax.profiler, then the trace read back (jax.profiler.ProfileData) and the
compiled ops of the last --steps executions of the step summed by name, longest first, with each
op's share of the step and the JAX source it came from. On a GPU the ops are its kernels; on a CPU,
the thunks XLA:CPU runs.

    # the H100's fastest row (docs/benchmarks.md)
    python -m bench.profile --preset gpt2 --dtype bfloat16 --batch_size 64 --remat none \
        --loss_chunk 0 --scan_layers off --steps 5
    python -m bench.profile --preset tiny --steps 3     # any machine

Three experiments, not settings of train.py. Two put back what the step did before: --logits
float32, the head's logits for the loss in float32 (now in the compute dtype, as autocast's); --loss
autodiff, the cross-entropy's gradient by autodiff (now its own, written once in the logits' dtype).
Their times beside the default's say what each change gained. One tries what it might do next: --qkv
three, q, k and v as three matmuls (three_projections). --xplane FILE keeps the raw trace (for
TensorBoard's profile plugin or Perfetto) and FILE.hlo.txt the step's program; --read FILE reports
them again.
"""

import argparse
import collections
import glob
import os
import re
import shutil
import tempfile

import numpy as np

from configurator import UsageError, exit_on_bad_input


def step_ops(xplane, executions, runs_in_trace, module_prefix="jit_leaves_step"):
    """({op name: [total ns, runs]} over the last `executions` of the `runs_in_trace` runs of the
    module `module_prefix...`, and the ns those took, each from its first op's start to its last
    op's end), read off an xplane.pb: the ops of a GPU's or TPU's plane, else (XLA:CPU) the thunks
    on the host's threads."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(xplane)
    device = [
        p for p in data.planes if p.name.startswith("/device:") and any(True for _ in p.lines)
    ]
    plane = device[0] if device else data.find_plane_with_name("/host:CPU")
    events = sorted(
        (
            (e, dict(e.stats))
            for line in plane.lines
            for e in line.events
            if str(dict(e.stats).get("hlo_module", "")).startswith(module_prefix)
        ),
        key=lambda es: es[0].start_ns,
    )
    if all("run_id" in stats for _, stats in events):  # XLA:CPU numbers each run of a program
        by_run = collections.defaultdict(list)
        for e, stats in events:
            by_run[stats["run_id"]].append((e, stats))
        runs = list(by_run.values())
    else:  # a GPU's kernels carry no run number
        starts, ends = zip(*[(e.start_ns, e.start_ns + e.duration_ns) for e, _ in events])
        runs = [events[i:j] for i, j in runs_apart(starts, ends, runs_in_trace)]
    runs = runs[-executions:]
    if len(runs) < executions:
        raise UsageError(
            f"{len(runs)} runs of {module_prefix} in the trace {xplane}, not {executions}"
        )
    totals = collections.defaultdict(lambda: [0.0, 0])
    span = 0.0
    for run in runs:
        span += max(e.start_ns + e.duration_ns for e, _ in run) - min(e.start_ns for e, _ in run)
        for e, stats in run:
            # a kernel of a command buffer: the buffer is its hlo_op
            op = str(stats.get("hlo_op", e.name))
            t = totals[e.name if op.startswith("command_buffer") else op]
            t[0] += e.duration_ns
            t[1] += 1
    return dict(totals), span


def runs_apart(starts, ends, runs):
    """Ops by start time -> [(first, last + 1)] of each of `runs` runs: cut at the runs - 1 widest
    gaps between an op's start and every earlier op's end (bench_jax waits for each step's loss
    before the next: the widest gaps)."""
    gaps = np.asarray(starts[1:]) - np.maximum.accumulate(ends)[:-1]
    cuts = (
        sorted(int(i) + 1 for i in np.argsort(gaps, kind="stable")[len(gaps) - runs + 1 :])
        if runs > 1
        else []
    )
    return list(zip([0, *cuts], [*cuts, len(starts)]))


def capture_program(auto_settings):
    """Keeps the HLO text of each step auto_settings compiles (train_workers.bench_jax has it
    compile the step): the last is the step that ran."""
    texts, step_peak = [], auto_settings.step_peak

    def capturing(compiled, mesh):
        texts.append(compiled.as_text())
        return step_peak(compiled, mesh)

    auto_settings.step_peak = capturing
    return texts


def op_sources(hlo_text):
    """{instruction name: the JAX source of it (metadata op_name)} of a compiled program's text."""
    pattern = re.compile(r'^\s*(?:ROOT )?%?([\w.\-]+) = .*?op_name="([^"]*)"', re.M)
    return dict(pattern.findall(hlo_text))


def as_before(logits, loss):
    """The experiments: the loss's logits in float32 (--logits float32) and the cross-entropy's
    gradient by autodiff (--loss autodiff), as the step computed them before 2026-11-26's change
    (docs/benchmarks.md)."""
    import jax
    import jax.numpy as jnp

    import model
    from compute import layers

    if logits == "float32":
        head = layers.tied_head
        model.tied_head = lambda x, embedding, dtype, logits_dtype=None: head(x, embedding, dtype)
    if loss == "autodiff":

        def token_nll(logits, targets):
            x = logits.astype(jnp.float32)
            return (
                jax.nn.logsumexp(x, axis=-1)
                - jnp.take_along_axis(x, targets[..., None], axis=-1)[..., 0]
            )

        layers.token_nll = token_nll


def three_projections():
    """The experiment --qkv three: q, k and v as three matmuls on c_attn's column blocks (the same
    params), so that no (B, T, 3C) buffer is split apart in the forward pass nor joined from cuDNN's
    dq, dk and dv in the backward (each its own weight-gradient matmul; the input's gradient their
    sum). Compiled for an H100 here, the step's (B, T, 3C) slices and concatenates are gone; its
    time is for a GPU to say (docs/benchmarks.md)."""
    import jax
    from jax.ad_checkpoint import checkpoint_name

    import model

    def qkv(self, x, pos=0, length=None):
        B, T, C = x.shape
        linear, kernel = self.c_attn, self.c_attn.kernel[...]
        bias = linear.bias[...] if linear.bias is not None else None
        parts = []
        for i in range(3):
            cols = slice(i * C, (i + 1) * C)
            xi, ki, bi = linear.promote_dtype(
                (x, kernel[:, cols], None if bias is None else bias[cols]), dtype=linear.dtype
            )
            y = jax.lax.dot_general(xi, ki, (((2,), (0,)), ((), ())))  # (B, T, C)
            parts.append(checkpoint_name((y if bi is None else y + bi).astype(linear.dtype), "qkv"))
        # (B, T, nh, hs); record 5's attention rotates and norms what this returns
        return tuple(a.reshape(B, T, self.n_head, C // self.n_head) for a in parts)

    model.CausalSelfAttention.qkv = qkv


def main():
    from bench import train as bench_train
    from bench.train_workers import bench_jax
    from run import auto_settings

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    bench_train.step_options(p)
    p.set_defaults(preset="tiny")
    p.add_argument("--steps", type=int, default=5, help="traced steps summed, after --warmup")
    p.add_argument("--warmup", type=int, default=3, help="steps before them (the first compiles)")
    p.add_argument(
        "--logits", default="compute", choices=["compute", "float32"], help="the experiment above"
    )
    p.add_argument(
        "--loss", default="custom", choices=["custom", "autodiff"], help="the experiment above"
    )
    p.add_argument("--qkv", default="one", choices=["one", "three"], help="the experiment above")
    p.add_argument("--top", type=int, default=25, help="ops printed")
    p.add_argument(
        "--xplane",
        help="copy the raw trace (xplane.pb) here, and the step's program to XPLANE.hlo.txt",
    )
    p.add_argument(
        "--read",
        metavar="XPLANE",
        help="report a trace --xplane kept, instead of running (with the "
        "--steps and --warmup it ran with)",
    )
    args = p.parse_args()
    if args.read:
        program = ""  # without the program beside the trace: no sources
        if os.path.exists(args.read + ".hlo.txt"):
            with open(args.read + ".hlo.txt") as f:
                program = f.read()
        report(*step_ops(args.read, args.steps, args.warmup + args.steps), program, args)
        return 0
    import jax

    s, source = bench_train.step_settings(args, steps=args.steps, warmup=args.warmup, accum=1)
    as_before(args.logits, args.loss)
    if args.qkv == "three":
        three_projections()
    programs = capture_program(auto_settings)
    with tempfile.TemporaryDirectory() as trace_dir:
        options = jax.profiler.ProfileOptions()
        # Python's calls: millions of events, none of them the step's
        options.python_tracer_level = 0
        with jax.profiler.trace(trace_dir, profiler_options=options):
            r = bench_jax(s)
        xplane = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0]
        if args.xplane:
            shutil.copy(xplane, args.xplane)
            with open(args.xplane + ".hlo.txt", "w") as f:
                f.write(programs[-1])
        ops, traced_ns = step_ops(xplane, args.steps, args.warmup + args.steps)
    print(
        f"{args.preset}: {s}{source}, logits {args.logits}, loss's gradient {args.loss}, q/k/v "
        f"{args.qkv}"
    )
    print(
        f"{r['device']}: {r['ms']:.2f} ms a step by the host clock (median, the profiler on), MFU "
        f"{'n/a' if r['mfu'] is None else format(r['mfu'], '.1%')}, peak {r['peak_mb'] / 1024:.2f} "
        "GiB"
    )
    report(ops, traced_ns, programs[-1], args)
    return 0


def report(ops, traced_ns, program, args):
    """The traced step's time, its ops by kind, and its longest ops with the JAX source of each."""
    sources = op_sources(program)
    step_ns = traced_ns / args.steps
    busy = sum(t for t, _ in ops.values()) / args.steps
    print(
        f"traced: {step_ns / 1e6:.2f} ms a step, ops busy {busy / 1e6:.2f} ms of it "
        f"({busy / step_ns:.0%}), {sum(n for _, n in ops.values()) // args.steps} op runs a step"
    )
    # an op's kind: its name less the number XLA gives each instance
    kinds = collections.defaultdict(float)
    for name, (t, _) in ops.items():
        kinds[re.sub(r"[._]\d+$", "", name)] += t
    print(f"\n{'ms/step':>8} {'share':>6}  kind of op")
    for kind, t in sorted(kinds.items(), key=lambda kv: -kv[1])[:12]:
        print(f"{t / args.steps / 1e6:>8.3f} {t / args.steps / step_ns:>6.1%}  {kind}")
    print(f"\n{'ms/step':>8} {'share':>6} {'runs':>5}  op  (source)")
    for name, (t, n) in sorted(ops.items(), key=lambda kv: -kv[1][0])[: args.top]:
        # a GPU kernel is named as its instruction with '_' for '.': fusion_12 is fusion.12
        where = sources.get(name) or sources.get(re.sub(r"_(\d+)$", r".\1", name), "")
        print(
            f"{t / args.steps / 1e6:>8.3f} {t / args.steps / step_ns:>6.1%} {n // args.steps:>5}  "
            f"{name[:100]}  ({where[-110:]})"
        )


if __name__ == "__main__":
    exit_on_bad_input(main)
