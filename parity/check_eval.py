"""
lm-evaluation-harness parity: the same tasks through our JAX model (eval.py) and through lm-eval's
own hf model (transformers' GPT2LMHeadModel) on the same weights; per-request differences, then both
metric tables.

    # gpt2-shaped random weights, the local tasks
    python -m parity.check_eval --random-init
    python -m parity.check_eval --init_from=DIR --tasks=hellaswag_local --limit=10
    python -m parity.check_eval --init_from=resume --out_dir=out --dtype=bfloat16

init_from as eval.py's. Each side loads the weights by its own code: ours by eval.py's loader (what
is checked); lm-eval's hf model by transformers' from_pretrained, and our checkpoint or a nanoGPT
ckpt.pt through parity/torch_side.py (orbax's or torch's own reader, the name map written there),
saved for it by transformers' save_pretrained. The tasks are eval_tasks/'s (offline) unless
--include_path says otherwise; lm-eval's hub tasks need the network. fp32: every loglikelihood
within 1e-4 absolute, the same is_greedy flags and accuracies; rolling loglikelihoods within 1e-4
relative; generated text the same. bf16 (ours; the reference stays fp32): our mean |loglikelihood
error| at most BF16_FACTOR times that of transformers run in bf16, accuracies said. Exit code: 0
parity holds, 1 a tolerance is exceeded, 2 bad input.
"""

import argparse
import functools
import os
import tempfile

import numpy as np

from configurator import UsageError, exit_on_bad_input, require_extras
from parity import torch_side
from parity.common import HF_SIZES, pin_numerics, print_table, save_random_hf_model, verdict

LOGLIKELIHOOD_TOL = 1e-4  # absolute, per request
ROLLING_REL_TOL = 1e-4  # relative, per document
# as parity.check_logits: our bf16 error against fp32 at most this times transformers' bf16 error
BF16_FACTOR = 1.5
LOCAL_TASKS = "hellaswag_local,shakespeare_rolling,shakespeare_generate"
EVAL_TASKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "eval_tasks")


@functools.cache
def gpt2_tokenizer():
    """GPT-2's tokenizer for transformers, made offline once per process (the conversion takes
    seconds)."""
    from dataio.tokenizer import save_hf_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        return save_hf_tokenizer(tmp)


def hf_lm(path, batch_size, dtype, scratch):
    """lm-eval's own hf model on the HF directory `path`; where it lacks GPT-2's tokenizer files,
    they are written offline to the directory `scratch`."""
    from lm_eval.models.huggingface import HFLM

    tokenizer = path
    if not os.path.exists(os.path.join(path, "tokenizer.json")):
        tokenizer = os.path.join(scratch, "tokenizer")
        if not os.path.isdir(tokenizer):
            gpt2_tokenizer().save_pretrained(tokenizer)
    return HFLM(
        pretrained=path, tokenizer=tokenizer, device="cpu", batch_size=batch_size, dtype=dtype
    )


def reference_path(init_from, out_dir, scratch):
    """What lm-eval's hf model loads for `init_from`: a hub name or an HF directory as it is
    (transformers' from_pretrained reads it); our checkpoint (resume) or a nanoGPT ckpt.pt converted
    by parity/torch_side.py and written to `scratch` by transformers' save_pretrained."""
    if init_from != "resume" and torch_side.nanogpt_file(init_from) is None:
        return init_from
    path = os.path.join(scratch, "reference")
    torch_side.load(init_from, out_dir).save_pretrained(path)
    return path


def responses(results):
    """{task: [each document's responses: [(loglikelihood, is_greedy)] | [loglikelihood] |
    [text]]}"""
    return {
        task: [[r[0] for r in s["resps"]] for s in sorted(samples, key=lambda s: s["doc_id"])]
        for task, samples in results["samples"].items()
    }


def compare(ours, ref, kinds):
    """Rows of the per-task difference table, and whether fp32 parity holds."""
    rows, ok = [], True
    for task, kind in kinds.items():
        a, b = ours[task], ref[task]
        if kind == "generate_until":
            same = sum(x == y for da, db in zip(a, b) for x, y in zip(da, db))
            n, filled = sum(len(d) for d in b), sum(bool(x) for d in b for x in d)
            rows.append([task, kind, str(n), f"{same}/{n} texts equal, {filled} non-empty", ""])
            ok &= same == n
            for d, (da, db) in enumerate(zip(a, b)):
                if da != db:
                    print(f"  {task} doc {d}: ours {da!r} vs hf {db!r}")
        elif kind == "loglikelihood_rolling":
            x, y = (
                np.array([r for d in a for r in d], float),
                np.array([r for d in b for r in d], float),
            )
            rel = float(np.max(np.abs(x - y) / np.maximum(np.abs(y), 1e-30)))
            rows.append([task, kind, str(len(y)), f"max rel {rel:.2e}", ""])
            ok &= rel <= ROLLING_REL_TOL
        else:
            x, y = np.array([r[0] for d in a for r in d]), np.array([r[0] for d in b for r in d])
            gx, gy = [r[1] for d in a for r in d], [r[1] for d in b for r in d]
            flips = sum(p != q for p, q in zip(gx, gy))
            diff = float(np.max(np.abs(x - y)))
            rows.append(
                [task, kind, str(len(y)), f"max abs {diff:.2e}", f"{flips} is_greedy differ"]
            )
            ok &= diff <= LOGLIKELIHOOD_TOL and flips == 0
    return rows, ok


def mean_abs_errors(a, b, kinds):
    """The mean |loglikelihood difference| over the loglikelihood tasks' requests (rolling ones
    relative)."""
    errs = []
    for task, kind in kinds.items():
        if kind == "generate_until":
            continue
        x = np.array(
            [r[0] if isinstance(r, (list, tuple)) else r for d in a[task] for r in d], float
        )
        y = np.array(
            [r[0] if isinstance(r, (list, tuple)) else r for d in b[task] for r in d], float
        )
        errs.extend(np.abs(x - y) / (np.abs(y) if kind == "loglikelihood_rolling" else 1))
    return float(np.mean(errs)) if errs else 0.0


def metrics(results, tasks):
    """{(task, metric): value} of lm-eval's results, stderr left out."""
    return {
        (t, m.split(",")[0]): v
        for t in tasks
        for m, v in results["results"][t].items()
        if isinstance(v, float) and "stderr" not in m
    }


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0].strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--init_from",
        default=None,
        help="as eval.py's: resume | gpt2* | an HF directory | a ckpt.pt",
    )
    p.add_argument(
        "--random-init",
        action="store_true",
        help="gpt2-shaped random weights (every tensor), offline",
    )
    p.add_argument("--out_dir", default="out", help="for --init_from=resume")
    p.add_argument("--tasks", default=LOCAL_TASKS, help="lm-eval task names, comma-separated")
    p.add_argument("--include_path", default=EVAL_TASKS, help="a directory of local task YAMLs")
    p.add_argument("--limit", type=int, default=None, help="the first N documents of each task")
    p.add_argument("--num_fewshot", type=int, default=None)
    p.add_argument("--batch_size", type=int, default=8, help="requests per batch, both models")
    p.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="our compute dtype"
    )
    args = p.parse_args(argv)
    require_extras("eval")
    if (args.init_from is None) == (not args.random_init):
        raise UsageError("give one of --init_from=... or --random-init")
    if args.batch_size < 1:
        raise UsageError(f"--batch_size must be >= 1, got {args.batch_size}")

    import jax

    import eval as ours
    from compute import sharding
    from run.checkpoint import load_bpe_model
    from run.eval_lm import JaxLM

    tasks = args.tasks.split(",")
    manager = ours.task_manager(tasks, args.include_path)
    sharding.start_backend()  # libtpu's banner kept off the terminal where no TPU is
    pin_numerics()
    with tempfile.TemporaryDirectory() as tmp:
        source = args.init_from
        if args.random_init:
            source = save_random_hf_model(os.path.join(tmp, "model"), **HF_SIZES["gpt2"])
        model, _ = load_bpe_model(source, args.out_dir, args.dtype, ours.NOT_BPE)
        path = reference_path(source, args.out_dir, tmp)
        cfg = dict(
            ours.defaults,
            tasks=args.tasks,
            limit=args.limit,
            num_fewshot=args.num_fewshot,
            batch_size=args.batch_size,
            log_samples=True,
            bootstrap_iters=0,
        )
        print(f"== ours (JAX {args.dtype}, {jax.device_count()} device(s))")
        lm = JaxLM(model, sharding.make_mesh(), args.batch_size, cfg["seed"])
        mine = ours.evaluate(lm, cfg, manager)
        print("== lm-eval's hf model (transformers, float32)")
        ref = ours.evaluate(hf_lm(path, args.batch_size, "float32", tmp), cfg, manager)
        low = None
        if args.dtype == "bfloat16":
            print("== lm-eval's hf model (transformers, bfloat16)")
            low = ours.evaluate(hf_lm(path, args.batch_size, "bfloat16", tmp), cfg, manager)

    a, b = responses(mine), responses(ref)
    kinds = {t: ref["configs"][t]["output_type"] for t in b}
    print("\nper request, ours against lm-eval's hf model:")
    rows, ok = compare(a, b, kinds)
    print_table(rows, ["task", "output type", "requests", "difference", ""])
    m_ours, m_ref = metrics(mine, tasks), metrics(ref, tasks)
    print("\nmetrics:")
    print_table(
        [[t, m, f"{m_ours[t, m]:.6g}", f"{m_ref[t, m]:.6g}"] for t, m in m_ref],
        ["task", "metric", "ours", "hf"],
    )
    accuracies = [k for k in m_ref if k[1].startswith("acc") or k[1] == "exact_match"]
    if args.dtype == "float32":
        same = all(m_ours[k] == m_ref[k] for k in accuracies)
        return (
            0
            if verdict(
                ok and same, "fp32 parity (loglikelihoods, is_greedy, rolling, texts, accuracies)"
            )
            else 1
        )
    ours_err, hf_err = mean_abs_errors(a, b, kinds), mean_abs_errors(responses(low), b, kinds)
    m_low = metrics(low, tasks)
    for k in accuracies:
        print(
            f"{k[0]} {k[1]}: ours bf16 {m_ours[k]:.4f}, transformers bf16 {m_low[k]:.4f}, fp32 "
            f"{m_ref[k]:.4f}"
        )
    print(
        f"mean |loglikelihood error| against fp32: ours bf16 {ours_err:.3g}, transformers bf16 "
        f"{hf_err:.3g} (ratio {ours_err / max(hf_err, 1e-30):.2f}, at most {BF16_FACTOR})"
    )
    return 0 if verdict(ours_err <= BF16_FACTOR * hf_err, "bf16 parity") else 1


if __name__ == "__main__":
    exit_on_bad_input(main)
