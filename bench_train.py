"""
Training speed and memory: our jitted train step vs a PyTorch reference loop (transformers'
GPT2LMHeadModel + torch.optim.AdamW, same shapes, fp32 on CPU), side by side in one run. Each measurement
runs in its own process, so peak memory is that run's alone.

    python bench_train.py                      # nanoGPT's CPU baby config (block 64, batch 12, 4x4x128)
    python bench_train.py --preset gpt2 --dtype bfloat16 --frameworks jax   # 124M, B=16, T=1024 (GPU)

Prints ms/iter (median of the timed steps, compilation excluded), tokens/s, MFU where the device's peak is
known, peak memory (device peak on GPU/TPU, process peak RSS on CPU) and, for ours, the compiled step's
scratch memory (XLA's memory analysis); then ours with gradient accumulation 8 vs 1 (memory must stay
flat: lax.scan over micro-batches).
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time

PRESETS = {
    "baby": dict(block_size=64, batch_size=12, n_layer=4, n_head=4, n_embd=128, vocab_size=65),
    "gpt2": dict(block_size=1024, batch_size=16, n_layer=12, n_head=12, n_embd=768, vocab_size=50304),
}


def bench_jax(s):
    import jax
    import numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import train
    from model import GPT, GPTConfig

    c = dict(train.DEFAULTS, learning_rate=1e-3, warmup_iters=10, lr_decay_iters=1000, min_lr=1e-4)
    model = GPT(GPTConfig(block_size=s["block_size"], vocab_size=s["vocab_size"], n_layer=s["n_layer"],
                          n_head=s["n_head"], n_embd=s["n_embd"], bias=True, dtype=s["dtype"]), nnx.Rngs(0))
    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    graphdef, params = nnx.split(model)
    params = jax.device_put(params, NamedSharding(mesh, P()))
    tx = train.make_optimizer(c)
    opt_state = jax.jit(tx.init)(params)
    step = train.make_train_step(graphdef, tx, grad_clip=1.0)
    rows = s["batch_size"] * jax.device_count()
    rng = np.random.default_rng(0)
    batch = rng.integers(0, s["vocab_size"], (s["accum"], rows, s["block_size"] + 1)).astype(np.int32)
    sharding = NamedSharding(mesh, P(None, "data", None))
    x, y = jax.device_put(batch[..., :-1], sharding), jax.device_put(batch[..., 1:], sharding)
    key = jax.random.key(0)
    # XLA's own account of the step's scratch memory (activations, grads in flight): exact, on any backend
    temp = step.lower(params, opt_state, x, y, key).compile().memory_analysis().temp_size_in_bytes
    times = []
    for i in range(s["warmup"] + s["steps"]):
        t0 = time.perf_counter()
        params, opt_state, metrics = step(params, opt_state, x, y, key)
        float(metrics["loss"])  # sync, to time each step
        times.append(time.perf_counter() - t0)
    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    dt = float(np.median(times[s["warmup"]:]))
    mfu = model.estimate_mfu(s["accum"] * rows, dt)
    return {"ms": dt * 1000, "compile_s": times[0], "peak_mb": (peak or rss_bytes()) / 2**20,
            "memory": "device" if peak else "RSS", "mfu": mfu, "device": jax.devices()[0].device_kind,
            "temp_mb": temp / 2**20,
            "tokens": s["accum"] * rows * s["block_size"]}


def bench_torch(s):
    import numpy as np
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from parity.common import pin_numerics

    pin_numerics()
    torch.set_num_threads(os.cpu_count())
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = GPT2Config(n_positions=s["block_size"], vocab_size=s["vocab_size"], n_layer=s["n_layer"],
                        n_head=s["n_head"], n_embd=s["n_embd"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=None, eos_token_id=None)
    model = GPT2LMHeadModel(config).to(device).train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    rng = np.random.default_rng(0)
    batch = torch.from_numpy(rng.integers(0, s["vocab_size"], (s["accum"], s["batch_size"], s["block_size"] + 1)))
    batch = batch.to(device)
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=s["dtype"] == "bfloat16")
    times = []
    for i in range(s["warmup"] + s["steps"]):
        t0 = time.perf_counter()
        for k in range(s["accum"]):
            with autocast:
                logits = model(batch[k, :, :-1]).logits
                loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[k, :, 1:].flatten())
            (loss / s["accum"]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    dt = float(np.median(times[s["warmup"]:]))
    return {"ms": dt * 1000, "compile_s": None, "peak_mb": (peak or rss_bytes()) / 2**20,
            "memory": "device" if peak else "RSS", "mfu": None, "temp_mb": None,
            "device": torch.cuda.get_device_name() if peak else "cpu",
            "tokens": s["accum"] * s["batch_size"] * s["block_size"]}


def rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def run_worker(framework, settings):
    out = subprocess.run([sys.executable, __file__, "--worker", framework, "--settings", json.dumps(settings)],
                         capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{framework} worker failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    p.add_argument("--preset", default="baby", choices=PRESETS)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--steps", type=int, default=50, help="timed steps")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps (the first compiles)")
    p.add_argument("--frameworks", default="jax,torch")
    p.add_argument("--batch_size", type=int, default=None)
    p.add_argument("--no-accum", action="store_true", help="skip the accumulation 8 vs 1 memory check")
    p.add_argument("--worker", choices=["jax", "torch"], help=argparse.SUPPRESS)
    p.add_argument("--settings", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps((bench_jax if args.worker == "jax" else bench_torch)(json.loads(args.settings))))
        return

    s = dict(PRESETS[args.preset], dtype=args.dtype, steps=args.steps, warmup=args.warmup, accum=1)
    if args.batch_size:
        s["batch_size"] = args.batch_size
    print(f"preset {args.preset}: {s}")
    rows = []
    for fw in args.frameworks.split(","):
        rows.append((fw, 1, run_worker(fw, s)))
    if "jax" in args.frameworks and not args.no_accum:
        rows.append(("jax", 8, run_worker("jax", dict(s, accum=8, steps=max(args.steps // 8, 5), warmup=2))))
    print(f"\n{'framework':<10} {'accum':>5} {'ms/iter':>9} {'tok/s':>10} {'mfu':>7} {'peak MB':>9}  "
          f"{'memory':<6} {'step temp MB':>12} {'compile s':>9}  device")
    for fw, accum, r in rows:
        mfu = f"{r['mfu'] * 100:.1f}%" if r["mfu"] is not None else "n/a"
        comp = f"{r['compile_s']:.1f}" if r["compile_s"] is not None else "-"
        temp = f"{r['temp_mb']:.1f}" if r["temp_mb"] is not None else "-"
        print(f"{fw:<10} {accum:>5} {r['ms']:>9.2f} {r['tokens'] / r['ms'] * 1000:>10,.0f} {mfu:>7} "
              f"{r['peak_mb']:>9.0f}  {r['memory']:<6} {temp:>12} {comp:>9}  {r['device']}")
    by = {(fw, a): r for fw, a, r in rows}
    if ("jax", 1) in by and ("torch", 1) in by:
        print(f"\njax / torch ms per iteration: {by['jax', 1]['ms'] / by['torch', 1]['ms']:.2f}")
    if ("jax", 8) in by:
        print(f"jax peak memory, accumulation 8 / 1: {by['jax', 8]['peak_mb'] / by['jax', 1]['peak_mb']:.3f} "
              f"(step scratch memory: {by['jax', 8]['temp_mb'] / by['jax', 1]['temp_mb']:.3f})")


if __name__ == "__main__":
    main()
