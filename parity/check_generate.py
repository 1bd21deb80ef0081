"""
Generation parity: our KV-cache decoding against full forwards, against transformers' greedy
generate, and against our own no-cache path; the sampling filters against numpy and transformers'
logits warpers; the tokens generate samples against transformers' warpers and transformers' own
generate(do_sample=True), by chi-square tests on many draws from one prompt (the torch side never
runs our sampling code). The sampler's checks are parity/sampling_checks.py's.

    # random HF checkpoints in several shapes, offline
    python -m parity.check_generate
    # and an HF GPT-2 directory (or gpt2*, online or HF cache)
    python -m parity.check_generate --model DIR

Exit code: 0 parity holds, 1 a check fails, 2 bad input.
"""

import argparse
import os
import tempfile
from typing import NamedTuple

import numpy as np

from configurator import exit_on_bad_input, require_extras
from parity.common import max_abs, pin_numerics, print_table, random_hf_model, verdict
from parity.sampling_checks import (
    DRAWS,
    FILTER_PROB_TOL,
    SAMPLE_ALPHA,
    SAMPLING,
    check_distribution,
    check_filters,
    distribution_ok,
    filters_ok,
)

# jax, and our modules on it, are imported in the functions that use them: bad arguments fail before
# jax loads

# max |cached - full-forward logits| / max |full-forward logits|, fp32 (measured <= 2.7e-6)
CACHE_LOGITS_TOL = 1e-5
# bf16: the cached logits' error against fp32 full forwards may be at most this factor times the
# bf16 full forward's (as parity.check_logits judges bf16)
BF16_FACTOR = 1.5
# Random GPT-2s with every block weight scaled up so that the context, and not only the last token
# (through the tied embedding), decides the greedy pick: at GPT-2's init scale greedy decoding
# repeats one or two tokens and "same tokens as transformers" tests next to nothing. x10 gives 10-80
# distinct tokens per row; at x20 fp32 rounding alone reaches 1e-5 of the logits, between torch's
# and our full forwards as much as between our cached and full ones.
BLOCK_WEIGHT_SCALE = 10.0


class Case(NamedTuple):
    name: str
    config: dict  # GPT2Config kwargs
    batch: int
    prompt_len: int
    new_tokens: int


CASES = [
    Case("tiny", dict(n_layer=2, n_head=2, n_embd=64, vocab_size=128, n_positions=128), 3, 7, 64),
    # a 100-token prompt is two prefill chunks (PREFILL_CHUNK = 64); the BPE vocabulary's size
    Case(
        "bpe, 2 prefill chunks",
        dict(n_layer=3, n_head=4, n_embd=128, vocab_size=50257, n_positions=256),
        2,
        100,
        96,
    ),
    # past block_size nanoGPT conditions on the last block_size tokens: the cache serves 24 steps,
    # then not
    Case(
        "past block_size",
        dict(n_layer=2, n_head=4, n_embd=64, vocab_size=128, n_positions=32),
        2,
        8,
        64,
    ),
    Case(
        "prompt > block_size",
        dict(n_layer=2, n_head=4, n_embd=64, vocab_size=128, n_positions=32),
        2,
        40,
        64,
    ),
]


def varied_hf_model(seed=0, scale=BLOCK_WEIGHT_SCALE, **config_kwargs):
    import torch

    hf_model = random_hf_model(seed, **config_kwargs)
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if name.startswith("transformer.h.") and p.ndim == 2:
                p.mul_(scale)
    return hf_model


def hf_greedy(hf_model, idx, new_tokens):
    """transformers' generate(do_sample=False); past n_positions (where HF stops) nanoGPT's loop on
    HF's forward: argmax of the logits of the last n_positions tokens."""
    import torch

    n_pos = hf_model.config.n_positions
    x = torch.from_numpy(np.asarray(idx, np.int64))
    with torch.no_grad():
        if x.shape[1] + new_tokens <= n_pos:
            # never stop early: we always decode new_tokens
            hf_model.generation_config.eos_token_id = None
            hf_model.generation_config.pad_token_id = 0
            return hf_model.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=0,
            ).numpy()
        for _ in range(new_tokens):
            logits = hf_model(x[:, -n_pos:]).logits[:, -1]
            x = torch.cat([x, logits.argmax(-1, keepdim=True)], dim=1)
    return x.numpy()


def full_forward_logits(model, out, prompt_len):
    """The logits each decoding step of `out` (B, L) should have seen, from our plain full forward:
    step i conditions on the last <= block_size tokens before position prompt_len + i. (B, new,
    V)"""
    import jax.numpy as jnp
    from flax import nnx

    forward = nnx.jit(lambda model, idx: model(idx)[0])
    bs, L = model.config.block_size, out.shape[1]
    steps = []
    if prompt_len <= bs:  # every step up to position bs at once: causal attention makes it the same
        upto = min(L - 1, bs)
        steps.append(np.asarray(forward(model, jnp.asarray(out[:, :upto])))[:, prompt_len - 1 :])
    for n in range(max(prompt_len, bs + 1), L):
        steps.append(np.asarray(forward(model, jnp.asarray(out[:, n - bs : n])))[:, -1:])
    return np.concatenate(steps, axis=1)


def check_greedy(model, hf_model, idx, new_tokens):
    """Greedy decoding from the cache: tokens against transformers, logits against full forwards."""
    out, logits = model.generate(idx, new_tokens, temperature=0, return_logits=True)
    ref_tokens = hf_greedy(hf_model, idx, new_tokens)
    ref_logits = full_forward_logits(model, out, idx.shape[1])
    T = idx.shape[1]
    first_diff = np.nonzero((out != ref_tokens).any(0))[0]
    return {
        "greedy_equal": bool(np.array_equal(out, ref_tokens)),
        "greedy_first_diff": int(first_diff[0]) - T if len(first_diff) else None,
        "distinct": min(len(set(row)) for row in out[:, T:].tolist()),
        "cache_rel": max_abs(logits, ref_logits) / float(np.max(np.abs(ref_logits))),
    }


def check_sampling(model, idx, new_tokens, key, sampling=SAMPLING):
    """Sampling with and without the cache, same key: tokens, and the logits each step sampled
    from."""
    temperature, top_k, top_p = sampling
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, key=key, return_logits=True)
    out, logits = model.generate(idx, new_tokens, **kw)
    ref_out, ref_logits = model.generate(idx, new_tokens, use_cache=False, **kw)
    return {
        "sample_equal": bool(np.array_equal(out, ref_out)),
        "sample_distinct": min(len(set(row)) for row in out[:, idx.shape[1] :].tolist()),
        "sample_cache_rel": max_abs(logits, ref_logits) / float(np.max(np.abs(ref_logits))),
    }


def check_bf16(path, idx, new_tokens):
    """bf16 decoding from the cache against bf16 full forwards, both judged against fp32 full
    forwards on the same tokens."""
    from model import GPT

    model16, model32 = GPT.from_pretrained(path, dtype="bfloat16"), GPT.from_pretrained(path)
    out, logits = model16.generate(idx, new_tokens, temperature=0, return_logits=True)
    ref32 = full_forward_logits(model32, out, idx.shape[1])
    scale = float(np.max(np.abs(ref32)))
    return {
        "bf16_cache_rel": max_abs(logits, ref32) / scale,
        "bf16_full_rel": max_abs(full_forward_logits(model16, out, idx.shape[1]), ref32) / scale,
    }


def bf16_ok(f):
    return 0 < f["bf16_cache_rel"] <= BF16_FACTOR * f["bf16_full_rel"]


def greedy_ok(f):
    return f["greedy_equal"] and f["cache_rel"] <= CACHE_LOGITS_TOL


def sampling_ok(f):
    return f["sample_equal"] and f["sample_cache_rel"] <= CACHE_LOGITS_TOL


def make_prompt(batch, prompt_len, vocab_size, seed):
    return np.random.default_rng(seed).integers(0, vocab_size, (batch, prompt_len)).astype(np.int32)


def run_cases(cases, seed=0, bf16_case=0):
    """Each case on a fresh random HF checkpoint saved to a tmp dir and loaded by both frameworks;
    one of them in bf16 too, and its sampling distribution against transformers'."""
    import jax

    from model import GPT

    results, bf16, dist = [], None, None
    with tempfile.TemporaryDirectory() as tmp:
        for i, case in enumerate(cases):
            path = os.path.join(tmp, f"case{i}")
            hf_model = varied_hf_model(seed + i, **case.config)
            hf_model.save_pretrained(path)
            model = GPT.from_pretrained(path)
            idx = make_prompt(case.batch, case.prompt_len, case.config["vocab_size"], seed + i)
            results.append(
                (
                    case,
                    {
                        **check_greedy(model, hf_model, idx, case.new_tokens),
                        **check_sampling(model, idx, case.new_tokens, jax.random.key(seed + i)),
                    },
                )
            )
            if i == bf16_case:
                bf16 = (case.name, check_bf16(path, idx, case.new_tokens))
                dist = (
                    case.name,
                    check_distribution(model, hf_model, idx[0], jax.random.key(seed), seed=seed),
                )
    return results, bf16, dist


def print_cases(results):
    rows = []
    for case, f in results:
        c = case.config
        rows.append(
            [
                case.name,
                f"{c['n_layer']}/{c['n_head']}/{c['n_embd']}/{c['vocab_size']}/{c['n_positions']}",
                f"{case.batch}x({case.prompt_len}+{case.new_tokens})",
                "yes" if f["greedy_equal"] else f"NO (step {f['greedy_first_diff']})",
                str(f["distinct"]),
                f["cache_rel"],
                "yes" if f["sample_equal"] else "NO",
                str(f["sample_distinct"]),
                f["sample_cache_rel"],
            ]
        )
    print_table(
        rows,
        [
            "case",
            "L/H/C/V/block",
            "B x (T+new)",
            "greedy = HF",
            "distinct",
            "cache rel diff",
            "sample: cache = no-cache",
            "distinct",
            "cache rel diff",
        ],
    )


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0].strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        default=None,
        help="also check an HF GPT-2 directory or gpt2* (2 x (8 + 64) tokens)",
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    require_extras("parity")
    from compute import sharding  # here: jax is imported only once the arguments are good

    sharding.start_backend()  # libtpu's banner kept off the terminal where no TPU is
    pin_numerics()
    import jax

    from model import GPT
    from parity.torch_side import from_hf

    results, (bf16_name, bf16), (dist_name, dist) = run_cases(CASES, args.seed)
    if args.model:
        hf_model, model = from_hf(args.model), GPT.from_pretrained(args.model)
        c = hf_model.config
        idx = make_prompt(2, 8, c.vocab_size, args.seed)
        f = {
            **check_greedy(model, hf_model, idx, 64),
            **check_sampling(model, idx, 64, jax.random.key(args.seed)),
        }
        shape = dict(
            n_layer=c.n_layer,
            n_head=c.n_head,
            n_embd=c.n_embd,
            vocab_size=c.vocab_size,
            n_positions=c.n_positions,
        )
        results.append((Case(args.model, shape, 2, 8, 64), f))
    print(
        f"generation, fp32, jax on {jax.devices()[0].platform}; random HF GPT-2s with block "
        f"weights x{BLOCK_WEIGHT_SCALE:g}; sampling T={SAMPLING[0]} top_k={SAMPLING[1]} "
        f"top_p={SAMPLING[2]}; 'distinct': fewest distinct new tokens in a row"
    )
    print_cases(results)
    ok = verdict(
        all(greedy_ok(f) and sampling_ok(f) for _, f in results),
        f"KV cache (greedy = transformers, cache logits within {CACHE_LOGITS_TOL:g} of full "
        "forward, sampling cache = no-cache)",
    )
    print(
        f"bf16 ({bf16_name}): cached logits vs fp32 {bf16['bf16_cache_rel']:.3g} (max rel), bf16 "
        f"full forward vs fp32 {bf16['bf16_full_rel']:.3g}"
    )
    ok = (
        verdict(bf16_ok(bf16), f"bf16 KV cache (error <= {BF16_FACTOR}x the bf16 full forward's)")
        and ok
    )
    print()
    rows = check_filters()
    print_table(
        [list(r[:2]) + [str(r[2]), r[3], str(r[4])] for r in rows],
        [
            "filter",
            "max |p - numpy|",
            "support = numpy",
            "max |p - HF| (tie-free rows)",
            "support = HF",
        ],
    )
    ok = (
        verdict(
            filters_ok(rows),
            f"sampling filters (probabilities within {FILTER_PROB_TOL:g}, same support)",
        )
        and ok
    )
    print(
        f"\nsampled tokens, {DRAWS} draws each after one prompt ({dist_name}), T={SAMPLING[0]} "
        f"top_k={SAMPLING[1]} top_p={SAMPLING[2]}: {dist['vs_warpers']['kept']} tokens kept by "
        "transformers' warpers"
    )
    print_table(
        [
            [
                name,
                f["stat"],
                f["critical"],
                str(f["df"]),
                str(f.get("outside", "")),
                "yes" if f["ok"] else "NO",
            ]
            for name, f in (
                ("ours vs transformers' warpers", dist["vs_warpers"]),
                ("ours vs transformers' generate", dist["vs_generate"]),
                ("transformers' generate vs its warpers", dist["hf_vs_warpers"]),
            )
        ],
        [
            "chi-square test",
            "statistic",
            f"critical (alpha {SAMPLE_ALPHA:g})",
            "df",
            "drawn outside",
            "ok",
        ],
    )
    ok = (
        verdict(
            distribution_ok(dist),
            "sampling distribution (chi-square within the critical value, nothing "
            "drawn outside the kept set)",
        )
        and ok
    )
    return 0 if ok else 1


if __name__ == "__main__":
    exit_on_bad_input(main)
