"""Tiny chat task files in each dataset's published format (a few rows each): the hub
repositories' parquet layouts, their parquet export's, nanochat's own cache of them
($NANOCHAT_BASE_DIR/task_data, with its manifest), HumanEval's jsonl, the identity conversations'
JSONL and the spelling tasks' word list; our tasks on them, and nanochat's own (from a checkout).
The chat task tests' data (dataio/chat_tasks.py)."""

import gzip
import json
import os
import subprocess
import sys
import types

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dataio.chat_tasks import CustomJSON
from dataio.hub_tasks import ARC, GSM8K, MMLU, HumanEval, SmolTalk
from dataio.spelling_tasks import SimpleSpelling, SpellingBee
from run.sandbox import run_python

HISTORY = "950a1dc^"  # nanochat's last commit with tasks/customjson.py and tasks/spellingbee.py

# (dataset, subset, split) -> its rows, as the hub's files hold them
ARC_ROWS = [
    {
        "id": "Mercury_1",
        "question": "Which gas do plants take in for photosynthesis?",
        "choices": {
            "text": ["oxygen", "carbon dioxide", "nitrogen", "helium"],
            "label": list("ABCD"),
        },
        "answerKey": "B",
    },
    {
        "id": "Mercury_2",
        "question": "What is the boiling point of water at sea level?",
        "choices": {"text": ["50 C", "100 C", "150 C"], "label": ["1", "2", "3"]},
        "answerKey": "2",
    },
    {
        "id": "Mercury_3",
        "question": "Which is a mammal?",
        "choices": {"text": ["shark", "trout", "whale", "frog", "newt"], "label": list("ABCDE")},
        "answerKey": "C",
    },
    {
        "id": "Mercury_4",
        "question": "What makes the sky look blue?",
        "choices": {"text": ["scattering", "reflection of the sea"], "label": ["A", "B"]},
        "answerKey": "A",
    },
]
MMLU_ROWS = [
    {"question": "2 + 2 =", "subject": "elementary_mathematics", "choices": ["3", "4", "5", "6"]},
    {
        "question": "The heart has how many chambers?",
        "subject": "anatomy",
        "choices": ["1", "2", "3", "4"],
    },
    {"question": "H2O is", "subject": "", "choices": ["salt", "water", "gold", "air"]},
    {
        "question": "Who wrote Hamlet?",
        "subject": "",
        "choices": ["Marlowe", "Jonson", "Bacon", "Shakespeare"],
    },
    {"question": "A prime:", "subject": "college_mathematics", "choices": ["4", "6", "7", "9"]},
]
for _row, _answer in zip(MMLU_ROWS, (1, 3, 1, 3, 2)):
    _row["answer"] = _answer
GSM8K_ROWS = [
    {
        "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as "
        "many clips in May. How many clips did Natalia sell altogether in April and May?",
        "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = "
        "<<48+24=72>>72 clips altogether in April and May.\n#### 72",
    },
    {
        "question": "Weng earns $12 an hour. She babysat for 50 minutes. How much did she earn?",
        "answer": "<<12/60=0.2>>0.2 a minute.\n0.2 x 50 = $<<0.2*50=10>>10.\n#### 10",
    },
    {
        "question": "A shop sells 250 pens a day. How many in 4 days?",
        "answer": "250 * 4 = <<250*4>>1000 pens.\n#### 1,000",
    },
    {"question": "What is 7 minus 9?", "answer": "7 - 9 = <<7-9=-2>>-2\n#### -2"},
]
HUMANEVAL_ROWS = [
    {
        "task_id": "HumanEval/0",
        "prompt": "from typing import List\n\n\ndef total(xs: List[int]) -> int:\n"
        '    """The sum of xs."""\n',
        "canonical_solution": "    return sum(xs)\n",
        "test": "\n\ndef check(candidate):\n    assert candidate([1, 2, 3]) == 6\n"
        "    assert candidate([]) == 0\n",
        "entry_point": "total",
    },
    {
        "task_id": "HumanEval/1",
        "prompt": "import math\n\n\ndef hypot(a, b):\n"
        '    """The hypotenuse of a right triangle."""\n',
        "canonical_solution": "    return math.sqrt(a * a + b * b)\n",
        "test": "\n\ndef check(candidate):\n    assert candidate(3, 4) == 5.0\n",
        "entry_point": "hypot",
    },
    {
        "task_id": "HumanEval/2",
        "prompt": 'def shout(s):\n    """s in capitals, then "!"."""\n',
        "canonical_solution": "    return s.upper() + '!'\n",
        "test": "\n\ndef check(candidate):\n    assert candidate('hi') == 'HI!'\n",
        "entry_point": "shout",
    },
]


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


SMOLTALK_ROWS = [
    {"messages": [user("Why is the sky blue?"), assistant("Rayleigh scattering.")], "source": "a"},
    {
        "messages": [
            {"role": "system", "content": "You are terse."},
            user("hi"),
            assistant("hello"),
            user("bye"),
            assistant("bye"),
        ],
        "source": "b",
    },
    {"messages": [user("2+2?"), assistant("4")], "source": "c"},
    {"messages": [user("Name a color."), assistant("Teal.")], "source": "d"},
    {"messages": [user("Capital of France?"), assistant("Paris.")], "source": "e"},
]
IDENTITY = [
    [user("Who are you?"), assistant("I am nanochat, a small language model.")],
    [
        user("Who made you?"),
        assistant("Andrej Karpathy wrote my code."),
        user("ok"),
        assistant(":)"),
    ],
    [user("Are you big?"), assistant("No: I am small and cheap to train.")],
]
WORDS = ["strawberry", "apple", "banana", "mississippi", "a", "rhythm", "bookkeeper", "zz"]

# dataset -> (subset, split) -> rows
HUB = {
    "allenai/ai2_arc": {
        ("ARC-Easy", "test"): ARC_ROWS,
        ("ARC-Challenge", "test"): ARC_ROWS[::-1],
        ("ARC-Easy", "train"): ARC_ROWS[1:],
    },
    "cais/mmlu": {("all", "auxiliary_train"): MMLU_ROWS, ("all", "test"): MMLU_ROWS[:4]},
    "openai/gsm8k": {("main", "train"): GSM8K_ROWS, ("main", "test"): GSM8K_ROWS[1:]},
    "openai/openai_humaneval": {("openai_humaneval", "test"): HUMANEVAL_ROWS},
    "HuggingFaceTB/smol-smoltalk": {
        ("default", "train"): SMOLTALK_ROWS,
        ("default", "test"): SMOLTALK_ROWS[:2],
    },
}


def write_parquet(path, rows):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_hub(folder):
    """Each dataset in the layout of its hub repository, under folder/<name> (what `hf download`
    leaves), SmolTalk's train split in two files; the identity conversations and the word list
    beside them. -> folder."""
    for dataset, splits in HUB.items():
        home = os.path.join(folder, dataset.split("/")[1])
        for (subset, split), rows in splits.items():
            repo_dir = "data" if subset == "default" else subset
            halves = [rows[:2], rows[2:]] if len(rows) > 2 and subset == "default" else [rows]
            for k, part in enumerate(halves):
                name = f"{split}-{k:05d}-of-{len(halves):05d}.parquet"
                write_parquet(os.path.join(home, repo_dir, name), part)
    write_extras(folder)
    return folder


def write_export(folder):
    """Each dataset as the hub's parquet export (refs/convert/parquet): <name>/SUBSET/SPLIT/0000.
    parquet, and the identity conversations and word list. -> folder."""
    for dataset, splits in HUB.items():
        for (subset, split), rows in splits.items():
            path = os.path.join(folder, dataset.split("/")[1], subset, split, "0000.parquet")
            write_parquet(path, rows)
    write_extras(folder)
    return folder


def write_nanochat_cache(base_dir):
    """The same rows where nanochat's load_hub_dataset finds a finished download
    (task_data/<org>--<name>/SUBSET/SPLIT/00000.parquet and manifest.json), and the identity
    conversations and word list where its history's CustomJSON and SpellingBee look. -> base_dir."""
    for dataset, splits in HUB.items():
        for (subset, split), rows in splits.items():
            shards = os.path.join(base_dir, "task_data", dataset.replace("/", "--"), subset, split)
            write_parquet(os.path.join(shards, "00000.parquet"), rows)
            with open(os.path.join(shards, "manifest.json"), "w") as f:
                json.dump(["00000.parquet"], f)
    write_extras(base_dir)
    return base_dir


def write_extras(folder):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "identity_conversations.jsonl"), "w", encoding="utf-8") as f:
        f.writelines(json.dumps(messages) + "\n" for messages in IDENTITY)
    with open(os.path.join(folder, "words_alpha.txt"), "w", newline="") as f:
        f.writelines(word + "\r\n" for word in WORDS)  # dwyl's file ends its lines so


def write_humaneval_jsonl(path):
    """HumanEval as openai/human-eval ships it: HumanEval.jsonl.gz, one task a line."""
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in HUMANEVAL_ROWS)
    return path


def tasks_in(hub):
    """Every task on the files write_hub wrote in `hub`, by name (the tests compare them whole)."""
    words = os.path.join(hub, "words_alpha.txt")
    return {
        "arc_easy": ARC(os.path.join(hub, "ai2_arc"), "ARC-Easy", "test"),
        "arc_challenge": ARC(os.path.join(hub, "ai2_arc"), "ARC-Challenge", "test"),
        "arc_train": ARC(os.path.join(hub, "ai2_arc"), "ARC-Easy", "train"),
        "mmlu": MMLU(os.path.join(hub, "mmlu"), "all", "auxiliary_train"),
        "mmlu_test": MMLU(os.path.join(hub, "mmlu"), "all", "test", stop=3),
        "mmlu_strided": MMLU(os.path.join(hub, "mmlu"), "all", "auxiliary_train", start=1, step=2),
        "gsm8k": GSM8K(os.path.join(hub, "gsm8k"), "main", "train"),
        "gsm8k_test": GSM8K(os.path.join(hub, "gsm8k"), "main", "test"),
        "humaneval": HumanEval(os.path.join(hub, "openai_humaneval"), run_python=run_python),
        "smoltalk": SmolTalk(os.path.join(hub, "smol-smoltalk"), "train"),
        "smoltalk_test": SmolTalk(os.path.join(hub, "smol-smoltalk"), "test"),
        "identity": CustomJSON(os.path.join(hub, "identity_conversations.jsonl")),
        "spelling_bee": SpellingBee(words, size=200, split="train"),
        "spelling_bee_test": SpellingBee(words, size=40, split="test"),
        "simple_spelling": SimpleSpelling(words, size=40, split="train"),
    }


class NotInHistory(Exception):
    """The checkout's git history lacks a task module (a shallow clone, or no git)."""


def history_module(checkout, name):
    """tasks/<name>.py at HISTORY, as the module tasks.<name> (it imports the checkout's
    tasks.common and nanochat.common, which it still finds)."""
    try:
        source = subprocess.run(
            ["git", "-C", checkout, "show", f"{HISTORY}:tasks/{name}.py"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError) as e:
        raise NotInHistory(f"tasks/{name}.py is not in the checkout's history at {HISTORY}: {e}")
    module = types.ModuleType(f"tasks.{name}")
    exec(compile(source, f"{checkout}/tasks/{name}.py@{HISTORY}", "exec"), module.__dict__)
    return module


def nanochat_tasks(checkout, base):
    """nanochat's own task objects from the checkout (CustomJSON and the spelling tasks at its
    HISTORY), named as tasks_in names ours, reading the rows write_nanochat_cache wrote in `base`;
    its TaskMixture and TaskSequence."""
    sys.path.insert(0, checkout)
    from tasks.arc import ARC as TheirARC
    from tasks.common import TaskMixture as TheirMixture
    from tasks.common import TaskSequence as TheirSequence
    from tasks.gsm8k import GSM8K as TheirGSM8K
    from tasks.humaneval import HumanEval as TheirHumanEval
    from tasks.mmlu import MMLU as TheirMMLU
    from tasks.smoltalk import SmolTalk as TheirSmolTalk

    spelling = history_module(checkout, "spellingbee")
    custom = history_module(checkout, "customjson")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOCHAT_BASE_DIR", base)  # where load_hub_dataset finds its finished download
        theirs = {
            "arc_easy": TheirARC("ARC-Easy", "test"),
            "arc_challenge": TheirARC("ARC-Challenge", "test"),
            "arc_train": TheirARC("ARC-Easy", "train"),
            "mmlu": TheirMMLU("all", "auxiliary_train"),
            "mmlu_test": TheirMMLU("all", "test", stop=3),
            "mmlu_strided": TheirMMLU("all", "auxiliary_train", start=1, step=2),
            "gsm8k": TheirGSM8K("main", "train"),
            "gsm8k_test": TheirGSM8K("main", "test"),
            "humaneval": TheirHumanEval(),
            "smoltalk": TheirSmolTalk("train"),
            "smoltalk_test": TheirSmolTalk("test"),
            "identity": custom.CustomJSON(os.path.join(base, "identity_conversations.jsonl")),
            "spelling_bee": spelling.SpellingBee(size=200, split="train"),
            "spelling_bee_test": spelling.SpellingBee(size=40, split="test"),
            "simple_spelling": spelling.SimpleSpelling(size=40, split="train"),
        }
    return theirs, TheirMixture, TheirSequence
