"""eval.py: lm-evaluation-harness on our model, equal to lm-eval's own hf model; offline, on
eval_tasks/'s tasks."""

import itertools
import json
import os
import pickle
import re
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import REPO, fake_devices, run, transpose_c_proj_on_restore
from lm_eval.api.instance import Instance

import eval as lm_eval_py
import export
import hellaswag
import runlog
import sharding
from configurator import UsageError, exit_on_bad_input
from model import GPT, GPTConfig
from models import load_pretrained
from parity import check_eval
from parity import nanogpt_reference as nanogpt
from parity.common import save_random_hf_model
from tokenizer import EOT, get_encoding, save_hf_tokenizer

TASKS = os.path.join(REPO, "eval_tasks")
TINY_HF = dict(n_layer=2, n_head=2, n_embd=32, n_positions=64)


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    return save_random_hf_model(str(tmp_path_factory.mktemp("hf")), seed=1, **TINY_HF)


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory):
    """train.py's checkpoint of a tiny GPT-2-vocabulary model (2 steps on Shakespeare's BPE
    tokens)."""
    data = tmp_path_factory.mktemp("bpe")
    with open(os.path.join(REPO, "data", "shakespeare_char", "input.txt")) as f:
        ids = np.array(get_encoding().encode_ordinary(f.read()[:60000]), np.uint16)
    ids[:-2000].tofile(data / "train.bin")
    ids[-2000:].tofile(data / "val.bin")
    out = str(tmp_path_factory.mktemp("run"))
    # exact: nanoGPT's, for its export
    run(str(data), out, "--max_iters=2", "--block_size=64", "--gelu=exact")
    return out


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

    from tokenizer import BPE_FILE

    default = TikTokenConverter(vocab_file=str(BPE_FILE)).converted()
    assert default.encode("He said 1234567 times").ids != get_encoding().encode(
        "He said 1234567 times"
    )


def test_padded_lengths_are_few_and_pad_least():
    rng = np.random.default_rng(0)
    for _ in range(30):
        needs = sorted(rng.integers(1, 40, rng.integers(1, 12)).tolist())
        k = int(rng.integers(1, 5))
        got = lm_eval_py.padded_lengths(needs, k)
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


def test_continuation_scores_in_chunks_equal_the_logits_at_once():
    """Past SCORE_CHUNK positions the log-probabilities are summed chunk by chunk: equal to those of
    all the logits at once, padding (-1) left out; greedy where every target is the argmax (row 1's
    are, row 0's are not)."""
    model = GPT(
        GPTConfig(block_size=64, vocab_size=96, n_layer=1, n_head=2, n_embd=32), nnx.Rngs(0)
    )
    rng = np.random.default_rng(0)
    R, L, E = 2, 64, 2 * lm_eval_py.SCORE_CHUNK  # positions may repeat: E > L
    tokens = rng.integers(0, 96, (R, L))
    pos = rng.integers(0, L, (R, E))
    # (R, E, V)
    logits = np.asarray(model(jnp.asarray(tokens))[0], np.float64)[np.arange(R)[:, None], pos]
    targets = rng.integers(0, 96, (R, E))
    targets[1] = logits[1].argmax(-1)
    targets[:, -40:] = -1
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    want = np.take_along_axis(logp, np.maximum(targets, 0)[..., None], -1)[..., 0]
    sums, greedy = lm_eval_py.continuation_scores(
        model, *(jnp.asarray(a) for a in (tokens, pos, targets))
    )
    np.testing.assert_allclose(sums, np.where(targets >= 0, want, 0).sum(-1), rtol=1e-5)
    assert greedy.tolist() == [False, True]


def test_a_request_one_token_too_long_is_cut_by_one_from_the_left(tiny_hf, capsys):
    """block_size + 1 tokens fit (the last is only a target); one more and the context's first token
    goes, as lm-eval's hf model cuts it, and the cut is said."""
    lm = lm_eval_py.JaxLM(
        load_pretrained(tiny_hf)[0], sharding.make_mesh(), batch_size=3, progress=False
    )
    context, continuation = list(range(100, 161)), [7, 8, 9, 10, 11]  # 61 + 5 = block_size 64 + 2
    scores = lm._loglikelihood_tokens(
        [
            (None, context[1:], continuation),
            (None, context, continuation),
            (None, context[2:], continuation),
        ]
    )
    assert scores[1] == scores[0] != scores[2]
    assert re.search(
        r"(^|\n)1 of 3 requests longer than block_size 64: context cut from the left, as lm-eval's "
        r"hf model cuts it\n",
        capsys.readouterr().err,
    )
    for n in (0, 65):
        with pytest.raises(
            UsageError, match=rf"^a continuation of {n} tokens: it must be 1 to block_size 64$"
        ):
            lm._loglikelihood_tokens([(None, [1, 2], list(range(n)))])
    # batched by length: the short rows in a short batch (unsorted, each batch would hold a long
    # row)
    lm._loglikelihood_tokens(
        [(None, context[55 if i % 2 else 1 :], continuation) for i in range(6)]
    )
    assert (
        "6 requests in 2 batches of 3 rows, padded to 2 lengths [16, 64]" in capsys.readouterr().err
    )


def test_scoring_shows_a_progress_bar_of_its_requests_unless_off(tiny_hf, capsys):
    """loglikelihood and loglikelihood_rolling (which scores a document's windows as requests) count
    what they score on a bar, unless progress is off or lm-eval disables it."""
    lm = lm_eval_py.JaxLM(
        load_pretrained(tiny_hf)[0], sharding.make_mesh(), batch_size=2, progress=True
    )
    pairs = [Instance("loglikelihood", {}, ("To be, or not", " to be"), 0)] * 3
    documents = [
        Instance(
            "loglikelihood_rolling", {}, ("To be, or not to be: that is the question. " * 12,), 0
        )
    ]
    quiet = lm_eval_py.JaxLM(lm.model, sharding.make_mesh(), batch_size=2, progress=False)
    for score, requests in [("loglikelihood", pairs), ("loglikelihood_rolling", documents)]:
        first = getattr(lm, score)(requests)
        # the document: 157 tokens, 3 windows
        assert re.search(r"loglikelihood: 100%.* 3/3 .*req/s", capsys.readouterr().err), score
        for scorer, disable_tqdm in [(quiet, False), (lm, True)]:
            assert getattr(scorer, score)(requests, disable_tqdm) == first
            assert not re.search(r"loglikelihood: +\d+%", capsys.readouterr().err), (
                score,
                disable_tqdm,
            )


def test_long_continuations_are_scored_in_chunks_as_the_whole_logits_score_them():
    """A continuation longer than SCORE_CHUNK, through JaxLM: its log-probability equals numpy's
    from the logits of the whole input, and it is greedy where every token is the argmax."""
    model = GPT(
        GPTConfig(block_size=192, vocab_size=96, n_layer=1, n_head=2, n_embd=32), nnx.Rngs(0)
    )
    lm = lm_eval_py.JaxLM(model, sharding.make_mesh(), batch_size=2, progress=False)
    C, n = 20, lm_eval_py.SCORE_CHUNK + 12  # context and continuation tokens
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


def test_generate_until_stops_at_endoftext_and_refuses_what_cannot_fit():
    """A text ends at <|endoftext|> (here the model's every token); one request is a batch of its
    own (the filler rows repeat it); a task asking for block_size new tokens or more is one line."""
    lm = lm_eval_py.JaxLM(one_token_model(), sharding.make_mesh(), batch_size=2, progress=False)

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


def test_generate_until_ends_each_text_at_its_tasks_strings_and_cuts_long_contexts_from_the_left(
    capsys,
):
    """A text ends where the first of its request's `until` strings begins; a request without
    max_gen_toks gets the model's; a context with no room for the new tokens loses its first tokens,
    and the cut is said. A progress bar counts the requests, unless progress is off or lm-eval
    disables it."""
    (the,) = get_encoding().encode(" the")
    lm = lm_eval_py.JaxLM(one_token_model(the), sharding.make_mesh(), batch_size=2, progress=True)
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
    quiet = lm_eval_py.JaxLM(lm.model, sharding.make_mesh(), batch_size=2, progress=False)
    for generator, disable_tqdm in [(quiet, False), (lm, True)]:
        assert generator.generate_until(requests[:1], disable_tqdm) == [" th"]
        assert "generate_until:" not in capsys.readouterr().err


def test_a_tasks_sampling_settings_are_the_generations():
    """lm-eval's gen_kwargs as generate_in_jit's sampling: greedy unless do_sample, then its
    temperature (none given: 0, greedy), top_k and top_p (1.0: none), and no id past GPT-2's 50257
    (a padded vocabulary's) or the model's."""
    lm = lm_eval_py.JaxLM(one_token_model(), sharding.make_mesh(), progress=False)
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
        assert (
            lm_eval_py.JaxLM(model, sharding.make_mesh(), progress=False)._sampling({})[3] == limit
        )


def test_parity_with_lm_eval_hf_model_on_each_output_type(tiny_hf, capsys):
    """multiple choice, rolling loglikelihood and generate_until: every request as lm-eval's hf
    model (fp32)."""
    assert check_eval.main([f"--init_from={tiny_hf}", "--limit=4"]) == 0
    out = capsys.readouterr().out
    assert "fp32 parity (loglikelihoods, is_greedy, rolling, texts, accuracies): OK" in out
    assert re.search(r"4/4 texts equal, [1-4] non-empty", out), out


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


def test_eval_on_a_train_py_checkpoint_and_its_exports(bpe_run, tmp_path, capsys):
    out = tmp_path / "results.json"
    assert (
        lm_eval_py.main(
            [
                f"--out_dir={bpe_run}",
                "--init_from=resume",
                "--tasks=hellaswag_local",
                f"--include_path={TASKS}",
                "--limit=3",
                "--num_fewshot=1",
                "--log_samples=True",
                "--bootstrap_iters=0",
                "--batch_size=4",
                f"--output={out}",
                "--seed=7",
            ]
        )
        == 0
    )
    printed = capsys.readouterr()
    assert f"\nwrote {out}\n" in printed.err and "wrote" not in printed.out
    lines = out.read_text().splitlines()
    assert lines[0] == "{" and re.match(r'^  "\w', lines[1]), lines[:2]  # indented by 2
    # 3 examples x 4 endings
    assert "loglikelihood: 12 requests in 3 batches of 4 rows" in printed.err
    assert re.search(r"loglikelihood: 100%.* 12/12 ", printed.err), printed.err  # a progress bar
    assert "hellaswag_local" in printed.out and "acc_norm" in printed.out  # lm-eval's table
    results = json.loads(out.read_text())
    assert (
        results["config"]["model_args"]["step"] == 2 and results["config"]["bootstrap_iters"] == 0
    )
    assert results["config"]["model"] == "nanogpt-jax"
    assert [
        results["config"][f"{name}_seed"] for name in ("random", "numpy", "torch", "fewshot")
    ] == [7] * 4
    assert results["config"]["model_args"]["model_config"]["n_embd"] == 32
    assert (
        results["n-shot"]["hellaswag_local"] == 1
        and results["n-samples"]["hellaswag_local"]["effective"] == 3
    )
    sample = results["samples"]["hellaswag_local"][0]
    assert len(sample["arguments"]) == 4  # four choices
    context = sample["arguments"][0][0]
    assert context.count("\n\n") == 1  # one example before the question
    assert printed.err.count("cut from the left") <= 1  # said once per call, if at all
    # what was loaded and how long it took: the model's size in millions, the mesh, then the
    # evaluation's time
    n_params = lm_eval_py.load_bpe_model("resume", bpe_run, "float32", lm_eval_py.NOT_BPE)[
        0
    ].num_params()
    assert f"(step 2): {n_params / 1e6:.2f}M params, block_size 64, loaded in " in printed.err, (
        printed.err
    )
    assert "mesh {'data': 1, 'fsdp': 1, 'tensor': 1}" in printed.err
    assert "compiled shapes so far: " in printed.err
    times = re.search(
        r"loaded in (\d+\.\d)s; .*\nevaluated in (\d+\.\d)s, [1-9]\d* compiled shapes\n",
        printed.err,
        re.S,
    )
    assert times and all(0 <= float(t) < 600 for t in times.groups()), printed.err

    export.main([f"--out_dir={bpe_run}", "--format=nanogpt", f"--to={tmp_path / 'nano'}"])
    export.main([f"--out_dir={bpe_run}", f"--to={tmp_path / 'hf'}"])
    # the HF directory's evaluated as a group of the one task: lm-eval's table of groups is printed
    # too eval_tasks/'s files (linked: local_data.py finds its data beside its own path)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    for name in os.listdir(TASKS):
        os.symlink(os.path.join(TASKS, name), tasks / name)
    (tasks / "local_group.yaml").write_text(
        "group: local_group\ntask: [hellaswag_local]\naggregate_metric_list:\n"
        "  - {metric: acc, aggregation: mean, weight_by_size: true}\n"
    )
    for exported, task in (
        (tmp_path / "nano" / "ckpt.pt", "hellaswag_local"),
        (tmp_path / "hf", "local_group"),
    ):
        assert (
            lm_eval_py.main(
                [
                    f"--init_from={exported}",
                    f"--tasks={task}",
                    f"--include_path={tasks}",
                    "--limit=3",
                    "--num_fewshot=1",
                    "--bootstrap_iters=0",
                    f"--output={out}",
                    "--dtype=auto",
                    "--seed=7",
                ]
            )
            == 0
        )
        again = json.loads(out.read_text())
        assert again["results"]["hellaswag_local"] == results["results"]["hellaswag_local"], (
            exported
        )
        assert "samples" not in again  # log_samples off: lm-eval's default is on
    printed = capsys.readouterr()
    # dtype auto: float32 on a CPU
    assert printed.err.count("; jax float32 on 1 cpu device(s), mesh") == 2
    # no step: an HF directory
    assert f"model {tmp_path / 'hf'}: {n_params / 1e6:.2f}M params" in printed.err
    assert len(re.findall(r"^\|\s*Groups\s*\|", printed.out, re.M)) == 1, printed.out


def test_parity_reads_our_checkpoint_by_its_own_path(bpe_run, monkeypatch, capsys):
    """check_eval on train.py's checkpoint: lm-eval's hf model gets the weights through
    parity/torch_side.py (orbax's own reader), so a matrix that our loader transposes (layer 0's
    square attn.c_proj) is a mismatch."""
    argv = [
        "--init_from=resume",
        f"--out_dir={bpe_run}",
        "--tasks=hellaswag_local",
        f"--include_path={TASKS}",
        "--limit=1",
    ]
    assert check_eval.main(argv) == 0
    transpose_c_proj_on_restore(monkeypatch)
    capsys.readouterr()
    assert check_eval.main(argv) == 1
    assert (
        "fp32 parity (loglikelihoods, is_greedy, rolling, texts, accuracies): NOT OK"
        in capsys.readouterr().out
    )


def test_local_tasks_are_looked_up_among_the_local_yamls_alone():
    """lm-eval's own ~15k tasks are indexed only where --include_path lacks a task named (that takes
    seconds)."""
    local = lm_eval_py.task_manager(["hellaswag_local"], TASKS).all_tasks
    assert "hellaswag_local" in local and "hellaswag" not in local and len(local) < 20, len(local)


def test_bad_input_is_one_line(tiny_hf, tmp_path, capsys, monkeypatch):
    def fails(match, *argv):
        with pytest.raises(UsageError, match=match):
            lm_eval_py.main(list(argv))

    fails(
        r"^unknown task 'hellaswag_locall' \(did you mean hellaswag_local(, [\w.-]+)*\?\) "
        r"\(lm-eval's tasks",
        f"--init_from={tiny_hf}",
        "--tasks=hellaswag_local,hellaswag_locall",
        f"--include_path={TASKS}",
    )  # each task of the list looked up
    fails(
        r"^unknown task 'qqqzzz' \(lm-eval's tasks: python -m lm_eval ls tasks; local YAMLs: "
        r"--include_path=DIR\)$",
        "--tasks=qqqzzz",
    )  # nothing close: no guess
    fails("batch_size must be an integer >= 1", "--tasks=hellaswag_local", "--batch_size=0")
    fails(
        r"^--tasks is required: lm-eval task names, comma-separated \(e\.g\. "
        r"--tasks=hellaswag,arc_easy\)$",
        f"--init_from={tiny_hf}",
    )
    fails("limit", "--tasks=x", "--limit=0")
    # a float is a fraction: 1.0 is none
    fails(r"fraction in \(0, 1\), got 1\.0$", "--tasks=x", "--limit=1.0")
    fails(
        r"^--limit must be an integer >= 1 \(documents\) or a fraction in \(0, 1\), got 0\.0$",
        "--tasks=x",
        "--limit=0.0",
    )
    fails(r"^--num_fewshot must be an integer >= 0, got -1$", "--tasks=x", "--num_fewshot=-1")
    # zero-shot: taken
    lm_eval_py.check_settings({**lm_eval_py.defaults, "tasks": "x", "num_fewshot": 0})
    # as `python eval.py ...` runs
    monkeypatch.setattr(sys, "argv", ["eval.py", "--batch_size=0", "--tasks=x"])
    with pytest.raises(UsageError, match=r"^--batch_size must be an integer >= 1, got 0$"):
        lm_eval_py.main()
    for limit in (0.5, 1):  # half of each task, its first document: taken
        lm_eval_py.check_settings({**lm_eval_py.defaults, "tasks": "x", "limit": limit})
    fails(
        rf"^--include_path {re.escape(str(tmp_path / 'none'))} is not a directory of task YAMLs$",
        "--tasks=x",
        f"--include_path={tmp_path / 'none'}",
    )
    # more ways than this process's one device, each setting named as given
    fails(
        r"^fsdp=1 x tensor_parallel=2 must be positive and divide the 1 device",
        f"--init_from={tiny_hf}",
        "--tasks=hellaswag_local",
        f"--include_path={TASKS}",
        "--tensor_parallel=2",
    )
    # a results file that could not be written is refused before anything is loaded or evaluated
    # (issue 33)
    fails(
        r"^--output=.*/no/such/r\.json: its directory .*/no/such does not exist: create it, or "
        r"give another path$",
        f"--init_from={tiny_hf}",
        "--tasks=hellaswag_local",
        f"--include_path={TASKS}",
        f"--output={tmp_path / 'no' / 'such' / 'r.json'}",
    )
    fails(r"^--output=.* is a directory", "--tasks=x", f"--output={tmp_path}")
    # and written whole: a write that fails all the same is one line, after the results were printed
    runlog.write_results(str(tmp_path / "r.json"), "{}", "--output")
    assert os.listdir(tmp_path) == ["r.json"]
    with pytest.raises(
        UsageError, match=r"could not be written \(No such file or directory\); the results are "
    ):
        runlog.write_results(str(tmp_path / "gone" / "r.json"), "{}", "--output")
    fails(
        "no checkpoint|not found",
        "--init_from=resume",
        f"--out_dir={tmp_path / 'none'}",
        "--tasks=hellaswag_local",
        f"--include_path={TASKS}",
    )
    # a nanoGPT ckpt.pt of shakespeare_char: its meta.pkl beside it
    with open(tmp_path / "meta.pkl", "wb") as f:
        pickle.dump(
            {
                "vocab_size": 64,
                "itos": {i: chr(32 + i) for i in range(64)},
                "stoi": {chr(32 + i): i for i in range(64)},
            },
            f,
        )
    config = nanogpt.GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=32)
    nanogpt.save_ckpt(nanogpt.GPT(config), tmp_path / "ckpt.pt", config={"dataset": str(tmp_path)})
    fails(
        r"ckpt\.pt is a character-level model \(a vocabulary of 64 characters\): lm-eval's tasks "
        r"are text in GPT-2's BPE, give a GPT-2 model$",
        f"--init_from={tmp_path / 'ckpt.pt'}",
        "--tasks=hellaswag_local",
        f"--include_path={TASKS}",
    )
    with pytest.raises(
        UsageError,
        match=r"ckpt\.pt is a character-level model \(a vocabulary of 64 characters\): "
        # hellaswag.py's reason
        r"HellaSwag is scored in GPT-2's BPE, give a GPT-2 model$",
    ):
        hellaswag.load_model(str(tmp_path / "ckpt.pt"), "out")
    # the command: one line, exit 2 (exit_on_bad_input, as `python eval.py` runs main)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        exit_on_bad_input(lambda: lm_eval_py.main(["--tasks=hellaswag_local", "--batch_size=0"]))
    err = capsys.readouterr().err
    assert (
        e.value.code == 2
        and err.startswith("error: ")
        and "batch_size" in err
        and err.count("\n") == 1
    ), err


MESH_SCRIPT = """
import json, sys
import jax, numpy as np
from lm_eval.api.instance import Instance
import eval as ev, sharding
from models import load_pretrained
model, _ = load_pretrained(sys.argv[1])
text = open("data/shakespeare_char/input.txt").read()
ll = [Instance("loglikelihood", {}, (text[i: i + 5 + i % 40], text[i + 400: i + 420]), 0) for i in range(0, 5000, 250)]
roll = [Instance("loglikelihood_rolling", {}, (text[i: i + 600],), 0) for i in (0, 3000)]
gen = [Instance("generate_until", {}, (text[i: i + 60 + i % 40], {"until": ["\\n"], "max_gen_toks": 8}), 0)
       for i in range(0, 1200, 400)]
out = {}
for name, mesh in [("one", sharding.make_mesh(devices=jax.devices()[:1])), ("fsdp2", sharding.make_mesh(fsdp=2))]:
    lm = ev.JaxLM(model, mesh, batch_size=2, progress=False)
    out[name] = [lm.loglikelihood(ll, True), lm.loglikelihood_rolling(roll, True), lm.generate_until(gen, True),
                 dict(mesh.shape)]
print(json.dumps(out))
"""  # noqa: E501


@pytest.mark.slow  # a mesh computes what one device does: make test checks it (test_sharding.py)
def test_an_8_device_mesh_with_fsdp_gives_one_devices_numbers(tiny_hf):
    env = fake_devices(8)
    result = subprocess.run(
        [sys.executable, "-c", MESH_SCRIPT, tiny_hf],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    (ll1, roll1, gen1, _), (ll8, roll8, gen8, shape) = out["one"], out["fsdp2"]
    assert shape == {"data": 4, "fsdp": 2, "tensor": 1}
    np.testing.assert_allclose([x[0] for x in ll8], [x[0] for x in ll1], rtol=1e-5)
    assert [x[1] for x in ll8] == [x[1] for x in ll1]
    np.testing.assert_allclose(roll8, roll1, rtol=1e-5)
    assert gen8 == gen1 and any(gen1)
