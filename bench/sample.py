"""
Sampling speed, side by side in one run: our KV-cache generate, transformers' generate, our no-cache
path.

    # gpt2-shaped random weights, batch 1 and 8, 500 tokens
    python -m bench.sample
    python -m bench.sample --size gpt2-medium --batch 1 --new-tokens 100
    # whole processes: sample.py vs a transformers script
    python -m bench.sample --startup

Greedy decoding in float32 from an 8-token prompt, ours on JAX's default device and transformers on
the same one (the GPU where there is one, else the CPU). Compile time is reported apart from speed:
ours is the time the first call spends tracing and compiling (JAX's compile events), and its
tokens/s is the rest of that call. transformers gets a warm-up that also picks its faster torch
thread count (1 or all cores; shown in brackets). Our no-cache path forwards the same fixed window
of min(prompt + new, block_size) tokens every step, so its tokens/s is timed over its last
--nocache-steps steps at the full length and holds for every step.

--startup times whole processes, one after the other, in --repeats rounds: `python sample.py
--init_from=DIR --max_new_tokens=200 --num_samples=1 --temperature=1.0 --top_k=200` on a cold JAX
compilation cache (a new, empty one) and on a warm one (the same command again), and a transformers
process that loads DIR and calls generate(max_new_tokens=200, do_sample=True, top_k=200); the
medians of ours / transformers.

--memory compiles sample.py's generation (the prompt prefilled into the KV cache, then --new-tokens
sampled with top-k, in one jit) for a device it need not have, as bench/train.py --memory does the
train step: --gpu=NAME (XLA:GPU, jax[cuda12]: docs/gpu.md) or --topology=T (one chip of a TPU
topology, libtpu: docs/tpu.md). It prints the weights' bytes, the compiled program's peak and
whether it fits the device's memory:

    python -m bench.sample --memory --gpu=h100 --size gpt2-xl --batch 8 --new-tokens 1000 \
        --dtype bfloat16
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from configurator import UsageError, exit_on_bad_input
from parity.common import HF_SIZES, print_table, random_hf_model

PROMPT = "Hello, I'm a language model,"  # 8 GPT-2 tokens
# tiny: bench/gpu.py --tiny, the tests
SIZES = {**HF_SIZES, "tiny": dict(n_layer=2, n_head=2, n_embd=64)}


class CompileTimer:
    """Seconds JAX spends tracing, lowering and compiling, from its monitoring events."""

    EVENTS = (
        "/jax/core/compile/jaxpr_trace_duration",
        "/jax/core/compile/jaxpr_to_mlir_module_duration",
        "/jax/core/compile/backend_compile_duration",
    )

    def __init__(self):
        import jax

        self.total = 0.0
        jax.monitoring.register_event_duration_secs_listener(self._record)

    def _record(self, event, duration, **kwargs):
        if event in self.EVENTS:
            self.total += duration


def time_ours(model, idx, new_tokens, timer, use_cache=True):
    """(compile s, run s, tokens) of one generate call."""
    before, t0 = timer.total, time.perf_counter()
    out = model.generate(idx, new_tokens, temperature=0, use_cache=use_cache)
    wall = time.perf_counter() - t0
    compile_s = timer.total - before
    return compile_s, wall - compile_s, out


def time_hf(hf_model, idx, new_tokens, probe_tokens=16):
    """(threads, warm-up s, run s, tokens) of transformers' greedy generate, on the model's device
    (the GPU where there is one, as ours). On a CPU the warm-up also tries torch on 1 thread and on
    all of them, and keeps the faster: on a busy machine torch's default (all threads) can be
    several times slower than 1 thread."""
    import torch

    device = next(hf_model.parameters()).device
    x = torch.from_numpy(idx.astype(np.int64)).to(device)
    kw = dict(attention_mask=torch.ones_like(x), do_sample=False, min_new_tokens=0)
    t_warm, probes = time.perf_counter(), {}
    with torch.no_grad():
        hf_model.generate(x, max_new_tokens=4, **kw).cpu()
        for threads in sorted({1, os.cpu_count()}) if device.type == "cpu" else ():
            torch.set_num_threads(threads)
            t0 = time.perf_counter()
            hf_model.generate(x, max_new_tokens=probe_tokens, **kw)
            probes[threads] = time.perf_counter() - t0
        threads = min(probes, key=probes.get) if probes else torch.get_num_threads()
        torch.set_num_threads(threads)
        warmup = time.perf_counter() - t_warm
        t0 = time.perf_counter()
        # .cpu(): waits for the GPU
        out = hf_model.generate(x, max_new_tokens=new_tokens, **kw).cpu().numpy()
    return threads, warmup, time.perf_counter() - t0, out


SAMPLE_ARGS = ["--max_new_tokens=200", "--num_samples=1", "--temperature=1.0", "--top_k=200"]
# the transformers process: the same work as sample.py's command (GPT-2 BPE, "\n" prompt, top-k 200
# sampling)
TRANSFORMERS_SCRIPT = """
import sys, torch
from transformers import GPT2LMHeadModel
from dataio.tokenizer import get_encoding

# jax, and our modules on it, are imported in the functions that use them: bad arguments fail
# before jax loads
model = GPT2LMHeadModel.from_pretrained(sys.argv[1]).eval()
model.generation_config.eos_token_id = None  # 200 tokens, as sample.py
torch.manual_seed(1337)
x = torch.tensor([get_encoding().encode("\\n")])
with torch.no_grad():
    y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=200, do_sample=True,
                       top_k=200, pad_token_id=0)
print(get_encoding().decode(y[0].tolist()))
"""


def wall(cmd, env):
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def startup(size, repeats):
    """Whole processes, one after the other: ours cold, ours warm, transformers, `repeats` times."""
    rows, ratios = [], {"cold": [], "warm": []}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "model")
        random_hf_model(0, **SIZES[size]).save_pretrained(model_dir)
        for i in range(repeats):
            # new: cold
            env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=os.path.join(tmp, f"jax-cache-{i}"))
            ours = [sys.executable, "sample.py", f"--init_from={model_dir}", *SAMPLE_ARGS]
            cold, warm = wall(ours, env), wall(ours, env)
            theirs = wall([sys.executable, "-c", TRANSFORMERS_SCRIPT, model_dir], env)
            ratios["cold"].append(cold / theirs)
            ratios["warm"].append(warm / theirs)
            rows.append(
                [str(i), cold, warm, theirs, f"{cold / theirs:.2f}x", f"{warm / theirs:.2f}x"]
            )
            print(
                f"round {i}: sample.py cold {cold:.1f}s, warm {warm:.1f}s; transformers "
                f"{theirs:.1f}s",
                flush=True,
            )
    print(
        f"\n{size}-shaped random weights; `python sample.py --init_from=DIR "
        f"{' '.join(SAMPLE_ARGS)}` vs transformers from_pretrained + generate(200, do_sample, "
        f"top_k=200); {os.cpu_count()} cores"
    )
    print_table(
        rows,
        [
            "round",
            "ours cold s",
            "ours warm s",
            "transformers s",
            "cold / transformers",
            "warm / transformers",
        ],
    )
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    print(
        f"median: cold {median(ratios['cold']):.2f}x, warm {median(ratios['warm']):.2f}x "
        "transformers' time"
    )
    return 0


def memory(args):
    """sample.py's generate step compiled for one device of args.gpu or args.topology, from abstract
    weights."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from compute import accelerators, generate, sharding
    from model import GPT, GPTConfig

    if args.gpu:
        devices, compiler = accelerators.gpu_devices(args.gpu), "XLA:GPU"
    else:
        devices, compiler = accelerators.topology_devices(args.topology), "libtpu"
    mesh = sharding.make_mesh(devices=devices[:1])
    config = GPTConfig(**SIZES[args.size], vocab_size=50257, dtype=args.dtype, scan_layers=True)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: GPT(config, nnx.Rngs(0))))
    params = sharding.abstract(params, sharding.shardings_for(params, mesh))
    # an 8-token prompt (PROMPT's), then the samples
    L = min(8 + args.new_tokens, config.block_size)
    one = sharding.replicated(mesh)
    rows, n, key = (
        jax.ShapeDtypeStruct(shape, dtype, sharding=one)
        for shape, dtype in (
            ((args.batch[0], L), jnp.int32),
            ((), jnp.int32),
            ((), jax.random.key(0).dtype),
        )
    )
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
        compiled = generate.generate_in_jit.lower(
            nnx.merge(graphdef, params),
            rows,
            n,
            key,
            sampling=(1.0, 200, None, None),
            use_cache=True,
            on_token=None,
            return_logits=False,
        ).compile()
    peak = sharding.step_peak_bytes(compiled.compiled, sharding.platform_of(mesh))
    limit = accelerators.usable_bytes(devices[0])
    print(
        f"{args.size}, batch {args.batch[0]}, {L} positions, {args.dtype}, KV cache, on "
        f"{devices[0].device_kind}: weights {sharding.bytes_per_device(params) / 2**30:.2f} GiB, "
        f"generate peak {peak / 2**30:.2f} GiB of {limit / 2**30:.2f} GiB: "
        f"{'fits' if peak <= limit else 'does not fit'} (compiled by {compiler} in "
        f"{time.perf_counter() - t0:.1f} s)"
    )
    return 0


def hf_device_name(hf_model):
    import torch

    device = next(hf_model.parameters()).device
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0].strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--size", default="gpt2", choices=list(SIZES), help="architecture; weights are random"
    )
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--new-tokens", type=int, default=500)
    p.add_argument("--nocache-steps", type=int, default=1, help="steps timed on the no-cache path")
    p.add_argument(
        "--startup", action="store_true", help="time whole processes instead (see above)"
    )
    p.add_argument("--repeats", type=int, default=3, help="--startup: rounds")
    p.add_argument(
        "--memory",
        action="store_true",
        help="compile generation for --gpu or --topology (see above)",
    )
    p.add_argument(
        "--gpu", help="--memory: an NVIDIA GPU of accelerators.GPUS (h100, a100-40, ...)"
    )
    p.add_argument("--topology", help="--memory: a TPU topology (e.g. v5e:2x2): one of its chips")
    p.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["float32", "bfloat16"],
        help="--memory's compute dtype",
    )
    args = p.parse_args(argv)
    if args.memory and bool(args.gpu) == bool(args.topology):
        raise UsageError(
            "--memory compiles for a device it need not have: give --gpu=NAME or --topology=T"
        )
    from compute import sharding

    sharding.start_backend()  # libtpu's banner kept off the terminal where no TPU is
    if args.memory:
        return memory(args)
    if args.startup:
        return startup(args.size, args.repeats)
    if args.new_tokens < 1 or min(args.batch) < 1 or args.nocache_steps < 1:
        raise UsageError("--new-tokens, --batch and --nocache-steps must be >= 1")
    if args.nocache_steps > args.new_tokens:
        raise UsageError(
            f"--nocache-steps ({args.nocache_steps}) cannot exceed --new-tokens ({args.new_tokens})"
        )

    _, rows = compare(args.size, args.batch, args.new_tokens, args.nocache_steps, echo=True)
    print()
    print_table(
        [
            [
                str(r["batch"]),
                r["compile_s"],
                r["ours_tps"],
                r["hf_warmup_s"],
                f"{r['hf_tps']:.3g} ({r['threads']})",
                r["nocache_compile_s"],
                r["nocache_tps"],
                f"{r['ours_tps'] / r['hf_tps']:.2f}x",
                f"{r['ours_tps'] / r['nocache_tps']:.1f}x",
                "yes" if r["same"] else "NO",
            ]
            for r in rows
        ],
        [
            "batch",
            "ours compile s",
            "ours tok/s",
            "HF warm-up s",
            "HF tok/s (threads)",
            "no-cache compile s",
            "no-cache tok/s",
            "ours / HF",
            "ours / no-cache",
            "same tokens",
        ],
    )
    return 0


def compare(size, batches, new_tokens, nocache_steps=1, echo=False):
    """(a line naming the run, [{batch, ours_tps, hf_tps, ...}]): ours and transformers' greedy
    generate on the same random weights of `size`, each batch size in `batches`; bench/gpu.py's
    sampling row."""
    import jax
    import torch
    import transformers
    from transformers import GPT2LMHeadModel

    from dataio.tokenizer import get_encoding
    from model import GPT

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    timer = CompileTimer()
    with tempfile.TemporaryDirectory() as tmp:
        random_hf_model(0, **SIZES[size]).save_pretrained(tmp)
        model = GPT.from_pretrained(tmp)
        # default attention (sdpa)
        hf_model = GPT2LMHeadModel.from_pretrained(tmp, dtype=torch.float32).eval()
    # ours runs on JAX's default device, the GPU
    hf_model.to("cuda" if torch.cuda.is_available() else "cpu")
    hf_model.generation_config.eos_token_id = None  # decode every token, as ours
    hf_model.generation_config.pad_token_id = 0
    prompt = get_encoding().encode(PROMPT)
    T, N = len(prompt), new_tokens
    if T + N > model.config.block_size:
        raise UsageError(
            f"prompt + new tokens = {T + N} > block_size {model.config.block_size}: HF would stop"
        )
    header = (
        f"{size}-shaped, random weights, {model.num_params() / 1e6:.1f}M params; float32; greedy; "
        f"{T}-token prompt + {N} new tokens; jax {jax.__version__} on "
        f"{jax.devices()[0].device_kind} ({os.cpu_count()} cores); torch {torch.__version__} on "
        f"{hf_device_name(hf_model)}, transformers {transformers.__version__}"
    )
    if echo:
        print(header, flush=True)
    rows = []
    for B in batches:
        idx = np.tile(np.array(prompt, np.int32), (B, 1))
        compile_s, run_s, ours = time_ours(model, idx, N, timer)
        threads, warmup_s, hf_s, theirs = time_hf(hf_model, idx, N)
        # no cache: the same (B, T + N) compiled loop, run for its last k steps only
        k = nocache_steps
        long_prompt = np.tile(np.resize(np.array(prompt, np.int32), T + N - k), (B, 1))
        nc_compile_s, nc_s, _ = time_ours(model, long_prompt, k, timer, use_cache=False)
        rows.append(
            dict(
                batch=B,
                compile_s=compile_s,
                ours_tps=B * N / run_s,
                hf_warmup_s=warmup_s,
                hf_tps=B * N / hf_s,
                threads=threads,
                nocache_compile_s=nc_compile_s,
                nocache_tps=B * k / nc_s,
                same=bool(np.array_equal(ours, theirs)),
            )
        )
        if echo:
            print(
                f"batch {B}: ours {run_s:.1f}s (+{compile_s:.1f}s compile), transformers "
                f"{hf_s:.1f}s, no-cache {nc_s:.1f}s for {k} steps",
                flush=True,
            )
    return header, rows


if __name__ == "__main__":
    exit_on_bad_input(main)
