"""python -m pytest tests/test_chat_tasks.py -q

nanochat's chat tasks read from local files (dataio/chat_tasks.py, hub_tasks.py, spelling_tasks.py),
on tiny files in each dataset's published format (tests/helpers/chat_task_files.py): each task's
conversations (hand-worked ones for a row of each), its eval_type, evaluate on right and wrong
answers (HumanEval's through the sandbox), the rows in the order of `datasets`' seeded shuffle, the
mixture's order against nanochat's pairs shuffled as it shuffles them, slicing, rendering, and each
file in another format refused in one line naming the fix. With NANOCHAT_CHECKOUT=/path/to/nanochat,
nanochat's own task classes (CustomJSON and the spelling tasks from its history) read the same rows
from its own cache layout and give the same conversations, mixture order and evaluations."""

import json
import os
import random

import numpy as np
import pytest
from helpers import chat_task_files as files

from configurator import InputNotFound, UsageError
from dataio.chat_tasks import CustomJSON, Task, TaskMixture, TaskSequence
from dataio.chat_tokenizer import SPECIAL_TOKENS, ChatTokenizer
from dataio.conversations import render_conversation
from dataio.hub_tasks import ARC, GSM8K, MMLU, HumanEval, SmolTalk, extract_answer
from dataio.spelling_tasks import SimpleSpelling, SpellingBee
from dataio.task_folder import CHAT_EVAL_BASELINES, chat_eval_task, sft_mixtures
from run.sandbox import run_python


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    return files.write_hub(str(tmp_path_factory.mktemp("hub")))


def shuffled(rows):
    """The rows as `datasets.Dataset.shuffle(seed=42)` orders them (numpy's default_rng(42)
    permutation), which nanochat's tasks take from the hub."""
    return [rows[i] for i in np.random.default_rng(42).permutation(len(rows))]


def test_the_shuffle_is_datasets_own():
    datasets = pytest.importorskip("datasets", reason="HF datasets is not installed")
    rows = [{"i": i} for i in range(37)]
    assert [r["i"] for r in datasets.Dataset.from_list(rows).shuffle(seed=42)] == [
        r["i"] for r in shuffled(rows)
    ]


def test_arc_and_mmlu_are_multiple_choice(hub):
    t = files.tasks_in(hub)
    arc = t["arc_easy"]
    assert arc.eval_type == "categorical" and len(arc) == 4
    rows = shuffled(files.ARC_ROWS)
    conversation = arc[rows.index(files.ARC_ROWS[1])]
    assert conversation == {
        "messages": [
            {
                "role": "user",
                "content": "Multiple Choice question: What is the boiling point of water at sea "
                "level?\n- 50 C=1\n- 100 C=2\n- 150 C=3\n\nRespond only with the letter of the "
                "correct answer.",
            },
            {"role": "assistant", "content": "2"},
        ],
        "letters": ["1", "2", "3"],
    }
    assert arc.evaluate(conversation, "2") and not arc.evaluate(conversation, "3")
    with pytest.raises(UsageError, match="none of the letters"):
        arc.evaluate(conversation, "D")
    assert [c["messages"][1]["content"] for c in arc] == [r["answerKey"] for r in rows]

    mmlu = t["mmlu"]
    assert mmlu.eval_type == "categorical" and len(mmlu) == 5
    rows = shuffled(files.MMLU_ROWS)
    first = mmlu[0]
    assert first["messages"][0]["content"] == (
        f"Multiple Choice question: {rows[0]['question']}\n"
        + "".join(f"- {c}={'ABCD'[k]}\n" for k, c in enumerate(rows[0]["choices"]))
        + "\nRespond only with the letter of the correct answer."
    )
    assert first["letters"] == ("A", "B", "C", "D") and first["subject"] == rows[0]["subject"]
    answers = ["ABCD"[r["answer"]] for r in rows]
    assert [c["messages"][1]["content"] for c in mmlu] == answers
    assert [mmlu.evaluate(c, a) for c, a in zip(mmlu, answers)] == [True] * 5
    assert not mmlu.evaluate(first, "ABCD".replace(answers[0], "")[0])
    # slicing: stop=3 of the 4 test rows; start=1, step=2 of 5: examples 1 and 3
    assert len(t["mmlu_test"]) == 3 and len(t["mmlu_strided"]) == 2
    assert list(t["mmlu_strided"]) == [mmlu[1], mmlu[3]]
    assert (
        len(MMLU(os.path.join(hub, "mmlu"), "all", "test", stop=5200)) == 4
    )  # a stop past the end


def test_gsm8k_turns_its_calculator_marks_into_tool_calls(hub):
    gsm8k = files.tasks_in(hub)["gsm8k"]
    assert gsm8k.eval_type == "generative" and len(gsm8k) == 4
    by_question = {c["messages"][0]["content"]: c for c in gsm8k}
    natalia = by_question[files.GSM8K_ROWS[0]["question"]]
    assert natalia["messages"][1]["content"] == [
        {"type": "text", "text": "Natalia sold 48/2 = "},
        {"type": "python", "text": "48/2"},
        {"type": "python_output", "text": "24"},
        {"type": "text", "text": "24 clips in May.\nNatalia sold 48+24 = "},
        {"type": "python", "text": "48+24"},
        {"type": "python_output", "text": "72"},
        {"type": "text", "text": "72 clips altogether in April and May.\n#### 72"},
    ]
    weng = by_question[files.GSM8K_ROWS[1]["question"]]["messages"][1]["content"]
    assert weng[0] == {"type": "text", "text": ""}  # a call first: an empty text before it
    pens = by_question[files.GSM8K_ROWS[2]["question"]]["messages"][1]["content"]
    assert pens[1:3] == [{"type": "python", "text": "250*4"}, {"type": "python_output", "text": ""}]
    for completion, right in [
        ("so it is 72.\n#### 72", 1),
        ("#### 72.", 0),  # the pattern takes "72." whole
        ("#### 71", 0),
        ("72", 0),
    ]:
        assert gsm8k.evaluate(natalia, completion) == right, completion
        assert gsm8k.reward(natalia, completion) == float(right)
    pens_conversation = by_question[files.GSM8K_ROWS[2]["question"]]
    assert gsm8k.evaluate(pens_conversation, "#### 1000") == 1  # commas dropped on both sides
    assert extract_answer("#### -2") == "-2" and extract_answer("none") is None


def test_humaneval_runs_completions_in_the_sandbox(hub, tmp_path):
    humaneval = files.tasks_in(hub)["humaneval"]
    assert humaneval.eval_type == "generative" and len(humaneval) == 3
    total = next(c for c in humaneval if c["entry_point"] == "total")
    row = files.HUMANEVAL_ROWS[0]
    assert total["messages"] == [
        {"role": "user", "content": row["prompt"]},
        {"role": "assistant", "content": row["prompt"] + "\n" + row["canonical_solution"]},
    ]
    assert total["test"] == row["test"]
    # the prompt's imports come back where the completion leaves them out
    code = "def total(xs: List[int]) -> int:\n    return sum(xs)\n"
    assert humaneval.evaluate(total, code)
    assert humaneval.evaluate(total, f"Here it is:\n```python\n{code}```\nDone.")
    assert humaneval.evaluate(total, f"```python\n{code}```\nrun it:\n```\ntotal([1])\n```")
    assert not humaneval.evaluate(total, code.replace("sum(xs)", "len(xs)"))
    assert not humaneval.evaluate(total, "def total(xs):\n    exit(0)\n")  # no leaving early
    assert not humaneval.evaluate(total, "def total(xs) return 1")
    with pytest.raises(UsageError, match="run_python"):
        HumanEval(os.path.join(hub, "openai_humaneval")).evaluate(total, code)
    jsonl = HumanEval(files.write_humaneval_jsonl(str(tmp_path / "HumanEval.jsonl.gz")))
    assert list(jsonl) == list(humaneval)  # openai/human-eval's file: the same rows and order


def test_conversations_of_the_training_tasks(hub):
    t = files.tasks_in(hub)
    smoltalk = t["smoltalk"]  # its train split in two files, read in name order
    assert smoltalk.eval_type is None and len(smoltalk) == 5
    assert list(smoltalk) == [{"messages": r["messages"]} for r in shuffled(files.SMOLTALK_ROWS)]
    assert list(t["identity"]) == [{"messages": m} for m in files.IDENTITY]  # in file order
    with pytest.raises(UsageError, match="training data"):
        smoltalk.evaluate(smoltalk[0], "hi")

    bee = t["spelling_bee"]
    assert bee.eval_type == "generative" and len(bee) == 200
    for conversation in bee:
        question, parts = conversation["messages"][0]["content"], conversation["messages"][1]
        word, letter = parts["content"][2]["text"].split("'")[1::2]  # from 'word'.count('letter')
        count = word.count(letter)
        assert word in files.WORDS and word in question and letter in question
        assert parts["content"][0]["text"].endswith(f"This gives us {count}.")
        assert parts["content"][3] == {"type": "python_output", "text": str(count)}
        assert bee.evaluate(conversation, f"#### {count}") == 1
        assert bee.evaluate(conversation, f"#### {count + 1}") == 0
    assert list(bee) != list(t["spelling_bee_test"])  # the test split draws from other seeds
    spell = t["simple_spelling"][0]["messages"]
    word = spell[0]["content"].removeprefix("Spell the word: ")
    assert word in files.WORDS and spell[1]["content"] == f"{word}:{','.join(word)}"


class Counted(Task):
    """n examples (name, i): a task whose examples say where they came from."""

    def __init__(self, name, n, **kw):
        super().__init__(**kw)
        self.name, self.n = name, n

    def num_examples(self):
        return self.n

    def get_example(self, index):
        return (self.name, index)


def test_the_mixture_is_nanochats_shuffle():
    tasks = [Counted("a", 7), Counted("b", 1), Counted("c", 0), Counted("d", 12, start=2, step=3)]
    # nanochat's TaskMixture, as read: every (task, example) pair, shuffled by random.Random(42)
    pairs = [(k, i) for k, task in enumerate(tasks) for i in range(len(task))]
    random.Random(42).shuffle(pairs)
    mixture = TaskMixture(tasks)
    assert len(mixture) == 7 + 1 + 0 + 4
    assert list(mixture) == [tasks[k][i] for k, i in pairs]
    assert list(TaskMixture(tasks, start=3, step=2)) == [tasks[k][i] for k, i in pairs[3::2]]
    assert list(TaskSequence(tasks)) == [x for task in tasks for x in task]
    assert list(tasks[3]) == [("d", 2), ("d", 5), ("d", 8), ("d", 11)]
    with pytest.raises(IndexError):
        mixture[len(mixture)]
    with pytest.raises(UsageError, match="start"):
        Counted("e", 3, start=-1)


def test_a_mixture_of_every_task_renders(hub):
    t = files.tasks_in(hub)
    mixture = TaskMixture([t["smoltalk"], t["identity"], t["identity"], t["mmlu"], t["gsm8k"]])
    tok = ChatTokenizer.train(iter([json.dumps(files.GSM8K_ROWS)] * 4), 256 + 60 + 9)
    assert len(SPECIAL_TOKENS) == 9
    python_start = tok.encode_special("<|python_start|>")
    supervised = 0
    for conversation in list(mixture) + [t[k][0] for k in t]:
        ids, mask = render_conversation(tok, conversation)
        assert len(ids) == len(mask) and ids[0] == tok.get_bos_token_id()
        supervised += sum(mask)
    assert supervised > 0 and python_start in render_conversation(tok, t["gsm8k"][0])[0]


def one_line(error_type, match, build):
    with pytest.raises(error_type, match=match) as caught:
        build()
    assert "\n" not in str(caught.value), str(caught.value)


def test_files_in_another_format_are_one_line(hub, tmp_path):
    arc = os.path.join(hub, "ai2_arc")
    one_line(UsageError, "subset 'ARC-Medium': it is one of ARC-Easy, ARC-Challenge",
             lambda: ARC(arc, "ARC-Medium", "test"))  # fmt: skip
    one_line(UsageError, "split 'dev'", lambda: GSM8K(os.path.join(hub, "gsm8k"), "main", "dev"))
    one_line(
        InputNotFound, "hf download allenai/ai2_arc", lambda: ARC(str(tmp_path), "ARC-Easy", "test")
    )
    one_line(InputNotFound, "no folder", lambda: ARC(str(tmp_path / "nowhere"), "ARC-Easy", "test"))
    # a JSON where parquet is expected
    (tmp_path / "json").mkdir()
    (tmp_path / "json" / "ARC-Easy").mkdir()
    (tmp_path / "json" / "ARC-Easy" / "test-00000-of-00001.parquet").write_text('{"question": 1}')
    one_line(UsageError, r"not a parquet file \(it begins b'\{\"qu'\): allenai/ai2_arc's parquet",
             lambda: ARC(str(tmp_path / "json"), "ARC-Easy", "test"))  # fmt: skip
    # a missing column, a column of another type: the dataset's columns named
    no_answer = [{k: v for k, v in r.items() if k != "answerKey"} for r in files.ARC_ROWS]
    path = files.write_parquet(str(tmp_path / "a" / "ARC-Easy" / "test-0.parquet"), no_answer)
    one_line(UsageError, "has no column 'answerKey'.*answerKey \\(string\\)",
             lambda: ARC(os.path.dirname(os.path.dirname(path)), "ARC-Easy", "test"))  # fmt: skip
    text_answers = [{**r, "answer": str(r["answer"])} for r in files.MMLU_ROWS]
    path = files.write_parquet(str(tmp_path / "m.parquet"), text_answers)
    one_line(UsageError, "column 'answer' is string, not int",
             lambda: MMLU(path, "all", "test"))  # fmt: skip
    # SmolTalk's messages given as JSON strings; a conversation out of order
    path = files.write_parquet(str(tmp_path / "s.parquet"), [{"messages": "[]"}])
    one_line(UsageError, "not list of", lambda: SmolTalk(path, "train"))
    backwards = [{"messages": [files.assistant("hi"), files.user("hello")]}]
    path = files.write_parquet(str(tmp_path / "b.parquet"), backwards)
    one_line(
        UsageError, r"row 0: roles \['assistant', 'user'\]", lambda: SmolTalk(path, "train")[0]
    )
    # an ARC answer that is none of its labels, an MMLU question of three choices
    path = files.write_parquet(
        str(tmp_path / "k.parquet"), [{**files.ARC_ROWS[0], "answerKey": "E"}]
    )
    one_line(UsageError, "answerKey 'E' is none", lambda: ARC(path, "ARC-Easy", "test")[0])
    three = [{**files.MMLU_ROWS[0], "choices": ["1", "2", "3"]}]
    path = files.write_parquet(str(tmp_path / "3.parquet"), three)
    one_line(UsageError, "3 choices", lambda: MMLU(path, "all", "test")[0])


def test_jsonl_and_word_lists_in_another_format_are_one_line(hub, tmp_path):
    bad = tmp_path / "bad.jsonl"
    for text, match in [
        ('{"messages": []}\n', "line 1 holds a dict"),
        ('[{"role": "user", "content": "hi"}]\n', "two at least"),
        (
            '\n[{"role": "assistant", "content": "hi"}, {"role": "user", "content": "x"}]\n',
            "line 2",
        ),
        (
            '[{"role": "user", "content": "hi"}, {"role": "assistant", "content": ["x"]}]\n',
            "string",
        ),
        ("[1, 2\n", "line 1 is not JSON"),
    ]:
        bad.write_text(text)
        one_line(UsageError, match, lambda: CustomJSON(str(bad)))
    parquet = os.path.join(hub, "ai2_arc", "ARC-Easy", "test-00000-of-00001.parquet")
    one_line(UsageError, "not UTF-8", lambda: CustomJSON(parquet))
    one_line(InputNotFound, "identity_conversations.jsonl", lambda: CustomJSON(str(tmp_path / "x")))
    gz = tmp_path / "HumanEval.jsonl.gz"
    gz.write_text('{"prompt": "def f():"}\n')  # not gzip
    one_line(UsageError, "not UTF-8 JSON lines", lambda: HumanEval(str(gz)))
    plain = tmp_path / "HumanEval.jsonl"
    plain.write_text('{"prompt": "def f():"}\n')
    one_line(UsageError, "line 1 holds.*canonical_solution", lambda: HumanEval(str(plain)))
    words = tmp_path / "words.txt"
    words.write_text("apple\n\nbanana\n")
    one_line(UsageError, "line 2 is blank", lambda: SpellingBee(str(words)))
    one_line(UsageError, "split 'val'", lambda: SimpleSpelling(str(words), split="val"))
    one_line(InputNotFound, "words_alpha.txt", lambda: SpellingBee(str(tmp_path / "none")))


def test_the_parquet_export_layout_reads_the_same(hub, tmp_path):
    export = files.write_export(str(tmp_path))
    ours, theirs = files.tasks_in(hub), files.tasks_in(export)
    for name in ours:
        assert list(ours[name]) == list(theirs[name]), name


def test_the_tasks_folder_gives_chat_sfts_mixtures_and_chat_evals_tasks(hub, tmp_path):
    train, val = sft_mixtures(hub, mmlu_epochs=2, gsm8k_epochs=1, simple_spelling=7, spelling_bee=9)
    assert len(train) == 5 + 2 * 3 + 2 * 5 + 4 + 7 + 9 and len(val) == 2 + 4 + 3
    # nanochat's own base directory (task_data/ and the two files) is a tasks folder too
    base = files.write_nanochat_cache(str(tmp_path / "base"))
    theirs = sft_mixtures(base, mmlu_epochs=2, gsm8k_epochs=1, simple_spelling=7, spelling_bee=9)
    assert list(train) == list(theirs[0]) and list(val) == list(theirs[1])
    t = files.tasks_in(hub)
    expected = {
        "ARC-Easy": t["arc_easy"],
        "ARC-Challenge": t["arc_challenge"],
        "MMLU": MMLU(os.path.join(hub, "mmlu"), "all", "test"),
        "GSM8K": t["gsm8k_test"],
        "HumanEval": t["humaneval"],
        "SpellingBee": SpellingBee(os.path.join(hub, "words_alpha.txt"), size=256, split="test"),
    }
    assert expected.keys() == CHAT_EVAL_BASELINES.keys()
    for name, task in expected.items():
        ours = chat_eval_task(name, hub, run_python=run_python)
        assert ours.eval_type == task.eval_type and list(ours) == list(task), name
    one_line(
        UsageError,
        "no chat_eval task 'HellaSwag': one of ARC-Easy",
        lambda: chat_eval_task("HellaSwag", hub),
    )
    one_line(InputNotFound, "has no folder mmlu: download it with hf download cais/mmlu",
             lambda: chat_eval_task("MMLU", str(tmp_path)))  # fmt: skip


# -- nanochat's own tasks on the same rows
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def nanochat(tmp_path_factory):
    """nanochat's own task objects, named as tasks_in names ours, reading the same rows from its
    own cache layout; its TaskMixture and TaskSequence."""
    checkout = os.environ.get("NANOCHAT_CHECKOUT")
    if not checkout:
        pytest.skip("NANOCHAT_CHECKOUT is not set: nanochat's own tasks need its checkout")
    base = files.write_nanochat_cache(str(tmp_path_factory.mktemp("nanochat_base")))
    try:
        return files.nanochat_tasks(checkout, base)
    except files.NotInHistory as e:
        pytest.skip(str(e))


def every(task):
    return [task[i] for i in range(len(task))]


def test_nanochats_own_tasks_build_the_same_conversations(hub, nanochat):
    theirs, their_mixture, their_sequence = nanochat
    ours = files.tasks_in(hub)
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert len(ours[name]) == len(theirs[name]), name
        assert list(ours[name]) == every(theirs[name]), name
    # chat_sft's training mixture at nanochat's 950a1dc^: SmolTalk, the identity conversations
    # twice, MMLU x3, GSM8K x4, SimpleSpelling, SpellingBee
    names = ["smoltalk", "identity", "identity", *["mmlu"] * 3, *["gsm8k"] * 4]
    names += ["simple_spelling", "spelling_bee"]
    mine = sft_mixtures(hub, simple_spelling=40, spelling_bee=200)[0]
    other = their_mixture([theirs[n] for n in names])
    assert len(mine) == len(other) == 5 + 2 * 3 + 3 * 5 + 4 * 4 + 40 + 200
    assert list(mine) == every(other)
    sliced = dict(start=5, stop=60, step=3)
    assert list(TaskMixture(mine.tasks, **sliced)) == every(their_mixture(other.tasks, **sliced))
    assert list(TaskSequence(mine.tasks)) == every(their_sequence(other.tasks))


def test_nanochats_own_tasks_evaluate_the_same(hub, nanochat):
    theirs, _, _ = nanochat
    ours = files.tasks_in(hub)
    judged = 0
    for name in ("arc_easy", "arc_challenge", "mmlu", "mmlu_test"):
        for conversation in ours[name]:
            for letter in conversation["letters"]:
                mine = ours[name].evaluate(conversation, letter)
                assert mine == theirs[name].evaluate(conversation, letter), (name, letter)
                judged += 1
    answers = ["#### 72", "#### 72.", "x #### 1,000 y", "#### 1000", "#### -2", "#### 10", "no"]
    for name in ("gsm8k", "gsm8k_test", "spelling_bee", "spelling_bee_test"):
        for conversation in ours[name]:
            count = conversation["messages"][-1]["content"][-1]["text"].split("#### ")[-1]
            for completion in answers + [f"#### {count}"]:
                mine = ours[name].evaluate(conversation, completion)
                assert mine == theirs[name].evaluate(conversation, completion), (name, completion)
                assert ours[name].reward(conversation, completion) == float(mine)
                judged += 1
    humaneval = ours["humaneval"]
    for conversation in humaneval:
        right = conversation["messages"][1]["content"]
        code = "\n".join(line for line in right.split("\n") if not line.startswith(("from", "imp")))
        for completion in [
            right,
            f"```python\n{code}\n```",
            f"```python\n{code}\n```\nthen:\n```python\nprint(1)\n```",  # the first block
            code.replace("return", "return 0 *"),
        ]:
            mine = humaneval.evaluate(conversation, completion)
            assert mine == theirs["humaneval"].evaluate(conversation, completion), completion
            judged += 1
    assert judged > 300, judged
