"""
Generation parity's checks of the sampler, for check_generate: filter_logits' probabilities against
numpy (reference_probs, written from the definitions) and transformers' logits warpers, and the
tokens our generate samples against transformers' warpers and its own generate(do_sample=True), by
chi-square tests on many draws from one prompt (the torch side never runs our sampling code). Not a
check to run: `python -m parity.check_generate` runs them.
"""

import numpy as np

from parity.common import max_abs

# jax, torch, transformers and our modules on jax are imported in the functions that use them

FILTER_PROB_TOL = 1e-6  # max |p - p_ref| of the filtered, renormalized distribution
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

    from compute.generate import filter_logits

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
