"""
HellaSwag, completion style (build-nanogpt's scoring): each of the 4 endings is scored by the
model's loss on its tokens given the context; acc takes the lowest summed loss, acc_norm the lowest
mean loss per token.

    # val split, downloaded once to data/hellaswag/
    python hellaswag.py --init_from=gpt2
    python hellaswag.py --init_from=resume --out_dir=out     # our own checkpoint
    python hellaswag.py --init_from=DIR --path tests/fixtures/hellaswag_small.jsonl \
        --out preds.jsonl

The PyTorch reference (transformers' GPT2LMHeadModel, build-nanogpt's loop) is
parity/check_hellaswag.py. Reference numbers: docs/evaluation.md. (EleutherAI's harness scores
multiple-choice style: other numbers.)

From train.py: examples = hellaswag_data.load_examples(path, max_len=block_size) once (the jsonl
read, checked and rendered to tokens: dataio/hellaswag_data.py), then evaluate(model, examples,
mesh) -> Score(acc, acc_norm, count, results) at each eval. Exit code: 0 scored, 2 bad input.
"""

import argparse
import contextlib
import functools
import json
import os
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from compute import sharding
from compute.layers import cross_entropy_terms
from configurator import UsageError, exit_on_bad_input
from dataio import hellaswag_data, pretrained, tokenizer, weights
from dataio.tokenizer import GPT2_VOCAB
from run import checkpoint
from run.runlog import check_results_file, write_results

# right padding: causal attention keeps it out of every real position, and it is never scored
PAD = 0
# padded shapes, one compilation each: tokens per row (4 per octave: at most 25% padding) and ending
# tokens per row (2 per octave; they only size the logits)
# 32 .. 3584
LENGTH_BUCKETS = tuple(b * m for b in (8, 16, 32, 64, 128, 256, 512) for m in (4, 5, 6, 7))
# 16 .. 3072
ENDING_BUCKETS = tuple(b * m for b in (8, 16, 32, 64, 128, 256, 512, 1024) for m in (2, 3))


# ------------------------------------------------------------------------------------------------
# results


class ExampleResult(NamedTuple):
    line: int
    ind: int | None
    label: int
    sum_losses: list  # 4 floats: summed cross-entropy over each ending's tokens
    mean_losses: list  # 4 floats: the same divided by the ending's token count
    pred: int  # argmin of sum_losses
    pred_norm: int  # argmin of mean_losses

    def to_json(self):
        return json.dumps(
            {
                "line": self.line,
                "ind": self.ind,
                "label": self.label,
                "pred": self.pred,
                "pred_norm": self.pred_norm,
                "sum_losses": self.sum_losses,
                "mean_losses": self.mean_losses,
            }
        )


class Score(NamedTuple):
    acc: float  # fraction where the lowest summed loss is the label
    acc_norm: float  # fraction where the lowest mean loss is the label
    count: int
    results: list  # ExampleResult per example, in the input order


def check_vocab(vocab_size):
    """HellaSwag's text is GPT-2 BPE: a model must have a logit for each of its tokens."""
    if vocab_size < GPT2_VOCAB:
        raise UsageError(
            f"the model's vocab_size {vocab_size} does not cover GPT-2's {GPT2_VOCAB} BPE tokens"
        )


def make_result(r: hellaswag_data.Rendered, sum_losses, mean_losses):
    sum_losses, mean_losses = [float(x) for x in sum_losses], [float(x) for x in mean_losses]
    # ties go to the lower index, as torch's and numpy's argmin
    return ExampleResult(
        r.line,
        r.ind,
        r.label,
        sum_losses,
        mean_losses,
        int(np.argmin(sum_losses)),
        int(np.argmin(mean_losses)),
    )


def summarize(results):
    n = len(results)
    return Score(
        sum(x.pred == x.label for x in results) / n,
        sum(x.pred_norm == x.label for x in results) / n,
        n,
        results,
    )


# ------------------------------------------------------------------------------------------------
# JAX: batches of examples of similar length, padded to a few bucket shapes, sharded over a 'data'
# mesh


def bucket(n, buckets, cap):
    return min(next((b for b in buckets if b >= n), cap), cap)


class Batch(NamedTuple):
    """Host arrays for R = 4 * examples rows (numpy). Row r predicts its ending's j-th token from
    position pos[r, j]; only targets other than -1 are scored, so padding (tokens beyond a row's
    end, rows of filler examples, j beyond an ending's length) never reaches a loss."""

    tokens: np.ndarray  # (R, L) int32, right-padded with PAD
    pos: np.ndarray  # (R, E) int32 positions whose logits predict the ending tokens
    # (R, E) int32 the ending tokens, then -1 (ignored, as nanoGPT's ignore_index)
    targets: np.ndarray


def make_batch(examples, n_examples, L, E):
    """Pack `examples` (at most n_examples) into a Batch of n_examples * 4 rows; filler rows are all
    PAD."""
    R = 4 * n_examples
    tokens = np.full((R, L), PAD, np.int32)
    pos = np.zeros((R, E), np.int32)
    targets = np.full((R, E), -1, np.int32)
    for i, r in enumerate(examples):
        s = len(r.ctx)
        for j, end in enumerate(r.endings):
            row, n = 4 * i + j, len(end)
            tokens[row, :s] = r.ctx
            tokens[row, s : s + n] = end
            pos[row, :n] = np.arange(s - 1, s - 1 + n)  # the logits at t predict token t + 1
            targets[row, :n] = end
    return Batch(tokens, pos, targets)


def plan_batches(examples, batch_size, block_size, n_shards=1):
    """[(L, E, n, [example indices])]: the examples sorted by padded length, then cut into batches
    of n = batch_size * n_shards examples (batch_size per batch shard: data x fsdp), each padded to
    L tokens per row and E ending tokens; the last batch gets the next power of two per shard
    instead (few shapes, little padding)."""

    def shape(r):
        longest = max(len(e) for e in r.endings)
        return bucket(len(r.ctx) + longest, LENGTH_BUCKETS, block_size), longest

    order = sorted(range(len(examples)), key=lambda i: shape(examples[i]))
    plan = []
    for k in range(0, len(order), batch_size * n_shards):
        chunk = order[k : k + batch_size * n_shards]
        L, longest = max(shape(examples[i]) for i in chunk)
        per_shard = min(batch_size, 1 << (-(-len(chunk) // n_shards) - 1).bit_length())
        plan.append((L, bucket(longest, ENDING_BUCKETS, L), per_shard * n_shards, chunk))
    return plan


def ending_losses(model, tokens, pos, targets):
    """Summed cross-entropy of each row's ending tokens: (R,) float32. Logits are computed only at
    the positions that predict ending tokens (R, E, vocab), not over the whole (R, L, vocab)."""
    _, x = model.hidden_states(tokens)  # (R, L, C), after ln_f
    x = jnp.take_along_axis(x, pos[..., None], axis=1)  # (R, E, C)
    logits = model.logits(x)  # (R, E, vocab) float32
    # the model's loss, row by row: targets of -1 (beyond an ending's length) are ignored
    return jax.vmap(lambda z, y: cross_entropy_terms(z, y)[0])(logits, targets)  # (R,)


@functools.cache
def _jitted_ending_losses(mesh):
    """ending_losses compiled for `mesh`, once per batch shape; the (R,) result replicated, so every
    process can read it."""
    return nnx.jit(ending_losses, out_shardings=NamedSharding(mesh, P()))


def make_mesh(devices=None):
    """The scorer's mesh (compute/sharding.py's): train.py's mesh as it is, its params already in
    their shards; else a data-parallel one over `devices` (a list; default all)."""
    return devices if isinstance(devices, Mesh) else sharding.make_mesh(devices=devices)


def evaluate(model, examples, mesh=None, batch_size=8, progress=False):
    """Score rendered examples with an nnx GPT over `mesh` (see make_mesh: train.py's, a list of
    devices, or None for all devices): batch_size examples (4 rows each) per batch shard (data x
    fsdp) per batch, parameters split by sharding.PARAM_SPECS (the caller's model is left as it is).
    Returns Score(acc, acc_norm, count, results), results in the order of `examples`."""
    if not examples:
        raise UsageError("no examples to score")
    c = model.config
    check_vocab(c.vocab_size)
    longest = max(len(r.ctx) + max(len(e) for e in r.endings) for r in examples)
    if longest > c.block_size:
        raise UsageError(
            f"an example of {longest} tokens exceeds block_size {c.block_size}: "
            "render with max_len=block_size"
        )
    if batch_size < 1:
        raise UsageError(f"batch_size must be >= 1, got {batch_size}")
    mesh = make_mesh(mesh)
    graphdef, state = nnx.split(model)
    # no-op if in place
    model = nnx.merge(graphdef, jax.device_put(state, sharding.shardings_for(state, mesh)))
    score = _jitted_ending_losses(mesh)

    sums = np.zeros((len(examples), 4), np.float64)
    plan = plan_batches(examples, batch_size, c.block_size, sharding.batch_shards(mesh))
    # the model's sharding constraints apply where the scorer is traced under the mesh
    with (
        jax.set_mesh(mesh),
        tqdm(total=len(examples), unit="ex", desc="hellaswag", disable=not progress) as bar,
    ):
        # batch k + 1 is dispatched before batch k is read back: packing overlaps compute
        pending = None
        for item in plan + [None]:
            launched = None
            if item is not None:
                L, E, n, idx = item
                batch = make_batch([examples[i] for i in idx], n, L, E)
                launched = idx, score(model, *sharding.put_rows(batch, mesh))
            if pending is not None:
                idx, out = pending
                sums[idx] = np.asarray(out).reshape(-1, 4)[: len(idx)]
                bar.update(len(idx))
            pending = launched
    results = []
    for r, s in zip(examples, sums):
        n = np.array([len(e) for e in r.endings])
        results.append(make_result(r, s, s / n))
    return summarize(results)


# ------------------------------------------------------------------------------------------------
# the command line


NOT_BPE = "HellaSwag is scored in GPT-2's BPE"


def load_model(init_from, out_dir, dtype="float32"):
    """Our GPT of `init_from` (checkpoint.load_model's names); a character-level one is one line."""
    return checkpoint.load_bpe_model(init_from, out_dir, dtype, NOT_BPE)[0]


def check_bpe(init_from, out_dir, why):
    """checkpoint.load_bpe_model's refusal of a character-level model, before any download and any
    weights read (hellaswag.py's, eval.py's): told by what says the vocabulary (our checkpoint's
    meta, an HF directory's config.json, a nanoGPT ckpt.pt's model_args and dataset, a meta.json or
    meta.pkl beside them or in the dataset's folder). A hub name is GPT-2's; a model this cannot
    read is left to the load, which says what is wrong with it."""
    vocab = dataset = None
    beside = init_from if os.path.isdir(init_from) else os.path.dirname(init_from)
    if init_from == "resume":
        meta = checkpoint.restore(out_dir)["meta"]  # the JSON item alone: no array is read
        vocab_size, vocab = meta["model_args"]["vocab_size"], meta.get("vocab")
        dataset, beside = meta["config"].get("dataset"), None
    elif (pt := pretrained.nanogpt_checkpoint(init_from)) is not None:
        import torch

        try:  # mapped, not read: the tensors stay on disk
            ckpt = torch.load(pt, map_location="cpu", weights_only=True, mmap=True)
            vocab_size = ckpt["model_args"]["vocab_size"]
        # modded-nanogpt's state_step*.pt (GPT-2's BPE, no model_args), or no checkpoint at all
        except Exception:
            return
        dataset = (ckpt.get("config") or {}).get("dataset")
    elif os.path.isfile(os.path.join(init_from, "config.json")):  # an HF directory
        vocab_size = weights.read_hf_config(init_from).get("vocab_size", GPT2_VOCAB)
    else:
        return
    codec = tokenizer.codec_for(vocab_size, vocab, dataset, beside)
    checkpoint.refuse_char_level(codec, out_dir if init_from == "resume" else init_from, why)


def cli_parser(doc):
    """The options of a script that scores a model on HellaSwag (this one,
    parity/check_hellaswag.py)."""
    p = argparse.ArgumentParser(
        description=doc.split("\n\n")[0].strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--init_from",
        default="gpt2",
        help="resume (from --out_dir) | gpt2* | an HF GPT-2 directory | a nanoGPT ckpt.pt",
    )
    p.add_argument("--out_dir", default="out", help="checkpoint directory for --init_from=resume")
    p.add_argument(
        "--split", default="val", choices=["train", "val", "test"], help="which file to download"
    )
    p.add_argument("--path", default=None, help="a local HellaSwag jsonl (no download)")
    p.add_argument("--cache_dir", default=hellaswag_data.CACHE_DIR, help="where downloads go")
    p.add_argument("--limit", type=int, default=None, help="score only the first N examples")
    return p


def check_limit(limit):
    if limit is not None and limit < 1:
        raise UsageError(f"--limit must be >= 1, got {limit}")


def cli_examples(args):
    """(path, raw examples) that cli_parser's options name; bad data fails here, before a model is
    loaded."""
    check_limit(args.limit)
    path = args.path or hellaswag_data.download(args.split, args.cache_dir)
    return path, hellaswag_data.read_examples(path, args.limit)


def render_all(raw, block_size, path):
    return [hellaswag_data.render_example(ex, block_size, f"{path}:{ex['_line']}") for ex in raw]


def main(argv=None):
    p = cli_parser(__doc__)
    p.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype"
    )
    p.add_argument("--batch_size", type=int, default=8, help="examples per device per batch")
    p.add_argument(
        "--out", default=None, help="write per-example losses and predictions to this jsonl"
    )
    args = p.parse_args(argv)
    if args.batch_size < 1:
        raise UsageError(f"--batch_size must be >= 1, got {args.batch_size}")
    check_limit(args.limit)
    if args.out:
        check_results_file(args.out, "--out")
    sharding.use_compilation_cache()
    sharding.start_backend()
    # a character-level model is refused before the examples are downloaded
    check_bpe(args.init_from, args.out_dir, NOT_BPE)
    path, raw = cli_examples(args)
    t0 = time.time()
    model = load_model(args.init_from, args.out_dir, args.dtype)
    block_size = model.config.block_size
    examples = render_all(raw, block_size, path)
    truncated = sum(r.truncated > 0 for r in examples)
    print(
        f"model {args.init_from}: {model.num_params() / 1e6:.2f}M params, block_size {block_size}, "
        f"loaded in {time.time() - t0:.1f}s; "
        f"{len(examples)} examples from {path}"
        + (f", {truncated} with context cut to fit" if truncated else "")
        + f"; jax {args.dtype} on {jax.device_count()} {jax.devices()[0].platform} device(s)"
    )

    t0 = time.time()
    # fp32 matmuls in full fp32 on GPU/TPU too (their default is TF32 / bf16 passes), as the torch
    # reference
    precision = (
        jax.default_matmul_precision("highest")
        if args.dtype == "float32"
        else contextlib.nullcontext()
    )
    with precision:
        score = evaluate(model, examples, batch_size=args.batch_size, progress=True)
    dt = time.time() - t0
    print(
        f"hellaswag: acc {score.acc:.4f} acc_norm {score.acc_norm:.4f} count {score.count} "
        f"({dt:.1f}s, {score.count / dt:.1f} examples/s)"
    )
    if args.out:
        write_results(args.out, "".join(r.to_json() + "\n" for r in score.results), "--out")
    return 0


if __name__ == "__main__":
    exit_on_bad_input(main)
