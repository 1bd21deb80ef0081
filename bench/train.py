"""
Training speed and memory: our jitted train step vs two PyTorch references, side by side in one run:
nanoGPT's own model (its model.py: exact GELU, scaled_dot_product_attention) and transformers'
GPT2LMHeadModel, each with torch.optim.AdamW, same shapes, fp32 on CPU. Each measurement runs in its
own process, so peak memory is that run's alone.

    # nanoGPT's CPU baby config (block 64, batch 12, 4x4x128)
    python -m bench.train
    # 124M, B=16, T=1024 (GPU)
    python -m bench.train --preset gpt2 --dtype bfloat16 --frameworks jax
    # the main training command (make shakespeare) vs nanoGPT's train.py loop, 3 pairs
    python -m bench.train --full-run
    python -m bench.train --memory --preset gpt2-xl --fsdp=8 --batch_size=1 --dtype=bfloat16 \
        --devices=8 --remat=none
    # a v5e-8 VM
    python -m bench.train --memory --topology=v5e:2x4 --preset gpt2 --batch_size=16 --dtype=bfloat16
    # an H100, here
    python -m bench.train --memory --gpu=h100 --preset gpt2 --batch_size=64 --dtype=bfloat16
    # nanochat's d20 (config/nanochat.py) on one v6e chip; nanochat-gpt2: its GPT-2-grade d24
    python -m bench.train --memory --topology=v6e:2x4 --devices=1 --preset nanochat --dtype=bfloat16

Prints ms/iter (median of the timed steps, compilation excluded), tokens/s, MFU where the device's
peak is known, peak memory (the device's on GPU/TPU, the process's peak RSS on CPU) and, for ours,
the compiled step's scratch memory (XLA's memory analysis); then ours with gradient accumulation 8
vs 1 (memory must stay flat: lax.scan over micro-batches). --full-run times whole runs instead, in
pairs (--repeats): train.py with the main command's settings, then nanoGPT's training loop
(nanogpt_run) on the same data: the wall time and final val loss of each, and the median ratio.
--memory prints `memory per device: state, step peak` of one step on a mesh and what its 'auto'
settings became, as train.py does at start-up, compiled only (bench_memory). With --topology
(v3:2x2, v5e:2x4, tpu7x:2x2x1...) libtpu's compiler (the tpu extras) compiles it here for that TPU,
with --gpu (h100, a100-40...) and --gpus XLA:GPU (the cuda extras) for a node of those GPUs: its
memory, compile time, and whether it fits.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from bench.presets import NANOCHAT, PRESETS, config_files, nanochat_settings
from bench.train_workers import (
    MAIN_RUN,
    bench_jax,
    bench_memory,
    bench_torch,
    model_config,
    nanogpt_run,
)
from configurator import UsageError, configure, exit_on_bad_input

# jax, and our modules on it, are imported in the functions that use them: this file is also each
# measurement's worker process (run_worker), and a torch worker's peak RSS must be torch's own

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository's root

SCAN_LAYERS = {"on": True, "off": False, "auto": "auto"}  # --scan_layers: train.py's scan_layers


def step_options(p):
    """The options that choose the step, on `p`: preset, batch size, dtype, train.py's compute
    settings."""
    from compute import attention
    from compute.layers import REMAT

    p.add_argument("--preset", default="baby", choices=PRESETS)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--batch_size", type=int, default=None)
    p.add_argument(
        "--remat",
        choices=["auto", *REMAT],
        help="ours: train.py's remat (default: the preset's config "
        "file's: gpt2 config/train_gpt2.py, gpt2-xl config/finetune_shakespeare.py)",
    )
    p.add_argument(
        "--loss_chunk",
        type=lambda v: v if v == "auto" else int(v),
        help="ours: train.py's loss_chunk, or auto (default: as --remat)",
    )
    p.add_argument(
        "--scan_layers",
        choices=list(SCAN_LAYERS),
        help="ours: train.py's scan_layers (default: as --remat)",
    )
    p.add_argument(
        "--attention", default="auto", choices=attention.SETTINGS, help="ours: train.py's attention"
    )


def step_settings(args, **extra):
    """(settings, where its compute settings came from): the preset's shape at the options' batch
    size and dtype, `extra`, and remat, loss_chunk, scan_layers as given, else as the preset's
    config file sets them for its run (nanochat's: its configs' whole run, dialed by depth)."""
    compute = {
        "remat": args.remat,
        "loss_chunk": args.loss_chunk,
        "scan_layers": SCAN_LAYERS.get(args.scan_layers),
    }
    paths = config_files(args.preset) if None in compute.values() else None
    if paths:
        from run.settings import DEFAULTS

        # scan_layers may be 'auto': resolved where the step compiles
        config = configure(DEFAULTS, paths)
        compute = {k: config[k] if v is None else v for k, v in compute.items()}
    preset = PRESETS[args.preset]
    if args.preset in NANOCHAT:
        preset = dict(preset, **nanochat_settings(args.preset))
    return (
        dict(
            preset,
            batch_size=args.batch_size or preset["batch_size"],
            dtype=args.dtype,
            **compute,
            attention=args.attention,
            **extra,
        ),
        f" (from {' + '.join(paths)})" if paths else "",
    )


def memory(args):
    s, source = step_settings(
        args,
        devices=args.devices or 1,
        fsdp=args.fsdp,
        tensor_parallel=args.tensor_parallel,
        topology=args.topology,
        gpu=args.gpu,
    )
    if args.topology or args.gpu:
        from archs import models
        from compute import accelerators

        # a bad name: one line, before any worker
        devices = (
            accelerators.topology_devices(args.topology)
            if args.topology
            else accelerators.gpu_devices(args.gpu, args.gpus)
        )
        # e.g. splash in bf16 on a v3: one line
        models.check_run(model_config(s, devices[0].platform), devices[0])
        n = len(devices)
        if (args.devices or n) > n:
            raise UsageError(
                f"--devices={args.devices}: the target {args.topology or args.gpu} has {n}"
            )
        s["devices"] = args.devices or n
        # the host's backend is not the program's; JAX's compilation cache cannot load a
        # compile-only client's programs
        r = run_worker(
            "memory", s, {"JAX_PLATFORMS": "cpu", "JAX_ENABLE_COMPILATION_CACHE": "false"}
        )
    else:
        env = {"XLA_FLAGS": f"--xla_force_host_platform_device_count={s['devices']}"}
        r = run_worker("memory", s, env)
        # e.g. one GPU asked for 8 devices: XLA:CPU's analysis on fake CPU devices
        if "too_few_devices" in r:
            r = run_worker("memory", s, dict(env, JAX_PLATFORMS="cpu"))
    m = r["mesh"]
    where = (
        f" of {args.topology or args.gpu} ({r['device_kind']})" if args.topology or args.gpu else ""
    )
    print(
        f"{args.preset}, batch {s['batch_size']} x {s['block_size']} per batch shard, "
        f"{s['dtype']}, {s['devices']} {r['backend']} device(s){where}, mesh data {m['data']} x "
        f"fsdp {m['fsdp']} x tensor {m['tensor']}, remat {r['remat']}, loss_chunk "
        f"{r['loss_chunk']}, scan_layers {r['scan_layers']}{source}, attention {r['attention']}"
    )
    if r["auto"]:
        print(r["auto"])
    if r["refused"]:  # by the TPU compiler, every candidate of remat and loss_chunk
        print(
            f"memory per device: state {r['state'] / 2**30:.2f} GiB; does not fit: needs "
            f"~{r['peak'] / 2**30:.2f} GiB of {r['available'] / 2**30:.2f} GiB HBM (the TPU "
            "compiler's figure)"
        )
        return 0
    print(
        f"memory per device: state {r['state'] / 2**30:.2f} GiB, step peak {r['peak'] / 2**30:.2f} "
        "GiB"
    )
    # the TPU compiler refuses a step that does not fit (above), XLA:GPU compiles any
    if args.topology or args.gpu:
        fits = (
            f"fits, step peak {r['peak'] / r['hbm']:.0%} of it"
            if r["peak"] <= r["hbm"]
            else f"does not fit, by {(r['peak'] - r['hbm']) / 2**30:.2f} GiB"
        )
        what = (
            "HBM"
            if args.topology
            else f"memory {accelerators.GPUS[args.gpu].memory / 2**30:.2f} GiB, for JAX"
        )
        print(
            f"{r['device_kind']} {what} {r['hbm'] / 2**30:.2f} GiB per device: {fits} (compiled by "
            f"{'libtpu' if args.topology else 'XLA:GPU'} for {args.topology or args.gpu} in "
            f"{r['compile_s']:.1f} s)"
        )
    else:
        print(f"compiled by XLA:{r['backend'].upper()} in {r['compile_s']:.1f} s")
    return 0


def ours_run(compilation_cache):
    """train.py with the main command's settings, in a subprocess, with JAX's persistent compilation
    cache in the directory `compilation_cache` (a new one: cold; one a run has filled: warm): wall
    time, final val loss."""
    with tempfile.TemporaryDirectory() as out_dir:
        args = [f"--{k}={v}" for k, v in MAIN_RUN.items()] + [
            f"--out_dir={out_dir}",
            "--log_interval=100",
        ]
        t0 = time.time()
        subprocess.run(
            [sys.executable, "train.py", "config/train_shakespeare_char.py", *args],
            check=True,
            stdout=subprocess.DEVNULL,
            env=dict(os.environ, JAX_COMPILATION_CACHE_DIR=compilation_cache),
        )
        wall = time.time() - t0
        with open(os.path.join(out_dir, "log.jsonl")) as f:
            val = [json.loads(line)["val_loss"] for line in f if '"val_loss"' in line][-1]
    return {"wall_s": wall, "val_loss": val}


def full_run(repeats):
    """Whole runs, ours (cold, then warm compilation cache) then nanoGPT's, `repeats` times: a
    shared machine's load drifts over minutes, so each round is reported and the median of the
    ratios is the figure."""
    if not os.path.exists(os.path.join("data", "shakespeare_char", "train.bin")):
        subprocess.run([sys.executable, "data/shakespeare_char/prepare.py"], check=True)
    print(f"main command settings: {MAIN_RUN}")
    print(
        f"\n{'pair':<5} {'jax cold s':>10} {'jax warm s':>10} {'jax val':>8} "
        f"{'nanoGPT wall s':>14} {'nanoGPT val':>11} {'cold / nanoGPT':>14} {'warm / nanoGPT':>14}"
    )
    ratios = {"cold": [], "warm": []}
    for i in range(repeats):
        # new and empty: the first run compiles everything
        with tempfile.TemporaryDirectory() as cache:
            cold, warm = ours_run(cache), ours_run(cache)
        theirs = run_worker("nanogpt-run", {})
        ratios["cold"].append(cold["wall_s"] / theirs["wall_s"])
        ratios["warm"].append(warm["wall_s"] / theirs["wall_s"])
        print(
            f"{i:<5} {cold['wall_s']:>10.1f} {warm['wall_s']:>10.1f} {cold['val_loss']:>8.4f} "
            f"{theirs['wall_s']:>14.1f} {theirs['val_loss']:>11.4f} {ratios['cold'][-1]:>14.2f} "
            f"{ratios['warm'][-1]:>14.2f}",
            flush=True,
        )
    median = {k: sorted(v)[len(v) // 2] for k, v in ratios.items()}
    print(
        f"\njax / nanoGPT wall time, median of {repeats}: cold compilation cache "
        f"{median['cold']:.2f}, warm {median['warm']:.2f} (train.py's includes its imports, "
        "compilation and orbax checkpoints)"
    )


def run_worker(framework, settings, env=None):
    out = subprocess.run(
        [sys.executable, "-m", "bench.train", "--worker", framework, json.dumps(settings)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )
    if out.returncode:
        raise SystemExit(f"{framework} worker failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    # run_worker's child skips the parser, whose choices import jax: a torch run's peak RSS is
    # torch's own
    if sys.argv[1:2] == ["--worker"]:
        framework, settings = sys.argv[2:]
        print(json.dumps(WORKERS[framework](dict(json.loads(settings), framework=framework))))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    step_options(p)
    p.add_argument("--steps", type=int, default=50, help="timed steps")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps (the first compiles)")
    p.add_argument("--frameworks", default="jax,nanogpt,transformers")
    p.add_argument(
        "--no-accum", action="store_true", help="skip the accumulation 8 vs 1 memory check"
    )
    p.add_argument("--full-run", action="store_true", help="time whole training runs (see above)")
    p.add_argument("--repeats", type=int, default=3, help="--full-run: pairs of runs")
    p.add_argument(
        "--memory",
        action="store_true",
        help="memory per device of one step, compile only (see above)",
    )
    p.add_argument(
        "--devices",
        type=int,
        help="--memory: devices (default 1; fake CPU ones if there are fewer); "
        "with --topology, the first N of its devices (default all)",
    )
    p.add_argument("--fsdp", type=int, default=1, help="--memory: the mesh's fsdp axis")
    p.add_argument(
        "--tensor_parallel", type=int, default=1, help="--memory: the mesh's tensor axis"
    )
    p.add_argument(
        "--topology",
        help="--memory: compile for this TPU (e.g. v3:2x2, v5e:2x4, tpu7x:2x2x1) with libtpu, here",
    )
    p.add_argument(
        "--gpu",
        help="--memory: compile for this NVIDIA GPU (a100-40, a100-80, h100, h200, b200), here",
    )
    p.add_argument(
        "--gpus", type=int, default=1, help="--gpu: GPUs of a node (e.g. 8), or nodes of 8"
    )
    p.add_argument(
        "--reference-as-on-gpu",
        action="store_true",
        help="run nanoGPT's reference as on a GPU (torch.compile, fused AdamW, TF32) on any device",
    )
    args = p.parse_args()
    if (args.topology or args.gpu) and not args.memory:
        raise UsageError(
            "--topology and --gpu are for --memory: a step compiled here is sized, not run"
        )
    if args.preset in NANOCHAT and not args.memory and args.frameworks != "jax":
        raise UsageError(
            f"--preset={args.preset} times ours only (--frameworks=jax): nanochat's own base_train "
            "runs beside it in bench/gpu.py's row (e)"
        )
    if args.full_run or args.memory:
        return full_run(args.repeats) if args.full_run else memory(args)

    s, source = step_settings(
        args, steps=args.steps, warmup=args.warmup, accum=1, as_on_gpu=args.reference_as_on_gpu
    )
    print(f"preset {args.preset}: {s}{source}")
    rows = [(fw, 1, run_worker(fw, s)) for fw in args.frameworks.split(",")]
    if "jax" in args.frameworks and not args.no_accum:
        rows.append(
            ("jax", 8, run_worker("jax", dict(s, accum=8, steps=max(args.steps // 8, 5), warmup=2)))
        )
    print(
        f"\n{'framework':<12} {'accum':>5} {'ms/iter':>9} {'tok/s':>10} {'mfu':>7} {'peak MB':>9}  "
        f"{'memory':<6} {'step temp MB':>12} {'compile s':>9}  device"
    )
    for fw, accum, r in rows:
        mfu = f"{r['mfu'] * 100:.1f}%" if r["mfu"] is not None else "n/a"
        comp = f"{r['compile_s']:.1f}" if r["compile_s"] is not None else "-"
        temp = f"{r['temp_mb']:.1f}" if r["temp_mb"] is not None else "-"
        print(
            f"{fw:<12} {accum:>5} {r['ms']:>9.2f} {r['tokens'] / r['ms'] * 1000:>10,.0f} {mfu:>7} "
            f"{r['peak_mb']:>9.0f}  {r['memory']:<6} {temp:>12} {comp:>9}  {r['device']}"
        )
    by = {(fw, a): r for fw, a, r in rows}
    print()
    for ref in ("nanogpt", "transformers"):
        if ("jax", 1) in by and (ref, 1) in by:
            print(f"jax / {ref} ms per iteration: {by['jax', 1]['ms'] / by[ref, 1]['ms']:.2f}")
    if ("jax", 8) in by:
        print(
            "jax peak memory, accumulation 8 / 1: "
            f"{by['jax', 8]['peak_mb'] / by['jax', 1]['peak_mb']:.3f} (step scratch memory: "
            f"{by['jax', 8]['temp_mb'] / by['jax', 1]['temp_mb']:.3f})"
        )


WORKERS = {
    "jax": bench_jax,
    "nanogpt": bench_torch,
    "transformers": bench_torch,
    "nanogpt-run": nanogpt_run,
    "memory": bench_memory,
}

if __name__ == "__main__":
    exit_on_bad_input(main)
