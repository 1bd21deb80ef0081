"""python -m pytest tests/test_core_eval.py -q

run/core_eval.py and eval.py --tasks=core: nanochat's CORE metric on our models. On a bundle this
test writes in nanochat's layout (each task type, 0 and several shots, delimiters other than ' ',
items cropped to the model's 64 tokens): the prompts as nanochat's templates render them, the
scored spans, and every choice, accuracy and mean loss equal to a straightforward PyTorch scorer on
transformers' GPT2LMHeadModel with the same weights. With NANOCHAT_CHECKOUT=/path/to/nanochat:
nanochat's own evaluate_core, evaluate_example, render and batch functions on the same tasks, the
same torch model and tokenizer. Then the command on a checkpoint, and its one-line errors."""

import json
import os
import random
import sys

import numpy as np
import pytest
import torch
from helpers import assert_close, exit_line, save_ours
from helpers.core_bundle import TASKS, words, write_bundle
from transformers import GPT2LMHeadModel

import eval as eval_py
from archs.models import load_pretrained
from parity.common import pin_numerics, save_random_hf_model
from run import core_eval

BLOCK = 64
# continuations that are the model's own greedy tokens: a random model predicts none of the others
GREEDY = ("lm_greedy", "language_modeling", 0, "", 0.0)


def greedy_items(model, n=10):
    """Contexts whose continuation is the two tokens transformers' GPT-2 predicts after them (those
    whose text tokenizes back to them); every other one given the previous one's: wrong."""
    tok, rng, items = core_eval.GPT2Tokens(), random.Random(5), []
    while len(items) < n:
        context = words(rng, rng.randint(3, 8))
        ids = torch.tensor([tok.encode(context, prepend=tok.get_bos_token_id())])
        for _ in range(2):
            with torch.no_grad():
                ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
        continuation = tok.enc.decode(ids[0, -2:].tolist())
        if tok.encode(context + continuation, prepend=tok.get_bos_token_id()) == ids[0].tolist():
            items.append({"context": context, "continuation": continuation})
    for a, b in zip(items[1::2], items[::2]):
        a["continuation"] = b["continuation"]
    return items


@pytest.fixture(scope="module")
def bundle(tmp_path_factory, models):
    folder = str(tmp_path_factory.mktemp("core") / "eval_bundle")
    return write_bundle(folder, TASKS + [GREEDY], {GREEDY[0]: greedy_items(models[1])})


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Ours and transformers' GPT-2, the same random weights, block_size 64."""
    pin_numerics()
    path = save_random_hf_model(
        str(tmp_path_factory.mktemp("hf")), seed=3, n_layer=2, n_head=2, n_embd=32, n_positions=64
    )
    return load_pretrained(path)[0], GPT2LMHeadModel.from_pretrained(path).eval()


@pytest.fixture(scope="module")
def ours(models, bundle):
    """Every task's TaskResult, scored in batches of 3 rows (batches mix examples and lengths)."""
    scorer = core_eval.Scorer(models[0], batch_size=3)
    tok = core_eval.GPT2Tokens()
    return {
        task.label: core_eval.evaluate_task(scorer, tok, task, core_eval.read_items(bundle, task))
        for task in core_eval.read_tasks(bundle)
    }


def test_prompts_render_as_nanochats_templates():
    """Written out by hand from nanochat's jinja templates: shots joined by a blank line, the
    language-modeling contexts trimmed and the prompt without its continuation stripped."""
    mc = {"query": "Q1", "choices": ["a", "b"], "gold": 1}
    shot = {"query": "Q0 ", "choices": ["x", "y"], "gold": 0}
    assert core_eval.render_prompts("multiple_choice", mc, "\nA: ", [shot, shot]) == [
        "Q0 \nA: x\n\nQ0 \nA: x\n\nQ1\nA: a",
        "Q0 \nA: x\n\nQ0 \nA: x\n\nQ1\nA: b",
    ]
    schema = {"context_options": ["c0", "c1"], "continuation": "end", "gold": 0}
    assert core_eval.render_prompts("schema", schema, " ", [{**schema, "gold": 1}]) == [
        "c1 end\n\nc0 end",
        "c1 end\n\nc1 end",
    ]
    lm = {"context": " ctx  \n", "continuation": "next"}
    assert core_eval.render_prompts("language_modeling", lm, " ", [lm]) == [
        "ctx next\n\nctx",
        "ctx next\n\nctx next",
    ]


def test_spans_are_the_common_prefix_and_suffix():
    tok = core_eval.GPT2Tokens()
    bos = tok.get_bos_token_id()
    tokens, starts, ends = core_eval.token_rows(tok, "multiple_choice", ["Q: red car", "Q: red"])
    assert [t[0] for t in tokens] == [bos, bos] and starts == [len(tok.encode("Q: red")) + 1] * 2
    assert ends == [len(t) for t in tokens]
    tokens, starts, ends = core_eval.token_rows(tok, "schema", ["one dog ran", "two dog ran"])
    assert [e - s for s, e in zip(starts, ends)] == [len(tok.encode(" dog ran"))] * 2
    tokens, starts, ends = core_eval.token_rows(tok, "language_modeling", ["a b", "a b c"])
    assert tokens == [[bos, *tok.encode("a b c")]] and (starts, ends) == ([3], [4])
    # cropped from the left, the spans with it; a continuation that cannot fit is one line
    assert core_eval.crop([[1, 2, 3, 4, 5]], [3], [5], 4) == ([[2, 3, 4, 5]], [2], [4])
    with pytest.raises(core_eval.UsageError, match="a continuation of 4 tokens does not fit"):
        core_eval.crop([[1, 2, 3, 4, 5]], [1], [5], 4)


def torch_scores(model, task, items):
    """The straightforward scorer: each example alone through transformers' GPT-2, its full logits,
    cropped by hand -> (correct, chosen, mean losses) per example."""
    tok = core_eval.GPT2Tokens()
    correct, chosen, losses = [], [], []
    for idx, item in enumerate(items):
        shots = core_eval.fewshot_examples(items, idx, task.num_fewshot)
        prompts = core_eval.render_prompts(task.task_type, item, task.delimiter, shots)
        rows = zip(*core_eval.token_rows(tok, task.task_type, prompts))
        means, all_greedy = [], []
        for t, s, e in rows:
            cut = max(len(t) - BLOCK, 0)
            t, s, e = t[cut:], s - cut, e - cut
            with torch.no_grad():
                logits = model(torch.tensor([t])).logits[0]  # (T, vocab)
            target = torch.tensor(t[s:e])
            loss = torch.nn.functional.cross_entropy(
                logits[s - 1 : e - 1], target, reduction="none"
            )
            means.append(loss.mean().item())
            all_greedy.append(bool((logits[s - 1 : e - 1].argmax(-1) == target).all()))
        if task.task_type == "language_modeling":
            correct.append(all_greedy[0])
            chosen.append(None)
            losses.append([])
        else:
            chosen.append(int(np.argmin(means)))
            correct.append(chosen[-1] == item["gold"])
            losses.append(means)
    return correct, chosen, losses


def test_scores_equal_a_torch_scorer_on_the_same_weights(models, bundle, ours):
    cropped = 0
    for task in core_eval.read_tasks(bundle):
        items = core_eval.read_items(bundle, task)
        correct, chosen, losses = torch_scores(models[1], task, items)
        got = ours[task.label]
        assert got.correct == correct and got.chosen == chosen, task.label
        assert got.accuracy == sum(correct) / len(correct)
        # float32 logits from two implementations, the rows padded to other lengths here: the mean
        # of a few per-token losses of ~10.8 (ln 50257) agrees to a few float32 ulps (eps 1.2e-7)
        # of it; measured 1.8e-7
        for a, b in zip(got.losses, losses):
            assert_close(np.array(a), np.array(b), rtol=1e-6, atol=0, what=task.label)
        tok = core_eval.GPT2Tokens()
        cropped += sum(
            len(t) == BLOCK for ex in core_eval.prepare(tok, task, items, BLOCK) for t in ex.tokens
        )
    assert cropped > 0  # some rows were cut to the model's 64 tokens


def test_a_continuation_the_model_predicts_is_correct(models):
    """language_modeling's test: every continuation token the argmax. A random model predicts none
    of the bundle's, so the continuations here are transformers' GPT-2's own greedy tokens."""
    context = [50256, *core_eval.GPT2Tokens().encode("the cat sat on a mat while rain fell")]
    ids = torch.tensor([context])
    for _ in range(3):
        with torch.no_grad():
            ids = torch.cat([ids, models[1](ids).logits[:, -1:].argmax(-1)], dim=1)
    greedy = ids[0].tolist()
    wrong = greedy[:-1] + [(greedy[-1] + 1) % 50257]
    n = len(context)
    rows = [(greedy, n, n + 3), (wrong, n, n + 3), (wrong, n, n + 2), (greedy[:-1], 2, n + 2)]
    _, all_greedy = core_eval.Scorer(models[0], batch_size=2).score(rows)
    assert all_greedy.tolist() == [True, False, True, False]


@pytest.mark.slow
def test_core_metric_is_the_mean_of_the_centred_accuracies(models, bundle, ours):
    report = core_eval.evaluate_core(
        core_eval.Scorer(models[0], batch_size=4), core_eval.GPT2Tokens(), bundle, out=sys.stderr
    )
    for label, *_, baseline in TASKS + [GREEDY]:
        assert report["results"][label] == ours[label].accuracy
        b = baseline / 100
        assert report["centered_results"][label] == (ours[label].accuracy - b) / (1 - b)
    assert report["core_metric"] == np.mean(list(report["centered_results"].values()))
    # max_per_task: the first N of the same shuffle
    first = core_eval.read_items(bundle, core_eval.read_tasks(bundle)[0])
    assert core_eval.read_items(bundle, core_eval.read_tasks(bundle)[0], 4) == first[:4]
    assert sorted(map(json.dumps, first)) != list(map(json.dumps, first))  # shuffled


# ------------------------------------------------------------------------------------------------
# nanochat's own code


def nanochat():
    checkout = os.environ.get("NANOCHAT_CHECKOUT")
    if not checkout:
        pytest.skip("NANOCHAT_CHECKOUT is not set: nanochat's own core_eval needs its checkout")
    sys.path.insert(0, checkout)
    from nanochat import core_eval as theirs
    from scripts import base_eval

    return theirs, base_eval


ODD = ["", " ", "\n", "\u00a0x\u3000", "{{ item }}", "{% raw %}", "a\r\nb ", "\t", "é ", 7]


def test_prompts_equal_nanochats_render_functions():
    """nanochat's jinja templates and our f-strings on odd text: empty, whitespace of every kind
    (trimmed or not), template syntax, numbers."""
    theirs, _ = nanochat()
    rng = random.Random(0)
    for _ in range(300):
        odd = [rng.choice(ODD) for _ in range(4)]  # a number alone, else two texts
        odd = [o if type(o) is int else o + rng.choice(ODD[:-1]) for o in odd]
        shots = rng.randrange(3)
        delimiter = rng.choice([" ", "", "\n", " :\t", "\nAnswer: "])
        mc = {"query": odd[0], "choices": odd[1:], "gold": rng.randrange(3)}
        schema = {"context_options": odd[:2], "continuation": odd[2], "gold": rng.randrange(2)}
        lm = {"context": odd[0], "continuation": odd[3] or "x"}
        for kind, render, item in [
            ("multiple_choice", theirs.render_prompts_mc, mc),
            ("schema", theirs.render_prompts_schema, schema),
            ("language_modeling", theirs.render_prompts_lm, lm),
        ]:
            ours = core_eval.render_prompts(kind, item, delimiter, [item] * shots)
            assert ours == render(item, delimiter, [item] * shots), (kind, item, delimiter, shots)


class LogitsOnly(torch.nn.Module):
    """transformers' GPT-2 as nanochat's core_eval calls a model: ids -> logits; max_seq_len, its
    crop."""

    def __init__(self, model):
        super().__init__()
        self.model, self.max_seq_len = model, BLOCK

    def forward(self, ids):
        return self.model(ids).logits


def test_nanochats_own_core_eval_agrees(models, bundle, ours, monkeypatch, capsys):
    theirs, base_eval = nanochat()
    model, tok = LogitsOnly(models[1]), core_eval.GPT2Tokens()
    seen = []  # (prompts, token rows, starts, ends) of each of nanochat's batch calls
    for kind in ("mc", "schema", "lm"):
        batch = getattr(theirs, f"batch_sequences_{kind}")

        def recorded(tokenizer, prompts, batch=batch):
            out = batch(tokenizer, prompts)
            seen.append((prompts, *out))
            return out

        monkeypatch.setattr(theirs, f"batch_sequences_{kind}", recorded)
    # evaluate_core reads <base dir>/eval_bundle: the one this test wrote
    monkeypatch.setattr(base_eval, "get_base_dir", lambda: os.path.dirname(bundle))
    report = base_eval.evaluate_core(model, tok, "cpu")
    print(capsys.readouterr().out)
    for task in core_eval.read_tasks(bundle):
        items = core_eval.read_items(bundle, task)
        examples = core_eval.prepare(tok, task, items, BLOCK)
        got = ours[task.label]
        assert np.float32(report["results"][task.label]) == np.float32(got.accuracy), task.label
        for idx, ex in enumerate(examples):
            prompts, tokens, starts, ends = seen.pop(0)
            assert ex.prompts == prompts, (task.label, idx)
            cropped = theirs_crop(tokens, starts, ends)
            assert (ex.tokens, ex.starts, ex.ends) == cropped, (task.label, idx)
            if task.task_type == "language_modeling":
                continue
            # the choice nanochat makes: the gold label that evaluate_example calls correct
            picks = []
            for c in range(len(ex.tokens)):
                data = list(items)
                data[idx] = {**items[idx], "gold": c}
                meta = {
                    "task_type": task.task_type,
                    "num_fewshot": task.num_fewshot,
                    "continuation_delimiter": task.delimiter,
                }
                if theirs.evaluate_example(idx, model, tok, data, "cpu", meta):
                    picks.append(c)
                seen.pop()
            assert picks == [got.chosen[idx]], (task.label, idx)
    assert not seen
    baselines = {label: baseline for label, *_, baseline in TASKS + [GREEDY]}
    core = np.mean([core_eval.centred(r.accuracy, baselines[k]) for k, r in ours.items()])
    # nanochat's accuracies are float32 means (a rounding of 6e-8 at most), centred by / (1 - b)
    assert abs(report["core_metric"] - core) < 2e-7
    print(
        f"nanochat's own evaluate_core: CORE {report['core_metric']:.6f} (ours {core:.6f}), "
        + ", ".join(f"{k} {v:.4f}" for k, v in report["results"].items())
    )


def theirs_crop(tokens, starts, ends):
    """nanochat's rows as its evaluate_example crops them to max_seq_len."""
    cuts = [max(len(t) - BLOCK, 0) for t in tokens]
    return (
        [t[c:] for t, c in zip(tokens, cuts)],
        [s - c for s, c in zip(starts, cuts)],
        [e - c for e, c in zip(ends, cuts)],
    )


# ------------------------------------------------------------------------------------------------
# the command


@pytest.mark.slow
def test_eval_py_core_on_a_checkpoint(models, bundle, ours, tmp_path, capsys):
    out = str(tmp_path / "run")
    save_ours(out, models[0])
    results = str(tmp_path / "core.json")
    argv = [
        "--init_from=resume",
        f"--out_dir={out}",
        "--tasks=core",
        f"--core_bundle={bundle}",
        "--core_tasks=schema_one,lm_zero",
        "--max_per_task=6",
        f"--output={results}",
    ]
    assert eval_py.main(argv) == 0
    printed = capsys.readouterr().out
    saved = json.load(open(results))
    assert list(saved["results"]) == ["schema_one", "lm_zero"]
    assert saved["config"]["step"] == 5 and saved["tasks"]["lm_zero"]["examples"] == 6
    for label in saved["results"]:
        task = next(t for t in core_eval.read_tasks(bundle) if t.label == label)
        scorer = core_eval.Scorer(models[0], batch_size=8)
        items = core_eval.read_items(bundle, task, 6)
        want = core_eval.evaluate_task(scorer, core_eval.GPT2Tokens(), task, items).accuracy
        assert saved["results"][label] == want
        assert f"Evaluating: {label} ({task.num_fewshot}-shot, type: {task.task_type})... " in (
            printed
        )
    assert f"CORE metric: {saved['core_metric']:.4f}" in printed
    assert f"{'CORE':<35}, {'':<10}, {saved['core_metric']:<10.6f}" in printed


@pytest.mark.parametrize(
    "args, error",
    [
        (["--tasks=core"], "--tasks=core needs --core_bundle=DIR"),
        (["--tasks=core,hellaswag", "--core_bundle=x"], "--tasks=core runs alone"),
        (["--tasks=hellaswag", "--max_per_task=3"], "--max_per_task is for --tasks=core"),
        (["--tasks=core", "--core_bundle=x", "--limit=3"], "--limit is for lm-eval's tasks"),
        (["--tasks=core", "--core_bundle=x", "--max_per_task=0"], "--max_per_task must be"),
        (["--tasks=core", "--core_bundle={tmp}/none"], "--core_bundle {tmp}/none is not a folder"),
        (["--tasks=core", "--core_bundle={tmp}"], "{tmp}/core.yaml is missing: a CORE bundle"),
        (["--tasks=core", "--core_bundle={b}", "--core_tasks=nope"], "unknown CORE task 'nope'"),
        (["--tasks=core", "--core_bundle={b}"], "{b}/eval_data/lm_zero.jsonl is missing"),
    ],
)
def test_eval_py_core_errors_are_one_line(args, error, tmp_path, capsys):
    b = write_bundle(str(tmp_path / "b"))
    os.remove(os.path.join(b, "eval_data", "lm_zero.jsonl"))
    fill = {"tmp": str(tmp_path), "b": b}
    code, line = exit_line(lambda: eval_py.main([a.format(**fill) for a in args]), capsys)
    assert code == 2 and line.startswith("error: " + error.format(**fill)), line
