"""python -m pytest tests/test_eval_scoring.py -q

run/eval_lm.py's scoring and generation (JaxLM) on models made in memory, no file or command: the
padded lengths, continuation scores in chunks equal to the logits at once (greedy where every target
is the argmax), generate_until's stops at <|endoftext|> and at a task's strings, contexts cut from
the left, a task's sampling settings; the tokenizer files made for lm-eval's hf model encode as
tiktoken; parity's judgement of a small difference; local tasks looked up among the local YAMLs
alone (eval.py on checkpoints and HF directories, against lm-eval's hf model: test_eval.py)."""

import itertools
import os
import re

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import REPO, TASKS
from lm_eval.api.instance import Instance

import eval as lm_eval_py
from compute import sharding
from configurator import UsageError
from dataio.tokenizer import EOT, get_encoding, save_hf_tokenizer
from model import GPT, GPTConfig
from parity import check_eval
from run import eval_lm


def test_hf_tokenizer_files_encode_as_tiktoken(tmp_path):
    """The tokenizer files made offline for transformers (lm-eval's hf model) give tiktoken's ids:
    GPT-2's split pattern, not the converter's default, which splits digits in threes."""
    tok = save_hf_tokenizer(tmp_path)
    with open(os.path.join(REPO, "data", "shakespeare_char", "input.txt")) as f:
        text = (
            f.read()[:20000]
            + " He said 1234567 times, naïve café, 日本語 🎉 <|endoftext|> and  \n\n  spaces "
        )
    assert tok.encode(text) == get_encoding().encode(text, allowed_special="all")
    assert tok.eos_token_id == tok.bos_token_id == 50256
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from dataio.tokenizer import BPE_FILE

    default = TikTokenConverter(vocab_file=str(BPE_FILE)).converted()
    assert default.encode("He said 1234567 times").ids != get_encoding().encode(
        "He said 1234567 times"
    )


def test_padded_lengths_are_few_and_pad_least():
    rng = np.random.default_rng(0)
    for _ in range(30):
        needs = sorted(rng.integers(1, 40, rng.integers(1, 12)).tolist())
        k = int(rng.integers(1, 5))
        got = eval_lm.padded_lengths(needs, k)
        assert (
            len(set(got)) <= k
            and all(g >= n for g, n in zip(got, needs))
            and max(got) == max(needs)
        )
        # every choice of k needs
        best = min(
            sum(next(c for c in sorted(chosen) if c >= n) for n in needs)
            for chosen in itertools.combinations(sorted(set(needs)), min(k, len(set(needs))))
            if max(needs) in chosen
        )
        assert sum(got) == best


@pytest.mark.slow
def test_continuation_scores_in_chunks_equal_the_logits_at_once():
    """Past SCORE_CHUNK positions the log-probabilities are summed chunk by chunk: equal to those of
    all the logits at once, padding (-1) left out; greedy where every target is the argmax (row 1's
    are, row 0's are not)."""
    model = GPT(
        GPTConfig(block_size=64, vocab_size=96, n_layer=1, n_head=2, n_embd=32), nnx.Rngs(0)
    )
    rng = np.random.default_rng(0)
    R, L, E = 2, 64, 2 * eval_lm.SCORE_CHUNK  # positions may repeat: E > L
    tokens = rng.integers(0, 96, (R, L))
    pos = rng.integers(0, L, (R, E))
    # (R, E, V)
    logits = np.asarray(model(jnp.asarray(tokens))[0], np.float64)[np.arange(R)[:, None], pos]
    targets = rng.integers(0, 96, (R, E))
    targets[1] = logits[1].argmax(-1)
    targets[:, -40:] = -1
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    want = np.take_along_axis(logp, np.maximum(targets, 0)[..., None], -1)[..., 0]
    sums, greedy = eval_lm.continuation_scores(
        model, *(jnp.asarray(a) for a in (tokens, pos, targets))
    )
    np.testing.assert_allclose(sums, np.where(targets >= 0, want, 0).sum(-1), rtol=1e-5)
    assert greedy.tolist() == [False, True]


@pytest.mark.slow
def test_long_continuations_are_scored_in_chunks_as_the_whole_logits_score_them():
    """A continuation longer than SCORE_CHUNK, through JaxLM: its log-probability equals numpy's
    from the logits of the whole input, and it is greedy where every token is the argmax."""
    model = GPT(
        GPTConfig(block_size=192, vocab_size=96, n_layer=1, n_head=2, n_embd=32), nnx.Rngs(0)
    )
    lm = eval_lm.JaxLM(model, sharding.make_mesh(), batch_size=2, progress=False)
    C, n = 20, eval_lm.SCORE_CHUNK + 12  # context and continuation tokens
    tokens = np.random.default_rng(0).integers(0, 96, C + n)
    # position t predicts t + 1
    logits = np.asarray(model(jnp.asarray(tokens[None, :-1]))[0][0], np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    # the argmax's
    greedy = np.asarray(model.generate(jnp.asarray(tokens[None, :C]), n, temperature=0.0))[0]
    scores = lm._loglikelihood_tokens(
        [(None, list(tokens[:C]), list(tokens[C:])), (None, list(greedy[:C]), list(greedy[C:]))]
    )
    np.testing.assert_allclose(
        scores[0][0], logp[np.arange(C - 1, C + n - 1), tokens[C:]].sum(), rtol=1e-5
    )
    assert scores[0][1] is False and scores[1][1] is True


def one_token_model(token=EOT):
    """A GPT-2-vocabulary model whose every next token is `token`: its final LayerNorm outputs its
    bias v whatever comes in, and the tied head's only non-zero row is the token's, v."""
    model = GPT(
        GPTConfig(block_size=64, vocab_size=50257, n_layer=1, n_head=2, n_embd=32), nnx.Rngs(0)
    )
    v = jnp.ones(32)
    model.ln_f.scale[...], model.ln_f.bias[...] = jnp.zeros(32), v
    model.wte.embedding[...] = jnp.zeros((50257, 32)).at[token].set(v)
    return model


@pytest.mark.slow
def test_generate_until_stops_at_endoftext_and_refuses_what_cannot_fit():
    """A text ends at <|endoftext|> (here the model's every token); one request is a batch of its
    own (the filler rows repeat it); a task asking for block_size new tokens or more is one line."""
    lm = eval_lm.JaxLM(one_token_model(), sharding.make_mesh(), batch_size=2, progress=False)

    def request(max_gen_toks):
        return Instance(
            "generate_until",
            {},
            ("To be, or not", {"until": ["\n"], "max_gen_toks": max_gen_toks}),
            0,
        )

    assert lm.generate_until([request(8)], True) == [""]
    with pytest.raises(
        UsageError, match=r"^a task asks for 64 new tokens: it must be less than block_size 64$"
    ):
        lm.generate_until([request(64)], True)


@pytest.mark.slow
def test_generate_until_ends_each_text_at_its_tasks_strings_and_cuts_long_contexts_from_the_left(
    capsys,
):
    """A text ends where the first of its request's `until` strings begins; a request without
    max_gen_toks gets the model's; a context with no room for the new tokens loses its first tokens,
    and the cut is said. A progress bar counts the requests, unless progress is off or lm-eval
    disables it."""
    (the,) = get_encoding().encode(" the")
    lm = eval_lm.JaxLM(one_token_model(the), sharding.make_mesh(), batch_size=2, progress=True)
    lm.max_gen_toks = 5

    def request(context, **gen_kwargs):
        return Instance("generate_until", {}, (context, gen_kwargs), 0)

    requests = [
        request("To be", until=["e t"], max_gen_toks=8),
        request("To be", until=["\n"]),
        # 60 + 5 tokens: 1 cut
        request(" the" * 60, until=["\n"]),
        request(" the" * 59, until=["\n"]),
        # e^32 to 1: " the"
        request("To be", until=["\n"], max_gen_toks=3, do_sample=True, temperature=1.0),
        request("To be", max_gen_toks=2),  # no until: <|endoftext|> alone ends it
        # a group of 3: 2 batches of 2 rows
        request("To be", until=["\n"]),
        request("To be", until=["\n"]),
    ]
    assert lm.generate_until(requests) == [
        " th",
        *[" the" * 5] * 3,
        " the" * 3,
        " the" * 2,
        *[" the" * 5] * 2,
    ]
    err = capsys.readouterr().err
    assert re.search(
        r"(^|\n)1 of 8 contexts longer than block_size 64 minus the tokens to generate: cut from "
        r"the left, as lm-eval's hf model cuts them\n",
        err,
    ), err
    # the bar as it closed: each request counted once
    final = re.findall(r"\r(generate_until:[^\r\n]*)", err)[-1]
    assert re.match(r"generate_until: 100%.* 8/8 .*req/s", final), final
    assert err.endswith("compiled shapes so far: 2\n"), err  # greedy and sampled, each 64 long
    quiet = eval_lm.JaxLM(lm.model, sharding.make_mesh(), batch_size=2, progress=False)
    for generator, disable_tqdm in [(quiet, False), (lm, True)]:
        assert generator.generate_until(requests[:1], disable_tqdm) == [" th"]
        assert "generate_until:" not in capsys.readouterr().err


def test_a_tasks_sampling_settings_are_the_generations():
    """lm-eval's gen_kwargs as generate_in_jit's sampling: greedy unless do_sample, then its
    temperature (none given: 0, greedy), top_k and top_p (1.0: none), and no id past GPT-2's 50257
    (a padded vocabulary's) or the model's."""
    lm = eval_lm.JaxLM(one_token_model(), sharding.make_mesh(), progress=False)
    for gen_kwargs, sampling in [
        ({}, (0.0, None, None, 50257)),
        ({"do_sample": False, "temperature": 0.7}, (0.0, None, None, 50257)),
        ({"do_sample": True}, (0.0, None, None, 50257)),
        ({"do_sample": True, "temperature": 0.7, "top_k": 40, "top_p": 0.9}, (0.7, 40, 0.9, 50257)),
        ({"do_sample": True, "temperature": 1, "top_k": 3.0, "top_p": 1.0}, (1.0, 3, None, 50257)),
    ]:
        assert lm._sampling(gen_kwargs) == sampling, gen_kwargs
        assert all(type(a) is type(b) for a, b in zip(lm._sampling(gen_kwargs), sampling)), (
            gen_kwargs
        )
    for vocab_size, limit in [(50304, 50257), (96, 96)]:
        model = GPT(
            GPTConfig(block_size=64, vocab_size=vocab_size, n_layer=1, n_head=2, n_embd=32),
            nnx.Rngs(0),
        )
        assert eval_lm.JaxLM(model, sharding.make_mesh(), progress=False)._sampling({})[3] == limit


def test_parity_judges_a_small_difference():
    kinds = {"mc": "multiple_choice", "roll": "loglikelihood_rolling", "gen": "generate_until"}
    ref = {"mc": [[(-3.0, False), (-2.0, True)]], "roll": [[-100.0]], "gen": [["to be"]]}
    assert check_eval.compare(ref, ref, kinds)[1]
    for task, nudged in [
        ("mc", [[(-3.0002, False), (-2.0, True)]]),
        ("mc", [[(-3.0, True), (-2.0, True)]]),
        ("roll", [[-100.02]]),
        ("gen", [["to bee"]]),
    ]:
        assert not check_eval.compare({**ref, task: nudged}, ref, kinds)[1], (task, nudged)


def test_local_tasks_are_looked_up_among_the_local_yamls_alone():
    """lm-eval's own ~15k tasks are indexed only where --include_path lacks a task named (that takes
    seconds)."""
    local = lm_eval_py.task_manager(["hellaswag_local"], TASKS).all_tasks
    assert "hellaswag_local" in local and "hellaswag" not in local and len(local) < 20, len(local)
