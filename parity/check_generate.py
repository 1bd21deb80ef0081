"""
Generation parity: our KV-cache decoding against full forwards, against transformers' greedy
generate, and against our own no-cache path; the sampling filters against numpy and transformers'
logits warpers; the tokens generate samples against transformers' warpers and transformers' own
generate(do_sample=True), by chi-square tests on many draws from one prompt (the torch side never
runs our sampling code).

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

# jax, and our modules on it, are imported in the functions that use them: bad arguments fail before
# jax loads

# max |cached - full-forward logits| / max |full-forward logits|, fp32 (measured <= 2.7e-6)
CACHE_LOGITS_TOL = 1e-5
FILTER_PROB_TOL = 1e-6  # max |p - p_ref| of the filtered, renormalized distribution
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
# (temperature, top_k, top_p) for the sampling checks
SAMPLING = (0.8, 20, 0.9)
# the distribution checks: draws from one prompt, and each test's false-failure rate (the
# probability that a correct sampler fails it, over seeds; the keys are fixed, so a run is
# deterministic)
DRAWS = 20000
SAMPLE_ALPHA = 1e-6
FILTER_SETTINGS = [
    (1.0, None, None),
    (0.7, 50, None),
    (1.3, None, 0.9),
    (0.8, 200, 0.95),
    (1.0, 1, None),
    (1.0, None, 0.05),
    (2.0, 1000, 0.5),
    (0.5, 7, 0.999),
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


def softmax64(z):
    z = z - np.max(z, axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def reference_probs(logits, temperature, top_k, top_p):
    """filter_logits' distribution in float64 numpy, written from the definitions."""
    z = np.asarray(logits, np.float64) / temperature
    if top_k is not None and top_k < z.shape[-1]:
        kth = np.sort(z, axis=-1)[:, -top_k][:, None]  # k-th largest; ties with it stay
        z = np.where(z < kth, -np.inf, z)
    if top_p is not None and top_p < 1.0:
        keep = np.zeros(z.shape, bool)
        for b, row in enumerate(z):
            p = softmax64(row)
            mass_before = 0.0  # probability of the tokens more likely than this one
            for i in np.argsort(-row, kind="stable"):
                if mass_before >= top_p:
                    break
                keep[b, row == row[i]] = True
                mass_before += p[i]
        z = np.where(keep, z, -np.inf)
    return softmax64(z)


def hf_probs(logits, temperature, top_k, top_p):
    """The same filters through transformers' logits warpers (float32 torch)."""
    import torch
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    # a copy: torch takes no read-only array
    scores = torch.from_numpy(np.array(logits, np.float32))
    warpers = [TemperatureLogitsWarper(temperature)]
    if top_k is not None:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p is not None and top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    for w in warpers:
        scores = w(None, scores)
    return torch.softmax(scores, -1).double().numpy()


def filter_test_logits(seed=0, vocab=1000):
    """(5, vocab) float32: random rows at three scales, a peaked row, and a row of many exact
    ties."""
    rng = np.random.default_rng(seed)
    rows = [rng.normal(0, s, vocab) for s in (0.5, 2.0, 8.0)]
    rows.append(np.concatenate([[12.0], rng.normal(0, 1, vocab - 1)]))
    # ties: top_k/top_p keep every tie of the cutoff
    rows.append(rng.integers(0, 6, vocab).astype(np.float64))
    return np.stack(rows).astype(np.float32)


def check_filters(logits=None):
    """filter_logits vs numpy and vs transformers' warpers -> rows of (setting, max |p - numpy|,
    same support as numpy, max |p - HF| on tie-free rows, same support as HF)."""
    import jax
    import jax.numpy as jnp

    from generate import filter_logits

    logits = filter_test_logits() if logits is None else logits
    tie_free = np.array([len(np.unique(r)) == len(r) for r in logits])
    rows = []
    for temperature, top_k, top_p in FILTER_SETTINGS:
        probs = np.asarray(
            jax.nn.softmax(filter_logits(jnp.asarray(logits), temperature, top_k, top_p)),
            np.float64,
        )
        ref = reference_probs(logits, temperature, top_k, top_p)
        hf = hf_probs(logits[tie_free], temperature, top_k, top_p)
        rows.append(
            (
                f"T={temperature} top_k={top_k} top_p={top_p}",
                max_abs(probs, ref),
                bool(np.array_equal(probs > 0, ref > 0)),
                max_abs(probs[tie_free], hf),
                bool(np.array_equal(probs[tie_free] > 0, hf > 0)),
            )
        )
    return rows


def filters_ok(rows):
    return all(r[1] <= FILTER_PROB_TOL and r[2] and r[3] <= FILTER_PROB_TOL and r[4] for r in rows)


def draw(model, prompt, rows, new_tokens, sampling, key):
    """Tokens sampled by our generate: `rows` copies of `prompt` (T,), `new_tokens` steps each,
    counted per token id -> (counts (V,), the raw logits of the first step (V,), of row 0). With
    logits that do not depend on the tokens (tests' fixed-logits model), every step draws from the
    same distribution: rows x new_tokens draws."""
    temperature, top_k, top_p = sampling
    idx = np.repeat(np.asarray(prompt, np.int32)[None], rows, axis=0)
    out, logits = model.generate(
        idx,
        new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        key=key,
        return_logits=True,
    )
    V = model.config.vocab_size
    return np.bincount(out[:, len(prompt) :].ravel(), minlength=V), logits[0, 0]


def hf_draw(hf_model, prompt, rows, sampling, seed):
    """transformers' own sampling: generate(do_sample=True) with its temperature, top_k and top_p on
    `rows` copies of `prompt`, one new token each -> (counts (V,), the warped probabilities it
    samples from (V,), float64)."""
    import torch

    temperature, top_k, top_p = sampling
    x = torch.from_numpy(np.repeat(np.asarray(prompt, np.int64)[None], rows, axis=0))
    hf_model.generation_config.eos_token_id = None
    hf_model.generation_config.pad_token_id = 0
    torch.manual_seed(seed)
    with torch.no_grad():
        out = hf_model.generate(
            x,
            attention_mask=torch.ones_like(x),
            do_sample=True,
            max_new_tokens=1,
            min_new_tokens=0,
            temperature=temperature,
            top_k=top_k or 0,
            top_p=top_p or 1.0,
        )
        logits = hf_model(x[:1]).logits[:, -1].numpy()  # (1, V)
    V = hf_model.config.vocab_size
    return np.bincount(out[:, -1].numpy(), minlength=V), hf_probs(
        logits, temperature, top_k, top_p
    )[0]


def pooled(expected, *observed):
    """Pearson's bins: tokens expected >= 5 times their own, the rest pooled into one (merged into
    the smallest bin if it is expected < 5 times itself), for the chi-square approximation to
    hold."""
    big = expected >= 5
    bins = [np.append(x[big], x[~big].sum()) for x in (expected, *observed)]
    if bins[0][-1] < 5 and len(bins[0]) > 1:
        j = int(np.argmin(bins[0][:-1]))
        bins = [np.append(np.delete(b[:-1], j), b[j] + b[-1]) for b in bins]
    return bins


def chi_square(counts, probs, alpha=SAMPLE_ALPHA):
    """Goodness of fit of `counts` (V,) draws to `probs` (V,): no draw of a probability-0 token
    (`outside`), and Pearson's statistic within chi2's 1 - alpha quantile. -> {stat, critical, df,
    outside, kept, ok}"""
    # chi2's inverse survival function, without scipy.stats' import time
    from scipy.special import chdtri

    counts, probs = np.asarray(counts, np.float64), np.asarray(probs, np.float64)
    n, kept = counts.sum(), probs > 0
    expected, observed = pooled(n * probs[kept] / probs[kept].sum(), counts[kept])
    stat, df = float(np.sum((observed - expected) ** 2 / expected)), len(expected) - 1
    critical = float(chdtri(df, alpha)) if df > 0 else 0.0
    outside = int(counts[~kept].sum())
    return {
        "stat": stat,
        "critical": critical,
        "df": df,
        "outside": outside,
        "kept": int(kept.sum()),
        "ok": outside == 0 and stat <= critical,
    }


def chi_square_two_sample(a, b, alpha=SAMPLE_ALPHA):
    """Whether two samples of counts (V,) come from one distribution: Pearson's test of homogeneity
    on the 2 x bins table, within chi2's 1 - alpha quantile. -> {stat, critical, df, ok}"""
    # chi2's inverse survival function, without scipy.stats' import time
    from scipy.special import chdtri

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    n_a, n_b = a.sum(), b.sum()
    share = (a + b) / (n_a + n_b)  # the common distribution, as estimated from both
    _, x, y, p = pooled(min(n_a, n_b) * share, a, b, share)
    stat = float(np.sum((x - n_a * p) ** 2 / (n_a * p)) + np.sum((y - n_b * p) ** 2 / (n_b * p)))
    df = len(p) - 1
    critical = float(chdtri(df, alpha)) if df > 0 else 0.0
    return {"stat": stat, "critical": critical, "df": df, "ok": stat <= critical}


def check_distribution(model, hf_model, prompt, key, sampling=SAMPLING, draws=DRAWS, seed=0):
    """`draws` tokens sampled by our generate after `prompt` against transformers: the warped
    probabilities of its logits processors (goodness of fit) and `draws` tokens of its
    generate(do_sample=True) (homogeneity)."""
    counts, _ = draw(model, prompt, draws, 1, sampling, key)
    hf_counts, probs = hf_draw(hf_model, prompt, draws, sampling, seed)
    return {
        "vs_warpers": chi_square(counts, probs),
        "vs_generate": chi_square_two_sample(counts, hf_counts),
        "hf_vs_warpers": chi_square(hf_counts, probs),
    }


def distribution_ok(f):
    return all(r["ok"] for r in f.values())


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
    import sharding  # here: jax is imported only once the arguments are good

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
