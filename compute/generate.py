"""
Sampling from a GPT with a KV cache: the prompt is prefilled into the cache once, then one token per
step, the whole loop inside one jit. One compilation per (batch size, total length) and sampling
settings: the prompt length is traced, so neither a new prompt nor a new token recompiles anything.
Any model with GPT's hidden_states, logits, decode and init_cache samples this way.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configurator import UsageError

# prompt tokens per prefill step: prompts of any length share one compiled prefill
PREFILL_CHUNK = 64


def check_sampling(temperature, top_k, top_p):
    """The sampling settings, each a one-line UsageError (a ValueError) naming its range."""
    if not temperature >= 0:
        raise UsageError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
    if top_k is not None and not (isinstance(top_k, int) and top_k > 0):
        raise UsageError(f"top_k must be a positive integer (or None for no top-k), got {top_k!r}")
    if top_p is not None and not 0 < top_p <= 1:
        raise UsageError(f"top_p must be in (0, 1] (1 keeps everything), got {top_p}")


def filter_logits(logits, temperature=1.0, top_k=None, top_p=None):
    """(B, V) logits -> logits / temperature with the tokens top_k and top_p remove set to -inf.
    top_k keeps the k largest (and ties with the k-th, as nanoGPT's torch.topk test); top_p then
    keeps the smallest set of most likely tokens whose probability reaches top_p: a token stays when
    the mass of the tokens more likely than it is < top_p (HF's TopPLogitsWarper rule)."""
    logits = logits.astype(jnp.float32) / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        # the k-th largest as the min of the top k: slicing the last one out of top_k made XLA:CPU
        # sort the whole vocabulary (docs/benchmarks.md)
        kth = jnp.min(jax.lax.top_k(logits, top_k)[0], axis=-1, keepdims=True)  # (B, 1)
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p is not None and top_p < 1.0:
        desc = -jnp.sort(-logits, axis=-1)  # (B, V), most likely first
        probs = jax.nn.softmax(desc, axis=-1)
        # (B, 1), >= 1
        n_keep = jnp.sum(jnp.cumsum(probs, axis=-1) - probs < top_p, axis=-1, keepdims=True)
        cutoff = jnp.take_along_axis(desc, n_keep - 1, axis=-1)  # (B, 1)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return logits


def generate(
    model,
    idx,
    max_new_tokens,
    temperature=1.0,
    top_k=None,
    top_p=None,
    *,
    key=None,
    use_cache=True,
    vocab_limit=None,
    on_token=None,
    return_logits=False,
):
    """Take a conditioning sequence of indices idx (B, T) and complete it max_new_tokens times,
    feeding the predictions back in -> (B, T + max_new_tokens) numpy int32. As nanoGPT: logits /
    temperature, then top_k, then (ours) top_p; once the sequence outgrows block_size the model
    conditions on its last block_size tokens. temperature 0 is greedy (argmax, no key needed);
    otherwise `key` drives the sampling: same key, same tokens, cache or not. The prompt is
    prefilled into a KV cache once, then one token per step; use_cache=False runs the full forward
    every step instead (the reference). vocab_limit: sample only ids below it (a padded vocabulary's
    extra ids decode to nothing). on_token(ids (B,)) is called on the host as each step's tokens
    come (streaming). return_logits: also return each step's raw logits (B, max_new_tokens, vocab),
    float32."""
    idx = np.asarray(idx)
    V = model.config.vocab_size
    if idx.ndim != 2 or idx.shape[1] < 1 or not np.issubdtype(idx.dtype, np.integer):
        raise ValueError(
            f"expected prompt token ids of shape (batch, time >= 1), got {idx.dtype} {idx.shape}"
        )
    if idx.min() < 0 or idx.max() >= V:
        raise ValueError(
            f"prompt token ids must be in [0, {V}), got min {idx.min()}, max {idx.max()}"
        )
    if not (isinstance(max_new_tokens, int) and max_new_tokens > 0):
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    check_sampling(temperature, top_k, top_p)
    if key is None and temperature > 0:
        raise ValueError("sampling (temperature > 0) needs a PRNG key: key=jax.random.key(seed)")
    if vocab_limit is not None and not 0 < vocab_limit <= V:
        raise ValueError(f"vocab_limit must be in [1, {V}], got {vocab_limit}")
    B, T = idx.shape
    buf = np.zeros((B, T + max_new_tokens), np.int32)  # prompt, then the tokens as they are sampled
    buf[:, :T] = idx
    sampling = (
        float(temperature),
        top_k,
        None if top_p in (None, 1.0) else float(top_p),
        vocab_limit,
    )
    out, logits = generate_in_jit(
        model,
        jnp.asarray(buf),
        jnp.int32(T),
        jax.random.key(0) if key is None else key,
        sampling=sampling,
        use_cache=use_cache,
        on_token=on_token,
        return_logits=return_logits,
    )
    return (
        (np.asarray(out), np.asarray(logits[:, :max_new_tokens]))
        if return_logits
        else np.asarray(out)
    )


@functools.partial(nnx.jit, static_argnames=("sampling", "use_cache", "on_token", "return_logits"))
def generate_in_jit(model, buf, prompt_len, key, *, sampling, use_cache, on_token, return_logits):
    """buf (B, L): the prompt in buf[:, :prompt_len]; fills buf[:, prompt_len:]. See generate."""
    temperature, top_k, top_p, vocab_limit = sampling
    bs = model.config.block_size
    B, L = buf.shape
    W = min(L, bs)  # the longest context the model ever sees

    def logits_full(buf, n):
        """nanoGPT's step: forward the last <= block_size tokens before position n, keep the last
        logits."""
        start = jnp.maximum(n - W, 0)
        _, x = model.hidden_states(jax.lax.dynamic_slice_in_dim(buf, start, W, axis=1))  # (B, W, C)
        # past n sit padding or not-yet-sampled tokens: causal attention keeps them out of position
        # n-1 (B, V)
        return model.logits(jax.lax.dynamic_index_in_dim(x, n - 1 - start, axis=1, keepdims=False))

    def logits_cached(buf, cache, n):
        """feed token n-1 at position n-1 through the cache, which holds positions 0..n-2."""
        x, cache = model.decode(jax.lax.dynamic_slice_in_dim(buf, n - 1, 1, axis=1), cache, n - 1)
        return model.logits(x[:, 0]), cache  # (B, V)

    cache = None
    if use_cache:
        # prefill every prompt token but the last (the first step feeds that one), in fixed-size
        # chunks; the cache is a whole number of chunks long so no chunk's write is clipped
        C = min(PREFILL_CHUNK, W)
        S = -(-W // C) * C
        cache = model.init_cache(B, S)
        prompt = jnp.pad(buf[:, :W], ((0, 0), (0, S - W)))  # (B, S)
        # a prompt longer than block_size never uses it
        n_prefill = jnp.where(prompt_len <= bs, prompt_len - 1, 0)

        def prefill(j, cache):
            return model.decode(
                jax.lax.dynamic_slice_in_dim(prompt, j * C, C, axis=1), cache, j * C
            )[1]

        cache = jax.lax.fori_loop(0, (n_prefill + C - 1) // C, prefill, cache)

    V = model.config.vocab_size if vocab_limit is None else vocab_limit
    all_logits = jnp.zeros((B, L if return_logits else 0, model.n_logits), jnp.float32)

    def step(i, carry):
        buf, cache, all_logits = carry
        n = prompt_len + i  # the position this step samples
        if not use_cache:
            logits = logits_full(buf, n)
        elif L <= bs:
            logits, cache = logits_cached(buf, cache, n)
        # the cache serves until the sequence outgrows block_size; then the window slides, positions
        # shift
        else:
            logits, cache = jax.lax.cond(
                n <= bs, logits_cached, lambda b, c, n: (logits_full(b, n), c), buf, cache, n
            )
        if return_logits:
            all_logits = jax.lax.dynamic_update_slice_in_dim(all_logits, logits[:, None], i, axis=1)
        logits = logits[:, :V]
        if temperature == 0:
            tok = jnp.argmax(logits, axis=-1)  # (B,)
        else:
            tok = jax.random.categorical(
                jax.random.fold_in(key, i), filter_logits(logits, temperature, top_k, top_p)
            )
        tok = tok.astype(buf.dtype)
        if on_token is not None:
            jax.debug.callback(on_token, tok, ordered=True)
        return jax.lax.dynamic_update_slice_in_dim(buf, tok[:, None], n, axis=1), cache, all_logits

    buf, _, all_logits = jax.lax.fori_loop(0, L - prompt_len, step, (buf, cache, all_logits))
    return buf, all_logits  # all_logits (B, L, vocab): step i's in row i
