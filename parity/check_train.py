"""
Training parity: nanoGPT's training step in PyTorch (parity/torch_reference.py: transformers'
GPT2LMHeadModel, AdamW with nanoGPT's two parameter groups, get_lr, accumulation by loss / K,
clipping) against train.py's own jitted step (make_optimizer, init_state and make_train_step on
sharding.py's mesh, as train.py uses them), from the same weights on the same batches: loss,
pre-clip grad norm and lr at every step, every parameter at the end.

    # tiny random GPT-2, fp32, 50 steps, offline
    python -m parity.check_train
    # each step's rows as 4 micro-batches (same tokens)
    python -m parity.check_train --accum 4
    # 8-way data parallel (fake CPU devices when needed)
    python -m parity.check_train --devices 8
    # sharded: 8 devices as fsdp 4 x tensor 2
    python -m parity.check_train --fsdp 4 --tensor_parallel 2
    # bf16 against the fp32 reference, next to torch autocast's
    python -m parity.check_train --dtype bfloat16
    # each setting of ours the same: --attention, --remat,
    python -m parity.check_train --remat block
    # --loss-chunk, --scan_layers (train.py's, same names)
    python -m parity.check_train --loss-chunk 8
    # gpt2-shaped random weights (124M; slow on a CPU)
    python -m parity.check_train --model gpt2 --steps 3
    python -m parity.check_train --model DIR              # any HF GPT-2 directory (save_pretrained)
    # golden run on the bundled data
    python -m parity.check_train --config shakespeare_char --steps 200

Exit code: 0 parity holds, 1 a tolerance is exceeded, 2 bad input.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

import numpy as np

from configurator import InputNotFound, UsageError, configure, exit_on_bad_input, require_extras
from dataloader import data_dir_for, data_meta, make_loader
from parity.common import (
    HF_SIZES,
    add_step_args,
    max_abs,
    pin_numerics,
    print_table,
    random_hf_model,
    verdict,
)

# jax, and our modules on it (model, settings, sharding, train_step, weights), are imported where
# they are used: bad arguments fail before jax loads, in a fraction of a second (parse_args)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# fp32 tolerances, judged at every step and, for the params, after the last (docs/parity.md's table
# has the figures measured over seeds, accumulation and devices: each well inside its bar)
LOSS_TOL = 1e-5  # |loss diff| / loss
GRAD_NORM_TOL = 1e-4  # |pre-clip grad norm diff| / grad norm
LR_TOL = 1e-6  # |lr diff| / lr (train_step.get_lr in float32, nanoGPT's in float64)
PARAM_NORM_TOL = 2e-4  # ||param diff|| / ||param|| per tensor group: the tight check of the params
# max |param diff| / max |param| per tensor group, a loose bar for gross errors: Adam steps an
# element whose first gradient is below its eps (1e-8) by lr * g / (|g| + eps), a size that rounding
# noise in g decides
PARAM_TOL = 1e-2
# bf16, against the fp32 reference: our errors at most BF16_FACTOR times PyTorch autocast's, in the
# mean over steps of |Δloss|/loss and |Δgnorm|/gnorm and the worst tensor group's
# ||Δparam||/||param||: training drifts more than a forward pass (check_logits allows 1.5x). The
# Linears' biases added in bf16, not float32 as model.py does, fail it.
BF16_JUDGED = ("mean_loss_rel", "mean_grad_norm_rel", "param_norm_rel")
BF16_FACTOR = 2.0

# The tiny run: nanoGPT's optimizer defaults (betas 0.9/0.95, weight decay 0.1, clip 1.0) at a
# learning rate that moves a tiny model far in 50 steps (and clips steps 3-10), the schedule
# squeezed into --steps.
TINY = dict(n_layer=2, n_head=2, n_embd=64, vocab_size=128, n_positions=64)
TINY_RUN = dict(rows=32, seq_len=32, learning_rate=1e-2, min_lr=1e-3)
# --model gpt2* / DIR: a few short rows, so that a CPU takes a step of 124M in seconds
LARGE_RUN = dict(rows=8, seq_len=64, learning_rate=6e-4, min_lr=6e-5)
# The golden run: config/train_<name>.py with nanoGPT's README overrides for a CPU ("I only have a
# macbook"), and bias=True (an HF GPT-2 always has biases; dropout is 0 there too: the frameworks
# draw different masks).
GOLDEN_OVERRIDES = [
    "--block_size=64",
    "--batch_size=12",
    "--n_layer=4",
    "--n_head=4",
    "--n_embd=128",
    "--max_iters=2000",
    "--lr_decay_iters=2000",
    "--dropout=0.0",
    "--bias=True",
]
# The key bias adds q.b_k to every attention score of a query, a shift softmax ignores: its gradient
# is 0 in exact arithmetic, so both sides move it only by rounding noise, which Adam divides by
# sqrt(v) ~ |noise| and turns into real steps, unrelated between the two sides. The loss cannot see
# them. Shown, not judged.
UNJUDGED = {"h.*.attn.c_attn.bias[k]"}


class Run(NamedTuple):
    """One check: train.py's settings `c` (optimizer, schedule, seed), the weights, the data, the
    batch layout."""

    c: dict
    model_dir: str  # an HF GPT-2 directory both sides load
    data_dir: str  # train.bin (or *train*.npy shards), read by train.py's loader
    steps: int
    rows: int  # sequences per step, over all micro-batches and devices
    seq_len: int
    accum: int  # micro-batches per step (torch: loss / accum, ours: lax.scan)
    devices: int  # our mesh's devices; torch computes the same global batch on one CPU
    fsdp: int = 1  # the mesh's fsdp axis (data = devices / (fsdp x tensor_parallel))
    tensor_parallel: int = 1


# --- the two sides
# ---------------------------------------------------------------------------------


class JaxTrainer:
    """train.py's optimizer, state and jitted step, in `dtype`, on sharding.py's mesh over
    run.devices: params and optimizer state from train_step.init_state (split by
    sharding.PARAM_SPECS), the batch's rows over data x fsdp."""

    def __init__(self, run, dtype):
        import jax

        import sharding
        import train_step
        from model import RUNTIME_FIELDS, GPTConfig
        from pretrained import read_pretrained

        c = dict(run.c, dtype=dtype)
        # a .pt of the record's: its heads
        config_args, state, _ = read_pretrained(run.model_dir, n_head=c["n_head"])
        config = GPTConfig(**config_args, **{k: c[k] for k in RUNTIME_FIELDS})
        mesh = sharding.make_mesh(run.fsdp, run.tensor_parallel, jax.devices()[: run.devices])
        sharding.check_model_fits_mesh(config, mesh)
        tx = train_step.make_optimizer(c)
        self.graphdef, params, opt_state = train_step.init_state(config, mesh, tx, weights=state)
        self.batch_sharding = sharding.batch_sharding(mesh)
        step = train_step.make_train_step(self.graphdef, tx, c["grad_clip"])
        batch_shape = (run.accum, run.rows // run.accum, run.seq_len)  # (accum, B, T)
        self.train_step, _, _ = train_step.compile_step(
            step, params, opt_state, batch_shape, self.batch_sharding
        )
        self.defs = jax.tree.structure(params), jax.tree.structure(opt_state)
        # as train.py's loop holds them
        self.state = jax.tree.leaves(params), jax.tree.leaves(opt_state)
        self.c, self.base_key, self.iter_num = c, jax.random.key(c["seed"]), 0

    def step(self, x, y):
        import jax

        import train_step

        # the lr of this update: train_step.get_lr at the optimizer's own schedule count
        lr = float(
            train_step.get_lr(
                train_step.schedule_count(self.defs[1].unflatten(self.state[1])), self.c
            )
        )
        key = jax.random.fold_in(self.base_key, self.iter_num)  # as train.py (dropout is 0: unused)
        # one process: device_put is train.py's make_array_from_process_local_data
        x, y = jax.device_put(x, self.batch_sharding), jax.device_put(y, self.batch_sharding)
        *self.state, metrics = self.train_step(*self.state, x, y, key)
        self.iter_num += 1
        return {"loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"]), "lr": lr}

    def state_dict(self):
        from flax import nnx

        from weights import state_dict

        return state_dict(nnx.merge(self.graphdef, self.defs[0].unflatten(self.state[0])))


def make_trainers(run, dtype):
    """{side: constructor}: torch fp32 (the reference), ours in `dtype`, and torch autocast-bf16 for
    bf16."""
    from parity.torch_reference import TorchTrainer

    sides = {
        "torch": lambda: TorchTrainer(run.model_dir, run.c),
        "jax": lambda: JaxTrainer(run, dtype),
    }
    if dtype == "bfloat16":
        sides["torch_bf16"] = lambda: TorchTrainer(run.model_dir, run.c, autocast_bf16=True)
    return sides


def train_side(trainer, batches):
    """{"records": [{"loss", "grad_norm", "lr"}] per step, "initial"/"final": {HF name: array},
    "ms": per step}."""
    initial = trainer.state_dict()
    records = [trainer.step(*batches[0])]  # ours compiles here
    t0 = time.time()
    records += [trainer.step(x, y) for x, y in batches[1:]]
    ms = (time.time() - t0) / max(len(batches) - 1, 1) * 1000
    return {"records": records, "initial": initial, "final": trainer.state_dict(), "ms": ms}


def make_batches(run):
    """run.steps batches (x, y), each (accum, rows / accum, T) int32, from train.py's loader: the
    tokens of a step depend on (seed, step) only, not on how its rows split into micro-batches or
    devices."""
    import jax

    if run.c["dropout"] != 0.0:
        raise UsageError(
            "training parity needs dropout 0: the two frameworks draw different dropout masks"
        )
    check_rows(run.rows, run.accum, run.devices, run.tensor_parallel)
    if run.devices > jax.device_count():
        raise UsageError(f"{run.devices} devices asked for, {jax.device_count()} here")
    loader = make_loader(
        run.data_dir,
        "train",
        run.seq_len,
        run.rows // run.accum,
        run.c["seed"],
        vocab_size=hf_vocab_size(run.model_dir),
    )
    return [loader.next(run.accum) for _ in range(run.steps)]


def check_rows(rows, accum, devices, tensor_parallel):
    shards = devices // tensor_parallel  # data x fsdp: the devices of a tensor group share rows
    if rows % (accum * shards):
        raise UsageError(
            f"{rows} rows per step do not split into --accum {accum} micro-batches over {shards} "
            "batch shards (data x fsdp): rows per step must be divisible by accum x data x fsdp"
        )


# --- the comparison
# ----------------------------------------------------------------------------------


def split_qkv(state):
    """c_attn's q, k and v columns as three tensors (...c_attn.weight[q] etc.): the key bias needs
    its own row."""
    out = {}
    for name, value in state.items():
        if ".attn.c_attn." in name:
            for part, v in zip("qkv", np.split(value, 3, axis=-1)):
                out[f"{name}[{part}]"] = v
        else:
            out[name] = value
    return out


def param_diffs(ref, test, initial):
    """{group: {"max": max |test - ref| / max |ref|, "norm": ||test - ref|| / ||ref||, "moved": max
    |ref - initial| / max |ref|, "decayed": bool}} per tensor group."""
    ref, test, initial = split_qkv(ref), split_qkv(test), split_qkv(initial)
    groups = {}
    # a group across layers: transformer.h.3.attn.c_proj.weight -> h.*.attn.c_proj.weight
    for name in ref:
        groups.setdefault(
            re.sub(r"^h\.\d+\.", "h.*.", name.removeprefix("transformer.")), []
        ).append(name)
    out = {}
    for group, names in groups.items():
        r, t, i = (
            np.concatenate([s[n].astype(np.float64).ravel() for n in names])
            for s in (ref, test, initial)
        )
        scale = np.max(np.abs(r))
        out[group] = {
            "max": np.max(np.abs(t - r)) / scale,
            "norm": np.linalg.norm(t - r) / np.linalg.norm(r),
            "moved": np.max(np.abs(r - i)) / scale,
            "decayed": ref[names[0]].ndim >= 2,
        }
    return out


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-30)


def shown_steps(steps):
    """Every step of a short run; every steps // 10 (every 20 of the 200-step golden run) of a long
    one."""
    stride = 1 if steps <= 50 else steps // 10
    return sorted(set(range(0, steps, stride)) | {steps - 1})


def side_figures(results, side):
    """(per step {"loss", "grad_norm", "lr"}: |side - ref| / ref, param_diffs, figures) of
    results[side] against the fp32 reference: the worst step's, the mean over steps and the worst
    judged tensor group's."""
    ref, ours = results["torch"]["records"], results[side]["records"]
    per_step = {
        k: [rel(o[k], r[k]) for r, o in zip(ref, ours)] for k in ("loss", "grad_norm", "lr")
    }
    diffs = param_diffs(
        results["torch"]["final"], results[side]["final"], results["torch"]["initial"]
    )
    judged = [d for group, d in diffs.items() if group not in UNJUDGED]
    figures = {
        "mean_loss_rel": float(np.mean(per_step["loss"])),
        "loss_rel": max(per_step["loss"]),
        "mean_grad_norm_rel": float(np.mean(per_step["grad_norm"])),
        "grad_norm_rel": max(per_step["grad_norm"]),
        "param_rel": float(max(d["max"] for d in judged)),
        "param_norm_rel": float(max(d["norm"] for d in judged)),
        "lr_rel": max(per_step["lr"]),
    }
    return per_step, diffs, figures


def report_fp32(run, results):
    ref, ours = results["torch"]["records"], results["jax"]["records"]
    per_step, diffs, figures = side_figures(results, "jax")
    clip = run.c["grad_clip"]
    print_table(
        [
            [
                str(i),
                ref[i]["lr"],
                ours[i]["lr"],
                f"{ref[i]['loss']:.6f}",
                f"{ours[i]['loss']:.6f}",
                per_step["loss"][i],
                f"{ref[i]['grad_norm']:.5f}",
                f"{ours[i]['grad_norm']:.5f}",
                per_step["grad_norm"][i],
                "yes" if ref[i]["grad_norm"] > clip > 0 else "",
            ]
            for i in shown_steps(run.steps)
        ],
        [
            "step",
            "lr torch",
            "lr jax",
            "loss torch",
            "loss jax",
            "|Δloss|/loss",
            "gnorm torch",
            "gnorm jax",
            "|Δgnorm|/gnorm",
            "clipped",
        ],
    )
    gaps = [abs(o["loss"] - r["loss"]) for r, o in zip(ref, ours)]
    names = {"loss": "|Δloss|/loss", "grad_norm": "|Δgnorm|/gnorm", "lr": "|Δlr|/lr"}
    print(
        f"max loss gap {max(gaps):.3g} (step {int(np.argmax(gaps))}); worst step: "
        + ", ".join(
            f"{names[k]} {max(v):.3g} (step {int(np.argmax(v))})" for k, v in per_step.items()
        )
    )
    print()
    print_table(
        [
            [
                g,
                "yes" if d["decayed"] else "no",
                d["moved"],
                d["max"],
                d["norm"],
                "no (zero gradient)" if g in UNJUDGED else "yes",
            ]
            for g, d in diffs.items()
        ],
        [
            f"params after {run.steps} steps",
            "decayed",
            "moved (rel)",
            "max |Δparam| (rel)",
            "||Δparam|| (rel)",
            "judged",
        ],
    )
    print(
        f"ms per step after the first: torch {results['torch']['ms']:.0f}, jax "
        f"{results['jax']['ms']:.0f}"
    )
    figures.update(
        loss_gap=max(gaps), losses=[o["loss"] for o in ours], ref_losses=[r["loss"] for r in ref]
    )
    ok = (
        figures["loss_rel"] <= LOSS_TOL
        and figures["grad_norm_rel"] <= GRAD_NORM_TOL
        and figures["lr_rel"] <= LR_TOL
        and figures["param_rel"] <= PARAM_TOL
        and figures["param_norm_rel"] <= PARAM_NORM_TOL
    )
    return verdict(
        ok,
        f"fp32 training parity (every step |Δloss|/loss <= {LOSS_TOL:g}, |Δgnorm|/gnorm <= "
        f"{GRAD_NORM_TOL:g}, |Δlr|/lr <= {LR_TOL:g}; params: max |Δ| <= {PARAM_TOL:g} of their "
        f"scale, ||Δ|| <= {PARAM_NORM_TOL:g} of their norm)",
    ), figures


def report_bf16(run, results):
    ref = results["torch"]["records"]
    sides = {"jax bf16": "jax", "torch autocast-bf16": "torch_bf16"}
    recs = [results[side]["records"] for side in sides.values()]
    print_table(
        [
            [str(i), ref[i]["lr"], f"{ref[i]['loss']:.5f}"]
            + [f"{r[i]['loss']:.5f}" for r in recs]
            + [f"{ref[i]['grad_norm']:.4f}"]
            + [f"{r[i]['grad_norm']:.4f}" for r in recs]
            for i in shown_steps(run.steps)
        ],
        [
            "step",
            "lr",
            "loss fp32",
            "loss jax bf16",
            "loss torch bf16",
            "gnorm fp32",
            "gnorm jax bf16",
            "gnorm torch bf16",
        ],
    )
    print()
    figures = {name: side_figures(results, side)[2] for name, side in sides.items()}
    keys = [
        "mean_loss_rel",
        "loss_rel",
        "mean_grad_norm_rel",
        "grad_norm_rel",
        "param_rel",
        "param_norm_rel",
    ]
    print_table(
        [[f"{name} vs torch fp32"] + [f[k] for k in keys] for name, f in figures.items()],
        [
            "",
            "mean |Δloss|/loss",
            "max",
            "mean |Δgnorm|/gnorm",
            "max",
            "max |Δparam| (rel)",
            "max ||Δparam|| (rel)",
        ],
    )
    print(
        f"ms per step after the first: torch fp32 {results['torch']['ms']:.0f}, torch bf16 "
        f"{results['torch_bf16']['ms']:.0f}, jax bf16 {results['jax']['ms']:.0f}"
    )
    ours, theirs = figures["jax bf16"], figures["torch autocast-bf16"]
    ok = all(ours[k] <= BF16_FACTOR * theirs[k] for k in BF16_JUDGED) and ours["lr_rel"] <= LR_TOL
    return verdict(
        ok,
        "bf16 training parity (our mean |Δloss|/loss, mean |Δgnorm|/gnorm and max ||Δparam|| "
        f"(rel) against the fp32 reference <= {BF16_FACTOR:g}x autocast's)",
    ), figures


def check(run, dtype="float32"):
    """Train both sides on the same batches; print the report; return (ok, figures)."""
    import jax

    pin_numerics()
    batches = make_batches(run)
    c = run.c
    print(
        f"{run.steps} steps of {run.rows} x {run.seq_len} tokens ({run.accum} micro-batch(es)), "
        f"{dtype}; torch on cpu, ours on {run.devices} {jax.devices()[0].platform} device(s) (fsdp "
        f"{run.fsdp}, tensor {run.tensor_parallel}; attention {c['attention']}, remat "
        f"{c['remat']}, loss_chunk {c['loss_chunk']}); data {run.data_dir}"
    )
    print(
        f"AdamW lr {c['learning_rate']:g} (warmup {c['warmup_iters']}, cosine to {c['min_lr']:g} "
        f"at {c['lr_decay_iters']}{'' if c['decay_lr'] else '; decay_lr off'}), betas "
        f"({c['beta1']}, {c['beta2']}), weight decay {c['weight_decay']:g} on >=2-D tensors, grad "
        f"clip {c['grad_clip']:g}"
    )
    results = {
        side: train_side(make(), batches) for side, make in make_trainers(run, dtype).items()
    }
    return report(run, results, dtype)


def report(run, results, dtype="float32"):
    """Print the comparison of the sides' results; (ok, figures)."""
    initial = results["torch"]["initial"]
    init_diff = max(max_abs(initial[k], results["jax"]["initial"][k]) for k in initial)
    print(f"initial weights: max |torch - jax| = {init_diff:g}")
    if init_diff != 0.0:
        return verdict(False, "identical initial weights"), {}
    return report_fp32(run, results) if dtype == "float32" else report_bf16(run, results)


def hf_vocab_size(model_dir):
    from weights import hf_directory, read_hf_config

    return read_hf_config(hf_directory(model_dir))["vocab_size"]


# --- the runs the CLI offers
# -----------------------------------------------------------------------


def write_tokens(path, vocab_size, n=200_000, seed=0):
    """A uint16 train.bin with something to learn: each token is the previous one plus 1, 2 or 3
    (mod vocab)."""
    rng = np.random.default_rng(seed)
    (np.cumsum(rng.integers(1, 4, n)) % vocab_size).astype(np.uint16).tofile(path)


def config_path(name):
    return name if name.endswith(".py") else os.path.join(REPO, "config", f"train_{name}.py")


def make_run(args, tmp):
    """The Run for the parsed arguments, with the model directory and data it needs written under
    tmp."""
    from settings import DEFAULTS

    model_dir = os.path.join(tmp, "model")
    if args.config:
        from flax import nnx

        from model import GPT, GPTConfig

        c = configure(DEFAULTS, [config_path(args.config), *GOLDEN_OVERRIDES])
        data_dir = os.path.abspath(data_dir_for(c["dataset"]))
        # as train.py: the setting, meta.pkl's, GPT-2's
        vocab_size = c["vocab_size"] or data_meta(data_dir)[0] or 50304
        config = GPTConfig(
            block_size=c["block_size"],
            vocab_size=vocab_size,
            n_layer=c["n_layer"],
            n_head=c["n_head"],
            n_embd=c["n_embd"],
            dropout=0.0,
            bias=True,
        )
        # train.py's init from scratch, ours -> torch
        GPT(config, nnx.Rngs(c["seed"])).save_pretrained(model_dir)
        rows, seq_len = c["batch_size"] * c["gradient_accumulation_steps"], c["block_size"]
    else:
        defaults = TINY_RUN if args.model == "tiny" else LARGE_RUN
        # nanoGPT's defaults, the schedule squeezed into the run: warmup for the first fifth of the
        # steps, cosine decay until four fifths, then min_lr
        c = dict(
            DEFAULTS,
            learning_rate=defaults["learning_rate"],
            min_lr=defaults["min_lr"],
            warmup_iters=max(args.steps // 5, 1),
            lr_decay_iters=max(args.steps * 4 // 5, 2),
            dropout=0.0,
            bias=True,
            seed=args.seed,
        )
        if args.model == "tiny" or args.model in HF_SIZES:
            shape = (
                dict(TINY, n_positions=max(TINY["n_positions"], args.seq_len or 0))
                if args.model == "tiny"
                else dict(HF_SIZES[args.model], vocab_size=50257, n_positions=1024)
            )
            # every tensor random, torch -> ours
            random_hf_model(args.seed, **shape).save_pretrained(model_dir)
        else:
            model_dir = args.model
        data_dir = os.path.join(tmp, "data")
        os.makedirs(data_dir)
        write_tokens(os.path.join(data_dir, "train.bin"), hf_vocab_size(model_dir), seed=args.seed)
        rows, seq_len = args.batch_size or defaults["rows"], args.seq_len or defaults["seq_len"]
    c.update(
        attention=args.attention,
        remat=args.remat,
        loss_chunk=args.loss_chunk,
        scan_layers=args.scan_layers,
    )
    if args.attention == "splash" and seq_len % 128:  # else XLA's attention would run in its place
        raise UsageError(
            f"--attention splash needs a --seq-len that is a multiple of 128, got {seq_len}"
        )
    return Run(
        c,
        model_dir,
        data_dir,
        args.steps,
        rows,
        seq_len,
        args.accum,
        args.devices,
        args.fsdp,
        args.tensor_parallel,
    )


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0].strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--steps", type=int, default=50)
    p.add_argument(
        "--model",
        default="tiny",
        help="tiny | gpt2 | gpt2-medium | ... (random weights) | HF directory",
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument(
        "--config",
        default=None,
        help="golden run: config/train_<name>.py (e.g. shakespeare_char) or a config file, "
        "on its data",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="rows per step, over all micro-batches and devices",
    )
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--seed", type=int, default=0, help="random weights and data (not --config's)")
    add_step_args(p)
    args = p.parse_args(argv)
    # bad input fails here, before anything heavy is imported or written
    args.devices = args.devices or args.fsdp * args.tensor_parallel
    if min(args.steps, args.accum, args.devices, args.fsdp, args.tensor_parallel) < 1:
        raise UsageError(
            "--steps, --accum, --devices, --fsdp and --tensor_parallel must be >= 1, got "
            f"{args.steps}, {args.accum}, {args.devices}, {args.fsdp}, {args.tensor_parallel}"
        )
    if args.devices % (args.fsdp * args.tensor_parallel):
        raise UsageError(
            f"--fsdp {args.fsdp} x --tensor_parallel {args.tensor_parallel} must divide --devices "
            f"{args.devices}"
        )
    if args.loss_chunk < 0:
        raise UsageError(f"--loss-chunk must be >= 0 (0: no chunks), got {args.loss_chunk}")
    if args.config:
        if args.model != "tiny" or args.batch_size or args.seq_len:
            raise UsageError(
                "--config sets the model, batch and sequence length: "
                "drop --model, --batch-size, --seq-len"
            )
        if not os.path.isfile(config_path(args.config)):
            raise InputNotFound(
                f"no config {config_path(args.config)} (--config takes a name under config/ "
                "without train_ and .py, or a config file)"
            )
    elif args.model != "tiny" and args.model not in HF_SIZES and not os.path.isdir(args.model):
        raise UsageError(
            f"--model takes tiny, a size ({', '.join(HF_SIZES)}) or an HF GPT-2 directory, "
            f"got {args.model!r}"
        )
    else:
        rows = args.batch_size or (TINY_RUN if args.model == "tiny" else LARGE_RUN)["rows"]
        check_rows(rows, args.accum, args.devices, args.tensor_parallel)
    return args


def rerun_with_fake_devices(argv, devices, have, module="parity.check_train"):
    """This check (`module`) again in a fresh python with `devices` fake CPU devices (XLA reads the
    flag when jax starts)."""
    if os.environ.get("CHECK_TRAIN_FAKE_DEVICES"):
        raise UsageError(f"--devices {devices}: only {have} device(s), even with fake CPU devices")
    flags = re.sub(
        r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")
    )
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "CHECK_TRAIN_FAKE_DEVICES": "1",
        "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={devices}".strip(),
        "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
    }
    print(
        f"--devices {devices} with {have} device(s) here: running on {devices} fake CPU devices",
        flush=True,
    )
    return subprocess.run([sys.executable, "-m", module, *argv], env=env).returncode


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    require_extras("parity")
    import jax

    import sharding

    sharding.start_backend()
    if args.devices > jax.device_count():
        return rerun_with_fake_devices(argv, args.devices, jax.device_count())
    pin_numerics()  # before anything is saved: no progress bars
    with tempfile.TemporaryDirectory() as tmp:
        ok, _ = check(make_run(args, tmp), args.dtype)
    return 0 if ok else 1


if __name__ == "__main__":
    exit_on_bad_input(main)
