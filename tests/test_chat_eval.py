"""python -m pytest tests/test_chat_eval.py -q

nanochat's chat_eval (run/chat_scoring.py, chat_eval.py) on tiny task files in their hub layout
(tests/helpers/chat_task_files.py) and a tiny nanochat model trained to answer one GSM8K problem
through the calculator (tests/helpers/chat_models.py), saved as a nanochat base directory: the
categorical tasks' predicted letters against a numpy argmax over the model's logits at the answer
position, the generative tasks' outcomes against evaluate() on the engine's greedy completion,
ChatCORE's arithmetic, the script's printed accuracies, and bad input in one line. With
NANOCHAT_CHECKOUT=/path/to/nanochat, nanochat's own run_chat_eval (its scripts/chat_eval.py, its
tasks reading the same rows from its cache layout, its Engine on its GPT holding the same weights,
float32) gives the same letters, completions and accuracies on each task."""

import importlib.util
import os
import shutil
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import REPO, one_torch_thread
from helpers.chat_models import tool_model
from helpers.chat_task_files import write_hub, write_nanochat_cache

import chat_eval
from archs.nanochat import NanochatGPT
from configurator import UsageError
from dataio.chat_tokenizer import SPECIAL_TOKENS, ChatTokenizer
from dataio.conversations import render_for_completion
from dataio.nanochat_checkpoint import save_nanochat
from parity.common import pin_numerics
from run.chat_scoring import CHAT_EVAL_TASKS, ChatScorer, Settings, chatcore, load_tasks

CHECKOUT = os.environ.get("NANOCHAT_CHECKOUT")
# the task texts' merges: every prompt (at most 52 tokens) and prompt + 32 new tokens fit the tiny
# model's 64-token context, where nanochat's engine (no such limit) would go on
VOCAB = 256 + len(SPECIAL_TOKENS) + 400
# 3 problems a forward: each task's 4 problems are a full batch and one padded with <|bos|> rows
SETTINGS = Settings(batch_size=3, max_new_tokens=32)
CATEGORICAL = ("ARC-Easy", "ARC-Challenge", "MMLU")
TAUGHT = "What is 7 minus 9?"  # the GSM8K test question the model learns to answer, by the tool


@pytest.fixture(scope="module", autouse=True)
def numerics():
    pin_numerics()
    with one_torch_thread():
        yield


def task_texts(tasks):
    """Every string in the tasks' conversations: the tokenizer's training text."""
    texts = []
    for task in tasks.values():
        for conversation in task:
            for message in conversation["messages"]:
                content = message["content"]
                texts += [content] if isinstance(content, str) else [p["text"] for p in content]
    return texts


class Chat:
    """The tasks, the tokenizer, the trained model (nanochat's config fields and state dict, and
    ours) and the folders: tasks/ in the hub layout; nanochat/, a base directory holding
    tokenizer/ and the model in chatsft_checkpoints/d2."""

    def __init__(self, root):
        self.tasks_dir = write_hub(str(root / "tasks"))
        self.tasks = load_tasks(CHAT_EVAL_TASKS, self.tasks_dir)
        self.tokenizer = ChatTokenizer.train(iter(task_texts(self.tasks) * 4), VOCAB)
        gsm8k = self.tasks["GSM8K"]
        self.taught = next(i for i, c in enumerate(gsm8k) if TAUGHT in c["messages"][0]["content"])
        self.config, self.state = tool_model(self.tokenizer, gsm8k[self.taught])
        self.model = NanochatGPT.from_nanochat(self.config, self.state)
        self.base = root / "nanochat"
        self.tokenizer.save(str(self.base / "tokenizer"), token_bytes_pt=False)
        self.checkpoint = self.base / "chatsft_checkpoints" / "d2"
        save_nanochat(self.model, str(self.checkpoint), 0, {})
        self.scorer = ChatScorer(self.model, self.tokenizer, quiet=True)


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    return Chat(tmp_path_factory.mktemp("chat_eval"))


def numpy_letters(chat, task):
    """Each problem's letter whose logit is largest after <|assistant_start|>, by numpy, from the
    model's whole-sequence logits of the prompt alone, zeros after it to the context's end (the
    causal model never sees them: one shape, one compilation)."""
    forward = nnx.jit(lambda model, ids: model(ids)[0])  # (1, T, V)
    letters = []
    for conversation in task:
        prompt = render_for_completion(chat.tokenizer, conversation)
        ids = np.zeros((1, chat.model.config.block_size), np.int32)
        ids[0, : len(prompt)] = prompt
        last = np.asarray(forward(chat.model, jnp.asarray(ids)))[0, len(prompt) - 1]  # (V,)
        choices = conversation["letters"]
        letters.append(
            choices[int(np.argmax(last[[chat.tokenizer.encode(x)[0] for x in choices]]))]
        )
    return letters


def test_categorical_is_the_argmax_of_the_letters_logits(chat):
    for name in CATEGORICAL:
        task = chat.tasks[name]
        expected = numpy_letters(chat, task)
        assert chat.scorer.predicted_letters(task, SETTINGS.batch_size) == expected, name
        passed = [task.evaluate(c, letter) for c, letter in zip(task, expected)]
        assert chat.scorer.outcomes(task, SETTINGS) == passed
        assert chat.scorer.accuracy(task, SETTINGS) == sum(passed) / len(passed)
    # max_problems: the first problems only
    task = chat.tasks["MMLU"]
    assert chat.scorer.predicted_letters(task, 3, max_problems=2) == numpy_letters(chat, task)[:2]


def test_generative_at_temperature_0_is_evaluate_on_the_greedy_completion(chat):
    for name in ("GSM8K", "HumanEval"):
        task = chat.tasks[name]
        expected = []
        for conversation in task:
            prompt = render_for_completion(chat.tokenizer, conversation)
            (row,), _ = chat.scorer.engine.generate_batch(prompt, max_tokens=32, temperature=0)
            expected.append(task.evaluate(conversation, chat.tokenizer.decode(row[len(prompt) :])))
        assert chat.scorer.outcomes(task, SETTINGS) == expected, name
    # the taught problem passes, its answer computed by the calculator; the others fail
    gsm8k = chat.tasks["GSM8K"]
    completion = chat.scorer.completions(gsm8k[chat.taught], SETTINGS)[0]
    assert "<|python_start|>7-9<|python_end|><|output_start|>-2<|output_end|>" in completion
    assert completion.endswith("#### -2")
    passed = [i == chat.taught for i in range(len(gsm8k))]
    assert chat.scorer.outcomes(gsm8k, SETTINGS) == passed


def test_chatcore_is_the_mean_centered_accuracy_over_all_five_tasks():
    accuracies = {"ARC-Easy": 0.5, "ARC-Challenge": 0.25, "MMLU": 1.0, "GSM8K": 0.5, "HumanEval": 0}
    # ARC and MMLU guess one of 4 (baseline 0.25), GSM8K and HumanEval guess nothing (0)
    assert chatcore(accuracies) == pytest.approx((0.25 / 0.75 + 0 + 1 + 0.5 + 0) / 5, rel=1e-15)
    assert chatcore({**accuracies, "SpellingBee": 1.0}) == pytest.approx(
        (0.25 / 0.75 + 0 + 1 + 0.5 + 0 + 1) / 6, rel=1e-15
    )  # a task beyond the five counts too, as in chat_eval
    del accuracies["HumanEval"]
    assert chatcore(accuracies) is None


@pytest.mark.slow
def test_the_script_prints_each_accuracy_and_chatcore(chat, capsys):
    argv = [
        f"--init_from={chat.checkpoint}",
        f"--tasks_dir={chat.tasks_dir}",
        "--batch_size=3",
        "--max_new_tokens=32",
        "--dtype=float32",
    ]
    assert chat_eval.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    accuracies = {
        name: chat.scorer.accuracy(chat.tasks[name], SETTINGS) for name in CHAT_EVAL_TASKS
    }
    printed = [line for line in out if " accuracy: " in line]
    assert printed == [f"{name} accuracy: {100 * acc:.2f}%" for name, acc in accuracies.items()]
    assert out[-1] == f"ChatCORE metric: {chatcore(accuracies):.4f}"
    assert "Final: 1/3 (33.33%)" in out  # GSM8K: the taught problem


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tasks=ARC-Easy,Nope"], "no chat_eval task 'Nope': give --tasks as a comma-separated"),
        (["--batch_size=0"], "batch_size must be an integer >= 1, got 0"),
        (["--max_problems=0"], "max_problems must be an integer >= 1 or None, got 0"),
        (
            ["--tasks_dir=EMPTY"],
            "has no folder ai2_arc: download it with hf download allenai/ai2_arc",
        ),
        (["--init_from=BARE"], "no tokenizer/tokenizer.pkl is in"),
        (["--init_from=BARE", "--tokenizer=EMPTY"], "no tokenizer at"),
    ],
    ids=["unknown task", "batch", "max_problems", "no task files", "no tokenizer", "bad tokenizer"],
)
def test_bad_input_is_one_line(chat, tmp_path, argv, message):
    # a checkpoint directory with no tokenizer beside it or two folders up
    bare = tmp_path / "a" / "b" / "d2"
    shutil.copytree(chat.checkpoint, bare)
    (tmp_path / "empty").mkdir()
    places = {"EMPTY": str(tmp_path / "empty"), "BARE": str(bare)}
    argv = [
        arg.split("=")[0] + "=" + places.get(arg.split("=")[1], arg.split("=")[1]) for arg in argv
    ]
    defaults = [f"--init_from={chat.checkpoint}", f"--tasks_dir={chat.tasks_dir}"]
    with pytest.raises(UsageError) as error:
        chat_eval.main(defaults + argv)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_the_command_says_bad_input_in_one_line_and_exits_2(chat):
    script = os.path.join(REPO, "chat_eval.py")
    r = subprocess.run(
        [sys.executable, script, f"--tasks_dir={chat.tasks_dir}", "--tasks=X"],
        capture_output=True, text=True, cwd=REPO,
    )  # fmt: skip
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().count("\n") == 0 and "no chat_eval task 'X'" in r.stderr


def nanochat_chat_eval(checkout):
    """nanochat's scripts/chat_eval.py as a module (its main runs only as a script)."""
    spec = importlib.util.spec_from_file_location(
        "nanochat_chat_eval", os.path.join(checkout, "scripts", "chat_eval.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_nanochats_own_chat_eval_scores_the_same(chat, tmp_path, monkeypatch):
    if not CHECKOUT:
        pytest.skip("NANOCHAT_CHECKOUT is not set: nanochat's own chat_eval needs its checkout")
    from parity.check_nanochat import OwnCode

    own = OwnCode(CHECKOUT)  # its GPT in float32, the checkout on sys.path
    from nanochat.tokenizer import RustBPETokenizer

    base = write_nanochat_cache(str(tmp_path))  # the same rows where its tasks look
    monkeypatch.setenv("NANOCHAT_BASE_DIR", base)
    theirs = nanochat_chat_eval(CHECKOUT)
    tokenizer = RustBPETokenizer.from_directory(str(chat.base / "tokenizer"))
    model = own.model(chat.config, chat.state)
    engine = own.engine.Engine(model, tokenizer)
    answers = []  # each evaluate's completion: the predicted letter, or the decoded completion
    for task_class in (theirs.ARC, theirs.MMLU, theirs.GSM8K, theirs.HumanEval):
        judge = task_class.evaluate
        monkeypatch.setattr(
            task_class,
            "evaluate",
            lambda self, c, a, judge=judge: answers.append(a) or judge(self, c, a),
        )
    for name in CHAT_EVAL_TASKS:
        answers.clear()
        accuracy = theirs.run_chat_eval(
            name, model, tokenizer, engine, batch_size=3, num_samples=1, max_new_tokens=32,
            temperature=0.0, top_k=50,
        )  # fmt: skip
        task = chat.tasks[name]
        if name in CATEGORICAL:
            ours = chat.scorer.predicted_letters(task, SETTINGS.batch_size)
        else:
            ours = [chat.scorer.completions(c, SETTINGS)[0] for c in task]
        assert answers == ours, name
        assert accuracy == chat.scorer.accuracy(task, SETTINGS), name
