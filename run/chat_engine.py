"""
nanochat's engine (karpathy/nanochat, nanochat/engine.py; its torch side in
parity/nanochat_engine_reference.py) over any of our models: a prompt's tokens prefilled into a KV
cache once, with one row, then `num_samples` rows sampled from copies of that cache, each row
stopped by <|assistant_end|>, <|bos|> or max_tokens, and the Python tool: a row that writes
<|python_start|> expression <|python_end|> gets the calculator's result (run/sandbox.py, in a
process of its own) forced back as <|output_start|> result <|output_end|>, those tokens fed to the
model and marked forced (mask 0) as nanochat's RowState marks them. `generate` yields each step's
column of tokens and masks (for streaming), `generate_batch` returns every row's tokens and masks.

The model's work is jitted with fixed shapes: a cache of the model's block_size (rounded up to whole
prefill chunks), the prompt prefilled in chunks (compute/generate.py's), then one token per step for
every row at once; a new prompt or a new step compiles nothing. The rows' bookkeeping (the tool,
forced tokens, stops) is Python between steps, as nanochat's.
"""

import functools
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from compute import sharding
from compute.generate import PREFILL_CHUNK, check_sampling, filter_logits
from configurator import UsageError
from dataio.chat_tokenizer import ChatTokenizer
from run.checkpoint import load_checkpoint_model, load_model, load_with_codec
from run.sandbox import calculator
from run.settings import resolve_dtype

# the special tokens of the tool's state machine (nanochat's names)
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
OUTPUT_START, OUTPUT_END = "<|output_start|>", "<|output_end|>"
ASSISTANT_END = "<|assistant_end|>"  # ends a row, as BOS does


@dataclass
class Row:
    """One row's state between steps (nanochat's RowState)."""

    tokens: list  # the prompt and every token since
    forced: list = field(default_factory=list)  # the tool's tokens still to feed, first first
    in_python: bool = False  # inside <|python_start|> ... <|python_end|>
    expression: list = field(default_factory=list)  # the tokens written there so far
    completed: bool = False  # it wrote <|assistant_end|> or <|bos|>


class Engine:
    """nanochat's Engine: `model` any of ours (init_cache, decode, logits), `tokenizer` nanochat's
    interface (encode, decode, encode_special, get_bos_token_id: dataio/chat_tokenizer.py's),
    `tool(expression) -> text or None` the calculator (run.sandbox.calculator)."""

    def __init__(self, model, tokenizer, tool=calculator):
        self.model, self.tokenizer, self.tool = model, tokenizer, tool
        # compiled for this model's structure (its GPTConfig is no hashable static argument); its
        # params go in at each call, so weights that change between calls (RL) are the ones used
        graphdef = nnx.graphdef(model)
        # static: the rows, the prefill chunk, and (greedy, top_k); the temperature is an input, so
        # a page's requests at any temperature share one program
        self.first_tokens = jax.jit(
            functools.partial(first_tokens, graphdef), static_argnums=(4, 5, 7)
        )
        self.next_tokens = jax.jit(
            functools.partial(next_tokens, graphdef), static_argnums=(7,), donate_argnums=(1,)
        )

    def generate(
        self, tokens, num_samples=1, max_tokens=None, temperature=1.0, top_k=None, seed=42
    ):
        """Yield (tokens, masks) per step, each a list of num_samples ints: the token each row
        takes next and whether it was sampled (1) or forced by the tool (0). Stops when every row
        has written <|assistant_end|> or <|bos|>, after max_tokens steps (None: as many as the
        context holds), or when the context is full (block_size tokens fed). Rows that have ended
        go on being sampled, their tool run, until then, as nanochat's (generate_batch drops those
        tokens). Each num_samples compiles its own steps.
        temperature 0 is greedy (argmax); otherwise `seed` drives jax.random (same seed, same
        tokens here, but not nanochat's torch.Generator's tokens). top_k None or 0: no top-k."""
        prompt = self.check(tokens, num_samples, max_tokens, temperature, top_k)
        special = self.tokenizer.encode_special
        ends = {special(ASSISTANT_END), self.tokenizer.get_bos_token_id()}
        markers = tuple(special(s) for s in (PYTHON_START, PYTHON_END, OUTPUT_START, OUTPUT_END))
        P, bs = len(prompt), self.model.config.block_size
        steps = bs - P + 1  # the last token sampled sees the whole context; none is fed after it
        steps = steps if max_tokens is None else min(max_tokens, steps)
        sampling = (temperature == 0, top_k or None)
        temperature = jnp.float32(temperature or 1.0)  # unused when greedy
        state = nnx.state(self.model)
        chunk = min(PREFILL_CHUNK, bs)
        length = -(-bs // chunk) * chunk  # whole chunks: no prefill write is clipped
        buf = np.zeros((1, length), np.int32)
        buf[0, :P] = prompt
        key = jax.random.key(seed)
        sampled, cache = self.first_tokens(
            state, jnp.asarray(buf), jnp.int32(P), key, num_samples, chunk, temperature, sampling
        )
        rows = [Row(list(prompt)) for _ in range(num_samples)]
        column = []  # the tokens the rows took last step
        for n in range(steps):
            if all(row.completed for row in rows):
                return
            if n:  # feed the last column at position P + n - 1, sample position P + n
                fed = jnp.asarray(column, jnp.int32)
                sampled, cache = self.next_tokens(
                    state, cache, fed, P + n - 1, key, n, temperature, sampling
                )
            column, masks = self.advance(rows, np.asarray(sampled).tolist(), ends, markers)
            yield column, masks

    def advance(self, rows, sampled, ends, markers):
        """Each row's next token (its forced one, else the sampled one) through nanochat's state
        machine -> (tokens, masks). Expressions closed this step go to the tool together, each
        result queued as <|output_start|> result <|output_end|>."""
        python_start, python_end, output_start, output_end = markers
        column, masks, calls = [], [], []
        for row, token in zip(rows, sampled):
            forced = bool(row.forced)
            token = row.forced.pop(0) if forced else token
            column.append(token)
            masks.append(0 if forced else 1)
            row.tokens.append(token)
            row.completed |= token in ends
            if token == python_start:
                row.in_python, row.expression = True, []
            elif token == python_end and row.in_python:
                row.in_python = False
                if row.expression:
                    calls.append((row, self.tokenizer.decode(row.expression)))
                row.expression = []
            elif row.in_python:
                row.expression.append(token)
        if not calls:
            return column, masks
        # each call is a process start (~0.1 s): a step's calls run side by side
        with ThreadPoolExecutor(len(calls)) as pool:
            results = list(pool.map(self.tool, [expression for _, expression in calls]))
        for (row, _), result in zip(calls, results):
            if result is not None:
                row.forced += [output_start, *self.tokenizer.encode(str(result)), output_end]
        return column, masks

    def generate_batch(self, tokens, num_samples=1, **settings):
        """(results, masks): each row's prompt and the tokens it took, the terminal
        <|assistant_end|> or <|bos|> left out, and its masks (0 on the prompt and the forced
        tokens), as nanochat's generate_batch."""
        ends = {self.tokenizer.encode_special(ASSISTANT_END), self.tokenizer.get_bos_token_id()}
        results = [list(tokens) for _ in range(num_samples)]
        masks = [[0] * len(tokens) for _ in range(num_samples)]
        completed = [False] * num_samples
        for column, column_masks in self.generate(tokens, num_samples, **settings):
            for i, (token, mask) in enumerate(zip(column, column_masks)):
                if completed[i]:
                    continue
                if token in ends:
                    completed[i] = True
                else:
                    results[i].append(token)
                    masks[i].append(mask)
            if all(completed):
                break
        return results, masks

    def check(self, tokens, num_samples, max_tokens, temperature, top_k):
        """The prompt as a list of ints, or one line (a UsageError) naming the fix."""
        c = self.model.config
        if not isinstance(tokens, (list, tuple, np.ndarray)) or not all(
            isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in tokens
        ):
            raise UsageError("the prompt is a list of token ids (ints): the tokenizer's encode")
        prompt = [int(t) for t in tokens]
        if not prompt:
            raise UsageError(
                "an empty prompt: give at least one token (a conversation rendered by "
                "render_for_completion, or [bos])"
            )
        if len(prompt) > c.block_size:
            raise UsageError(
                f"a prompt of {len(prompt)} tokens is longer than the model's context "
                f"({c.block_size}): shorten it, or start a new conversation"
            )
        if min(prompt) < 0 or max(prompt) >= c.vocab_size:
            raise UsageError(
                f"prompt token ids must be in [0, {c.vocab_size}) (the model's vocabulary), got "
                f"{min(prompt)}..{max(prompt)}: a tokenizer of another vocabulary?"
            )
        if not (isinstance(num_samples, int) and num_samples >= 1):
            raise UsageError(f"num_samples must be an integer >= 1, got {num_samples!r}")
        if max_tokens is not None and not (isinstance(max_tokens, int) and max_tokens >= 0):
            raise UsageError(f"max_tokens must be an integer >= 0 or None, got {max_tokens!r}")
        check_sampling(temperature, top_k or None, None)
        return prompt


def sample(logits, key, temperature, sampling):
    """(B, V) logits -> (B,) int32 tokens: argmax when greedy (temperature 0), else drawn from
    softmax(logits / temperature) over the top_k (nanochat's sample_next_token's distribution;
    filter_logits keeps ties with the k-th, where torch.topk keeps k). sampling: (greedy, top_k)."""
    greedy, top_k = sampling
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, filter_logits(logits, temperature, top_k)).astype(jnp.int32)


def copied_rows(model, cache, rows, length):
    """The batch-1 cache as `rows` rows (nanochat's KVCache.prefill), in any model's layout: each
    leaf tiled along the axis where init_cache's shapes for 1 and for `rows` rows differ (nanochat's
    (B, S, ...) or GPT-2's (B * heads, S, hs), batch-major)."""
    wide = jax.eval_shape(lambda: model.init_cache(rows, length))
    return jax.tree.map(
        lambda a, w: jnp.tile(a, [n // m for n, m in zip(w.shape, a.shape)]), cache, wide
    )


def first_tokens(graphdef, state, buf, prompt_len, key, rows, chunk, temperature, sampling):
    """buf (1, S): the prompt in buf[:, :prompt_len] -> (the first token of each of `rows` rows,
    sampled from the prompt's last logits, and the cache holding the prompt in every row)."""
    model = nnx.merge(graphdef, state)
    S = buf.shape[1]
    cache = model.init_cache(1, S)

    def prefill(j, cache):
        piece = jax.lax.dynamic_slice_in_dim(buf, j * chunk, chunk, axis=1)
        return model.decode(piece, cache, j * chunk)[1]

    # every prompt token but the last in chunks, then the last alone: its logits come out
    cache = jax.lax.fori_loop(0, (prompt_len - 1 + chunk - 1) // chunk, prefill, cache)
    last = jax.lax.dynamic_slice_in_dim(buf, prompt_len - 1, 1, axis=1)  # (1, 1)
    x, cache = model.decode(last, cache, prompt_len - 1)
    V = model.config.vocab_size  # a padded head's extra ids are no tokens
    logits = jnp.broadcast_to(model.logits(x[:, 0])[:, :V], (rows, V))
    tokens = sample(logits, jax.random.fold_in(key, 0), temperature, sampling)
    return tokens, copied_rows(model, cache, rows, S)


def next_tokens(graphdef, state, cache, column, pos, key, step, temperature, sampling):
    """column (B,): each row's last token, fed at `pos` -> (each row's next token, the cache)."""
    model = nnx.merge(graphdef, state)
    x, cache = model.decode(column[:, None], cache, pos)
    logits = model.logits(x[:, 0])[:, : model.config.vocab_size]
    return sample(logits, jax.random.fold_in(key, step), temperature, sampling), cache


def load_chat_model(init_from, out_dir, tokenizer_dir, dtype):
    """(model, ChatTokenizer) for chat_cli.py and chat_eval.py: the weights of init_from ('resume':
    out_dir's run; else a nanochat checkpoint directory) and nanochat's tokenizer: tokenizer_dir's,
    else the checkpoint's (beside it or up to two folders up); a model without one is one line."""
    if tokenizer_dir:
        if init_from == "resume":
            model, _ = load_checkpoint_model(out_dir, dtype=dtype)
        else:
            model, _ = load_model(init_from, dtype=dtype)
        tokenizer = ChatTokenizer.from_directory(tokenizer_dir)
    else:
        model, codec, _ = load_with_codec(init_from, out_dir, dtype)
        if not isinstance(codec, ChatTokenizer):
            where = out_dir if init_from == "resume" else init_from
            raise UsageError(
                f"{where} has no nanochat tokenizer beside it (a chat renders conversations with "
                "its special tokens): give --tokenizer=DIR, the folder of the tokenizer.pkl it was "
                "trained with"
            )
        tokenizer = ChatTokenizer(codec.enc)
    if tokenizer.n_vocab > model.config.vocab_size:
        raise UsageError(
            f"the tokenizer has {tokenizer.n_vocab} ids, the model {model.config.vocab_size}: "
            "give the tokenizer the model was trained with"
        )
    return model, tokenizer


def start_chat_model(cfg, also=""):
    """load_chat_model of a chat script's settings (init_from, out_dir, tokenizer, dtype) on this
    machine's backend, its compilation cache on; one summary line on stderr (and `also`)."""
    sharding.use_compilation_cache()
    sharding.start_backend()
    dtype = resolve_dtype(cfg["dtype"], jax.default_backend())
    began = time.time()
    model, tokenizer = load_chat_model(cfg["init_from"], cfg["out_dir"], cfg["tokenizer"], dtype)
    print(
        f"model {cfg['init_from']}: {model.num_params() / 1e6:.2f}M params, block_size "
        f"{model.config.block_size}, {dtype} on {jax.devices()[0].platform} (loaded in "
        f"{time.time() - began:.1f}s){also}",
        file=sys.stderr,
    )
    return model, tokenizer
