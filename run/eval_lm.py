"""
Our model as an lm-evaluation-harness model (JaxLM, a TemplateLM): loglikelihood,
loglikelihood_rolling and generate_until, batched on the mesh. Requests are sorted by length and
batched, each batch padded to one of at most MAX_SHAPES lengths (a compilation each); the logits
exist only at the continuation's positions. eval.py hands it to lm-eval's simple_evaluate.
"""

import collections
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from compute import sharding
from compute.generate import generate_in_jit
from configurator import UsageError, exit_without_extras
from dataio.tokenizer import EOT, GPT2_VOCAB, BPECodec

try:  # without the eval extras, one line naming them
    from lm_eval.api.model import TemplateLM
    from lm_eval.models.utils import (
        handle_stop_sequences,
        normalize_gen_kwargs,
        postprocess_generated_text,
    )
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as e:
    exit_without_extras(e, group="eval")

MAX_SHAPES = 8  # padded lengths per call: one compilation each
SCORE_CHUNK = 128  # continuation positions whose logits (rows, chunk, vocab) exist at once


# ------------------------------------------------------------------------------------------------
# shapes: requests sorted by length, batches padded to at most MAX_SHAPES lengths


def round_up(n, multiple):
    return -(-n // multiple) * multiple


def padded_lengths(needs, max_shapes=MAX_SHAPES):
    """Each batch's padded length, given each batch's need (ascending): at most max_shapes distinct
    lengths, chosen among the needs (the largest included) to pad as little as possible in all
    (dynamic programming over the distinct needs)."""
    values = sorted(set(needs))
    count = collections.Counter(needs)
    below = np.cumsum([count[v] for v in values])  # batches needing at most values[j]
    m, k_max = len(values), min(max_shapes, len(values))
    # cost[k, j]: batches up to values[j], k lengths, the last values[j]
    cost = np.full((k_max + 1, m), np.inf)
    back = np.zeros((k_max + 1, m), int)
    cost[1] = [values[j] * below[j] for j in range(m)]
    for k in range(2, k_max + 1):
        for j in range(m):
            for i in range(j):
                c = cost[k - 1, i] + values[j] * (below[j] - below[i])
                if c < cost[k, j]:
                    cost[k, j], back[k, j] = c, i
    k = int(np.argmin(cost[1:, m - 1])) + 1
    chosen, j = [], m - 1
    while k >= 1:
        chosen.append(values[j])
        j, k = back[k, j], k - 1
    chosen.sort()
    return [next(c for c in chosen if c >= n) for n in needs]


# ------------------------------------------------------------------------------------------------
# the JAX side


def continuation_scores(model, tokens, pos, targets):
    """tokens (R, L); the logits at pos (R, E) predict targets (R, E) (-1: padding) -> (summed
    log-probability of each row's targets (R,), whether each target is the argmax (R,)). Logits only
    at the continuation positions, SCORE_CHUNK of them at a time."""
    _, x = model.hidden_states(tokens)
    x = jnp.take_along_axis(x, pos[..., None], axis=1)  # (R, E, C)

    def score(x, t):
        logits = model.logits(x)  # (R, c, vocab) float32
        valid = t >= 0
        t = jnp.where(valid, t, 0)
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), t[..., None], axis=-1)[
            ..., 0
        ]
        greedy = (jnp.argmax(logits, axis=-1) == t) | ~valid
        return jnp.sum(jnp.where(valid, logp, 0.0), axis=-1), jnp.all(greedy, axis=-1)

    R, E, C = x.shape
    if E <= SCORE_CHUNK:
        return score(x, targets)
    xs = x.reshape(R, E // SCORE_CHUNK, SCORE_CHUNK, C).swapaxes(0, 1)
    ts = targets.reshape(R, E // SCORE_CHUNK, SCORE_CHUNK).swapaxes(0, 1)
    sums, greedy = jax.lax.map(lambda xt: score(*xt), (xs, ts))
    return jnp.sum(sums, axis=0), jnp.all(greedy, axis=0)


class JaxLM(TemplateLM):
    """Our GPT as an lm-eval model. Contexts and continuations split into tokens as lm-eval's hf
    model splits them (TemplateLM); too-long inputs cut from the left as it cuts them."""

    max_gen_toks = 256  # lm-eval's hf model's default

    def __init__(self, model, mesh, batch_size=8, seed=1234, progress=True):
        super().__init__()
        graphdef, state = nnx.split(model)
        self.model = nnx.merge(graphdef, jax.device_put(state, sharding.shardings_for(state, mesh)))
        self.mesh, self.config = mesh, model.config
        self.rows = batch_size * sharding.batch_shards(mesh)
        self.key = jax.random.key(seed)
        # splash attention's block on TPU
        self.multiple = 128 if sharding.platform_of(mesh) == "tpu" else 8
        self.progress = progress and jax.process_index() == 0
        self.enc = BPECodec()
        self.shapes = set()  # every compiled shape: its count is said after each call
        self._score = nnx.jit(continuation_scores, out_shardings=NamedSharding(mesh, P()))

    @property
    def eot_token_id(self):
        return EOT

    def tok_encode(self, string, add_special_tokens=None, **kwargs):
        # <|endoftext|> in the text is the token, as HF's tokenizer has it
        return self.enc.encode(string)

    def tok_decode(self, tokens):
        return self.enc.decode(tokens)

    def _say(self, what):
        if jax.process_index() == 0:
            print(what, file=sys.stderr, flush=True)

    def _loglikelihood_tokens(self, requests, disable_tqdm=False, **kwargs):
        bs, R = self.config.block_size, self.rows
        rows, cut = [], 0
        for _, context, continuation in requests:
            if not continuation or len(continuation) > bs:
                raise UsageError(
                    f"a continuation of {len(continuation)} tokens: it must be 1 to block_size {bs}"
                )
            whole = context + continuation
            cut += len(whole) > bs + 1
            inp = whole[-(bs + 1) :][:-1]  # the last token is only a target
            rows.append((inp, continuation))
        if cut:
            self._say(
                f"{cut} of {len(rows)} requests longer than block_size {bs}: context cut from the "
                "left, as lm-eval's hf model cuts it"
            )
        order = sorted(range(len(rows)), key=lambda i: len(rows[i][0]))
        batches = [order[i : i + R] for i in range(0, len(order), R)]
        needs = [min(round_up(len(rows[b[-1]][0]), self.multiple), bs) for b in batches]
        lengths = padded_lengths(needs)
        E = round_up(max(len(c) for _, c in rows), self.multiple)
        self._say(
            f"loglikelihood: {len(rows)} requests in {len(batches)} batches of {R} rows, padded to "
            f"{len(set(lengths))} lengths {sorted(set(lengths))} (a compilation each)"
        )

        total, greedy = np.zeros(len(rows)), np.zeros(len(rows), bool)
        # batch k + 1 is dispatched before batch k is read back: packing overlaps compute
        pending = None
        with (
            jax.set_mesh(self.mesh),
            tqdm(
                total=len(rows),
                desc="loglikelihood",
                unit="req",
                disable=disable_tqdm or not self.progress,
            ) as bar,
        ):
            for item in list(zip(batches, lengths)) + [None]:
                launched = None
                if item is not None:
                    idx, L = item
                    e = min(E, L) if min(E, L) <= SCORE_CHUNK else round_up(min(E, L), SCORE_CHUNK)
                    batch = self._pack([rows[i] for i in idx], L, e)
                    self.shapes.add(("loglikelihood", R, L, e))
                    launched = idx, self._score(self.model, *sharding.put_rows(batch, self.mesh))
                if pending is not None:
                    idx, (s, g) = pending
                    total[idx], greedy[idx] = np.asarray(s)[: len(idx)], np.asarray(g)[: len(idx)]
                    bar.update(len(idx))
                pending = launched
        self._say(f"compiled shapes so far: {len(self.shapes)}")
        return [(float(t), bool(g)) for t, g in zip(total, greedy)]

    def _pack(self, rows, L, E):
        # right padding: causal attention keeps it out of every row
        tokens = np.zeros((self.rows, L), np.int32)
        pos = np.zeros((self.rows, E), np.int32)
        targets = np.full((self.rows, E), -1, np.int32)
        for r, (inp, cont) in enumerate(rows):
            n, k = len(inp), len(cont)
            tokens[r, :n] = inp
            pos[r, :k] = np.arange(n - k, n)  # the logits at t predict token t + 1
            targets[r, :k] = cont
        return tokens, pos, targets

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        """A document's log-likelihood in windows of block_size tokens, each conditioned on the one
        before (lm-eval's rolling windows, as its hf model makes them), all windows of all documents
        batched together."""
        windows, owner = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            for context, continuation in map(
                make_disjoint_window,
                get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=EOT,
                    max_seq_len=self.config.block_size,
                    context_len=1,
                ),
            ):
                windows.append((None, context, continuation))
                owner.append(i)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = np.zeros(len(requests))
        np.add.at(totals, owner, [s for s, _ in scores])
        return [float(t) for t in totals]

    def generate_until(self, requests, disable_tqdm=False):
        """Greedy or sampled KV-cache generation, as the task asks, cut at its `until` strings and
        max_gen_toks. Rows of one batch share their prompt length (the cache's positions), so
        requests are grouped by it."""
        bs, R = self.config.block_size, self.rows
        groups, cut = collections.defaultdict(list), 0
        for i, (context, gen_kwargs) in enumerate(req.args for req in requests):
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos="<|endoftext|>")
            max_gen = kwargs.pop("max_gen_toks")
            if max_gen >= bs:
                raise UsageError(
                    f"a task asks for {max_gen} new tokens: it must be less than block_size {bs}"
                )
            tokens = self.tok_encode(context)
            cut += len(tokens) > bs - max_gen
            # lm-eval's hf model's cut: room for max_gen new tokens
            tokens = tokens[-(bs - max_gen) :]
            groups[(len(tokens), max_gen, self._sampling(kwargs))].append((i, tokens, until))
        if cut:
            self._say(
                f"{cut} of {len(requests)} contexts longer than block_size {bs} minus the tokens "
                "to generate: cut from the left, as lm-eval's hf model cuts them"
            )
        out = [""] * len(requests)
        with (
            jax.set_mesh(self.mesh),
            tqdm(
                total=len(requests),
                desc="generate_until",
                unit="req",
                disable=disable_tqdm or not self.progress,
            ) as bar,
        ):
            for (T, max_gen, sampling), group in sorted(groups.items(), key=lambda kv: kv[0][:2]):
                L = min(round_up(T + max_gen, 64), bs)  # T is traced: few lengths compile
                for k in range(0, len(group), R):
                    chunk = group[k : k + R]
                    buf = np.zeros((R, L), np.int32)
                    buf[:, :T] = chunk[0][1]  # filler rows repeat the first
                    for r, (_, tokens, _) in enumerate(chunk):
                        buf[r, :T] = tokens
                    self.key, key = jax.random.split(self.key)
                    self.shapes.add(("generate", R, L, sampling))
                    (buf,) = sharding.put_rows([buf], self.mesh)
                    new, _ = generate_in_jit(
                        self.model,
                        buf,
                        jnp.int32(T),
                        key,
                        sampling=sampling,
                        use_cache=True,
                        on_token=None,
                        return_logits=False,
                    )
                    new = np.asarray(multihost_utils.process_allgather(new, tiled=True))[
                        :, T : T + max_gen
                    ]
                    for r, (i, _, until) in enumerate(chunk):
                        ids = new[r].tolist()
                        ids = ids[: ids.index(EOT)] if EOT in ids else ids
                        out[i] = postprocess_generated_text(self.tok_decode(ids), until, None)
                    bar.update(len(chunk))
        self._say(f"compiled shapes so far: {len(self.shapes)}")
        return out

    def _sampling(self, kwargs):
        """generate_in_jit's static sampling tuple: (temperature, top_k, top_p, vocab_limit); greedy
        is 0."""
        temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
        top_k, top_p = kwargs.get("top_k"), kwargs.get("top_p")
        # ids past GPT-2's 50257 (a padded vocabulary) are no tokens: never generated
        return (
            temperature,
            None if top_k is None else int(top_k),
            None if top_p in (None, 1.0) else float(top_p),
            min(self.config.vocab_size, GPT2_VOCAB),
        )
