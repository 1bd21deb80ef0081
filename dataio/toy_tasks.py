"""
Tiny stand-ins for the datasets nanochat finetunes on, made offline from templates in each one's
hub schema: SmolTalk's conversations (some with a system message), MMLU's four-choice questions,
GSM8K's word problems with their calculator marks (<<a*b=c>>) and `#### answer`. Written where
nanochat's own tasks read a finished download (task_data/ORG--NAME/SUBSET/SPLIT/00000.parquet and
its manifest.json), so that its chat_sft and ours read the same rows: the finetuning check's data
(parity/check_chat.py) and the CPU pipeline's (`data/chat/prepare.py --toy`). A toy: what the
model learns from it is the templates.
"""

import json
import os
import random

NAMES = ["Romeo", "Juliet", "Hamlet", "Ophelia", "Lear", "Cordelia", "Macbeth", "Banquo"]
TOPICS = ["the sea", "a storm", "the king", "the moon", "a letter", "the crown", "a ghost"]
# chat_sft's val takes MMLU's first 5200 tests and GSM8K's first 420, and nanochat's Task counts a
# stop past the rows there as rows (failing when it reaches them): the test splits hold as many
TEST_ROWS = {"smoltalk": 8, "mmlu": 5200, "gsm8k": 420}


def smoltalk_row(rng):
    """A conversation of 1 to 3 turns, some with a system message (its schema: messages)."""
    messages = [{"role": "system", "content": "Answer briefly."}] if rng.random() < 0.3 else []
    for _ in range(rng.randint(1, 3)):
        who, what = rng.choice(NAMES), rng.choice(TOPICS)
        messages.append({"role": "user", "content": f"What did {who} say of {what}?"})
        words = " ".join(rng.choice(TOPICS) for _ in range(rng.randint(1, 12)))
        messages.append({"role": "assistant", "content": f"{who} spoke of {words}."})
    return {"prompt": messages[-2]["content"], "messages": messages}


def mmlu_row(rng):
    a, b = rng.randint(1, 20), rng.randint(1, 20)
    choices = [str(a + b + d) for d in rng.sample(range(-3, 4), 4)]
    answer = rng.randrange(4)
    choices[answer] = str(a + b)
    question = f"What is {a} + {b}?"
    return {"question": question, "subject": "arithmetic", "choices": choices, "answer": answer}


def gsm8k_row(rng):
    a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(1, 30)
    answer = (
        f"{rng.choice(NAMES)} has {a} boxes of {b} apples, so <<{a}*{b}={a * b}>>{a * b} apples. "
        f"With {c} more: <<{a * b}+{c}={a * b + c}>>{a * b + c}.\n#### {a * b + c}"
    )
    return {"question": f"{a} boxes of {b} apples and {c} more: how many apples?", "answer": answer}


# each dataset: its cache folder, subset, train split, row maker
DATASETS = {
    "smoltalk": ("HuggingFaceTB--smol-smoltalk", "default", "train", smoltalk_row),
    "mmlu": ("cais--mmlu", "all", "auxiliary_train", mmlu_row),
    "gsm8k": ("openai--gsm8k", "main", "train", gsm8k_row),
}


def write_task_cache(root, train_rows, seed=0):
    """Each dataset's `train_rows[name]` train rows and TEST_ROWS test rows under root/task_data
    in nanochat's cache layout (00000.parquet, then manifest.json: the download's end)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    for name, (slug, subset, train, make) in DATASETS.items():
        for split, count in ((train, train_rows[name]), ("test", TEST_ROWS[name])):
            folder = os.path.join(root, "task_data", slug, subset, split)
            os.makedirs(folder, exist_ok=True)
            table = pa.Table.from_pylist([make(rng) for _ in range(count)])
            pq.write_table(table, os.path.join(folder, "00000.parquet"))
            with open(os.path.join(folder, "manifest.json"), "w") as f:
                json.dump(["00000.parquet"], f)
