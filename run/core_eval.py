"""
nanochat's CORE metric (the DCLM paper's 22 in-context-learning tasks, each accuracy centred on its
random baseline, then averaged) on any of our models, equal to nanochat's core_eval.py and
scripts/base_eval.py's evaluate_core: the same bundle, the same shuffle and few-shot draws, the same
prompts to the byte, the same token spans, the same crop, the same scoring. Only the batching
differs: nanochat runs one example at a time; here the rows of many examples are padded into a few
shapes and scored together on the mesh (right padding: causal attention keeps it out of every scored
position).

The bundle is a folder in nanochat's eval_bundle layout: core.yaml (icl_tasks: label,
dataset_uri, num_fewshot, icl_task_type, continuation_delimiter), eval_meta_data.csv (its
'Eval Task' and 'Random baseline' columns) and eval_data/<dataset_uri> (jsonl). The tokenizer is
anything with nanochat's interface (encode(text or list, prepend=id), get_bos_token_id());
GPT2Tokens is GPT-2's BPE in it. eval.py --tasks=core is the command; tests/test_core_eval.py
checks it against a torch scorer and nanochat's own code.
"""

import csv
import json
import os
import random
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from compute import sharding
from configurator import UsageError
from dataio.tokenizer import EOT, get_encoding

TASK_TYPES = ("multiple_choice", "schema", "language_modeling")
SHUFFLE_SEED = 1337  # evaluate_core's shuffle, before max_per_task keeps the first N
FEWSHOT_SEED = 1234  # evaluate_example's draw for item idx: Random(1234 + idx)
# padded shapes, one compilation each (hellaswag.py's): tokens per row, 4 per octave (at most 25%
# padding), 32 .. 7168; scored tokens per row, 2 per octave (they only size the logits), 16 .. 6144
LENGTH_BUCKETS = tuple(b * m for b in (8, 16, 32, 64, 128, 256, 512, 1024) for m in (4, 5, 6, 7))
SPAN_BUCKETS = tuple(b * m for b in (8, 16, 32, 64, 128, 256, 512, 1024, 2048) for m in (2, 3))


class GPT2Tokens:
    """GPT-2's BPE (tiktoken) with nanochat's tokenizer interface; <|endoftext|> is its BOS."""

    def __init__(self):
        self.enc = get_encoding()

    def get_bos_token_id(self):
        return EOT

    def encode(self, text, prepend=None):
        first = []
        if prepend is not None:
            first = [prepend if isinstance(prepend, int) else self.enc.encode_single_token(prepend)]
        if isinstance(text, str):
            return first + self.enc.encode_ordinary(text)
        return [first + ids for ids in self.enc.encode_ordinary_batch(list(text))]

    __call__ = encode


# ------------------------------------------------------------------------------------------------
# the bundle


class Task(NamedTuple):
    label: str
    task_type: str
    dataset_uri: str
    num_fewshot: int
    delimiter: str  # continuation_delimiter: between a context and its continuation
    random_baseline: float  # percent


def bundle_file(bundle, *parts):
    path = os.path.join(bundle, *parts)
    if not os.path.isfile(path):
        raise UsageError(
            f"{path} is missing: a CORE bundle is nanochat's eval_bundle folder (core.yaml, "
            "eval_meta_data.csv, eval_data/*.jsonl)"
        )
    return path


def read_tasks(bundle, labels=None):
    """core.yaml's tasks (those of `labels` only, in core.yaml's order, when given), each with its
    random baseline from eval_meta_data.csv."""
    if not os.path.isdir(bundle):
        raise UsageError(f"--core_bundle {bundle} is not a folder (nanochat's eval_bundle)")
    with open(bundle_file(bundle, "core.yaml"), encoding="utf-8") as f:
        listed = (yaml.safe_load(f) or {}).get("icl_tasks")
    if not listed:
        raise UsageError(f"{os.path.join(bundle, 'core.yaml')} lists no icl_tasks")
    baselines = {}
    with open(bundle_file(bundle, "eval_meta_data.csv"), encoding="utf-8") as f:
        for row in csv.DictReader(f):
            baselines[row["Eval Task"]] = float(row["Random baseline"])
    known = [t["label"] for t in listed]
    unknown = [label for label in labels or () if label not in known]
    if unknown:
        raise UsageError(
            f"unknown CORE task {unknown[0]!r}: {os.path.join(bundle, 'core.yaml')} has "
            + ", ".join(known)
        )
    tasks = []
    for t in listed:
        if labels and t["label"] not in labels:
            continue
        if t["icl_task_type"] not in TASK_TYPES:
            raise UsageError(
                f"task {t['label']}: icl_task_type {t['icl_task_type']!r} is not one of "
                + ", ".join(TASK_TYPES)
            )
        if t["label"] not in baselines:
            raise UsageError(f"task {t['label']} has no row in {bundle}/eval_meta_data.csv")
        tasks.append(
            Task(
                t["label"],
                t["icl_task_type"],
                t["dataset_uri"],
                t["num_fewshot"][0],  # a list in core.yaml; nanochat takes the first
                t.get("continuation_delimiter", " "),
                baselines[t["label"]],
            )
        )
    return tasks


def read_items(bundle, task, max_per_task=-1):
    """The task's jsonl, shuffled with Random(1337), the first max_per_task kept (all if < 1)."""
    with open(bundle_file(bundle, "eval_data", task.dataset_uri), encoding="utf-8") as f:
        items = [json.loads(line.strip()) for line in f]
    random.Random(SHUFFLE_SEED).shuffle(items)
    return items[:max_per_task] if max_per_task > 0 else items


# ------------------------------------------------------------------------------------------------
# prompts and the tokens each choice is scored on


def fewshot_examples(items, idx, k):
    """Item idx's k shots: Random(1234 + idx) samples them from every other item."""
    if k <= 0:
        return []
    others = [i for i in range(len(items)) if i != idx]
    return [items[i] for i in random.Random(FEWSHOT_SEED + idx).sample(others, k)]


def render_prompts(task_type, item, delimiter, shots):
    """The prompts nanochat's jinja templates render, one per choice (multiple_choice: each choice
    after the query; schema: each context before the continuation) or, for language_modeling, the
    prompt without and with the continuation. Each shot is an answered example and a blank line."""
    d = delimiter
    if task_type == "multiple_choice":
        head = "".join(f"{s['query']}{d}{s['choices'][s['gold']]}\n\n" for s in shots)
        return [f"{head}{item['query']}{d}{choice}" for choice in item["choices"]]
    if task_type == "schema":
        head = "".join(
            f"{s['context_options'][s['gold']]}{d}{s['continuation']}\n\n" for s in shots
        )
        return [f"{head}{option}{d}{item['continuation']}" for option in item["context_options"]]
    # contexts trimmed (some datasets keep trailing whitespace); the prompt without the continuation
    # stripped too, so that its tokens are a prefix of the one with it
    head = "".join(f"{str(s['context']).strip()}{d}{s['continuation']}\n\n" for s in shots)
    without = f"{head}{str(item['context']).strip()}{d}"
    return [without.strip(), without + str(item["continuation"])]


def common_length(rows, from_end=False):
    """How many tokens all rows share at their start (at their end with from_end)."""
    n = min(len(r) for r in rows)
    for i in range(n):
        at = -1 - i if from_end else i
        if any(r[at] != rows[0][at] for r in rows):
            return i
    return n


def token_rows(tokenizer, task_type, prompts):
    """(tokens, starts, ends) of each prompt, BOS first: tokens[start:end] are what is scored.
    multiple_choice: after the choices' common prefix; schema: the common suffix; language_modeling:
    one row, the tokens past the prompt without the continuation."""
    tokens = tokenizer.encode(prompts, prepend=tokenizer.get_bos_token_id())
    ends = [len(t) for t in tokens]
    if task_type == "multiple_choice":
        return tokens, [common_length(tokens)] * len(tokens), ends
    if task_type == "schema":
        suffix = common_length(tokens, from_end=True)
        return tokens, [e - suffix for e in ends], ends
    without, whole = tokens
    if not (len(without) < len(whole) and whole[: len(without)] == without):
        raise UsageError(
            f"the prompt without its continuation is not a token prefix of the one with it: "
            f"{prompts[0][-40:]!r} / {prompts[1][-60:]!r}"
        )
    return [whole], [len(without)], [len(whole)]


def crop(tokens, starts, ends, max_len):
    """Rows longer than max_len lose tokens from the left, their spans shifted with them."""
    out = ([], [], [])
    for t, s, e in zip(tokens, starts, ends):
        cut = max(len(t) - max_len, 0)
        if s - cut < 1:  # the token before the continuation predicts its first
            raise UsageError(
                f"a continuation of {e - s} tokens does not fit in the model's {max_len}"
            )
        for column, value in zip(out, (t[cut:], s - cut, e - cut)):
            column.append(value)
    return out


class Example(NamedTuple):
    prompts: list  # rendered
    tokens: list  # a row of ids per choice (language_modeling: one), cropped
    starts: list  # each row's scored tokens are tokens[start:end]
    ends: list
    gold: int | None  # the right choice (language_modeling: None)


def prepare(tokenizer, task, items, max_len):
    """Every item of the task as an Example: shots drawn, prompts rendered, tokens and spans."""
    examples = []
    for idx, item in enumerate(items):
        shots = fewshot_examples(items, idx, task.num_fewshot)
        prompts = render_prompts(task.task_type, item, task.delimiter, shots)
        rows = crop(*token_rows(tokenizer, task.task_type, prompts), max_len)
        examples.append(Example(prompts, *rows, item.get("gold")))
    return examples


# ------------------------------------------------------------------------------------------------
# scoring on the mesh


def span_scores(model, tokens, pos, targets):
    """tokens (R, L); the logits at pos (R, E) predict targets (R, E) (-1: padding) -> (the mean
    cross-entropy of each row's targets (R,), whether each is its logits' argmax (R,)). Logits
    exist only at the scored positions."""
    _, x = model.hidden_states(tokens)  # (R, L, C), after the final norm
    x = jnp.take_along_axis(x, pos[..., None], axis=1)  # (R, E, C)
    logits = model.logits(x).astype(jnp.float32)  # (R, E, vocab)
    valid = targets >= 0
    t = jnp.where(valid, targets, 0)
    picked = jnp.take_along_axis(logits, t[..., None], axis=-1)[..., 0]
    losses = jax.nn.logsumexp(logits, axis=-1) - picked  # (R, E)
    mean = jnp.sum(jnp.where(valid, losses, 0.0), axis=-1) / jnp.sum(valid, axis=-1)
    greedy = jnp.all((jnp.argmax(logits, axis=-1) == t) | ~valid, axis=-1)
    return mean, greedy


def bucket(n, buckets, cap):
    """The least of `buckets` that holds n, at most cap (n itself past the last)."""
    return min(next((b for b in buckets if b >= n), n), max(cap, n))


class Scorer:
    """A model on a mesh, scoring rows of token ids: batch_size rows per batch shard per call. Rows
    are cropped to max_len (default block_size; nanochat crops to a model's max_seq_len, if any)."""

    def __init__(self, model, mesh=None, batch_size=8, pad_id=EOT, max_len=None):
        self.mesh = sharding.make_mesh() if mesh is None else mesh
        graphdef, state = nnx.split(model)
        state = jax.device_put(state, sharding.shardings_for(state, self.mesh))
        self.model, self.config = nnx.merge(graphdef, state), model.config
        self.max_len = max_len or model.config.block_size
        self.rows = batch_size * sharding.batch_shards(self.mesh)
        self.pad_id = pad_id  # nanochat pads with BOS; never scored
        self.shapes = set()  # every compiled (rows, L, E)
        self._score = nnx.jit(span_scores, out_shardings=NamedSharding(self.mesh, P()))

    def score(self, rows):
        """rows: (tokens, start, end) -> (mean loss over tokens[start:end] given what precedes
        them, whether every one of them is the argmax) per row, as numpy arrays."""
        mean, greedy = np.zeros(len(rows), np.float32), np.zeros(len(rows), bool)
        order = sorted(range(len(rows)), key=lambda i: len(rows[i][0]))
        with jax.set_mesh(self.mesh):
            for k in range(0, len(order), self.rows):
                idx = order[k : k + self.rows]
                L = bucket(len(rows[idx[-1]][0]), LENGTH_BUCKETS, self.max_len)
                E = bucket(max(rows[i][2] - rows[i][1] for i in idx), SPAN_BUCKETS, L)
                tokens = np.full((self.rows, L), self.pad_id, np.int32)
                pos = np.zeros((self.rows, E), np.int32)
                targets = np.full((self.rows, E), -1, np.int32)
                targets[len(idx) :, 0] = 0  # filler rows: one target, no 0 / 0
                for r, i in enumerate(idx):
                    t, s, e = rows[i]
                    tokens[r, : len(t)] = t
                    pos[r, : e - s] = np.arange(s - 1, e - 1)  # the logits at p predict p + 1
                    targets[r, : e - s] = t[s:e]
                self.shapes.add((self.rows, L, E))
                m, g = self._score(
                    self.model, *sharding.put_rows([tokens, pos, targets], self.mesh)
                )
                mean[idx], greedy[idx] = np.asarray(m)[: len(idx)], np.asarray(g)[: len(idx)]
        return mean, greedy


class TaskResult(NamedTuple):
    accuracy: float
    correct: list  # per example
    chosen: list  # per example: the choice of lowest mean loss (language_modeling: None)
    losses: list  # per example: each choice's mean loss (language_modeling: [])


def evaluate_task(scorer, tokenizer, task, items):
    """One task's accuracy: multiple_choice and schema pick the choice of lowest mean loss over its
    scored tokens; language_modeling is right when every continuation token is the argmax."""
    examples = prepare(tokenizer, task, items, scorer.max_len)
    rows = [(t, s, e) for ex in examples for t, s, e in zip(ex.tokens, ex.starts, ex.ends)]
    mean, greedy = scorer.score(rows)
    correct, chosen, losses, at = [], [], [], 0
    for ex in examples:
        n = len(ex.tokens)
        if task.task_type == "language_modeling":
            correct.append(bool(greedy[at]))
            chosen.append(None)
            losses.append([])
        else:
            ls = [float(v) for v in mean[at : at + n]]
            chosen.append(ls.index(min(ls)))  # the first of equals, as nanochat's
            correct.append(chosen[-1] == ex.gold)
            losses.append(ls)
        at += n
    return TaskResult(sum(correct) / len(correct), correct, chosen, losses)


def centred(accuracy, random_baseline):
    """The accuracy rescaled so that chance (random_baseline, percent) is 0 and perfect is 1."""
    return (accuracy - 0.01 * random_baseline) / (1.0 - 0.01 * random_baseline)


def evaluate_core(scorer, tokenizer, bundle, max_per_task=-1, labels=None, out=None):
    """Every task of the bundle (or of `labels`), a line each on `out` as nanochat prints it ->
    {results, centered_results, core_metric, tasks}, nanochat's keys, and each task's settings."""
    out = out or sys.stdout
    tasks = read_tasks(bundle, labels)
    for task in tasks:  # a missing file is one line before any scoring
        bundle_file(bundle, "eval_data", task.dataset_uri)
    report = {"results": {}, "centered_results": {}, "core_metric": None, "tasks": {}}
    for task in tasks:
        t0 = time.time()
        print(
            f"Evaluating: {task.label} ({task.num_fewshot}-shot, type: {task.task_type})... ",
            end="",
            file=out,
            flush=True,
        )
        items = read_items(bundle, task, max_per_task)
        result = evaluate_task(scorer, tokenizer, task, items)
        report["results"][task.label] = result.accuracy
        report["centered_results"][task.label] = c = centred(result.accuracy, task.random_baseline)
        report["tasks"][task.label] = {**task._asdict(), "examples": len(items)}
        print(
            f"accuracy: {result.accuracy:.4f} | centered: {c:.4f} | time: {time.time() - t0:.2f}s",
            file=out,
            flush=True,
        )
    centred_all = report["centered_results"].values()
    report["core_metric"] = sum(centred_all) / len(centred_all)
    return report


def results_table(report):
    """The results as nanochat's base_eval writes its CSV: a row per task, then CORE."""
    lines = [f"{'Task':<35}, {'Accuracy':<10}, {'Centered':<10}"]
    for label, accuracy in report["results"].items():
        lines.append(f"{label:<35}, {accuracy:<10.6f}, {report['centered_results'][label]:<10.6f}")
    lines.append(f"{'CORE':<35}, {'':<10}, {report['core_metric']:<10.6f}")
    return "\n".join(lines)
