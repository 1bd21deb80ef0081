"""A CORE eval bundle in nanochat's layout (core.yaml, eval_meta_data.csv, eval_data/*.jsonl) of
made-up items of each task type: tests/test_core_eval.py's and tests/test_nanochat_train.py's."""

import csv
import json
import os
import random

WORDS = (
    "the cat sat on a mat while rain fell over old town and every child ran home to eat warm bread "
    "with honey before night came down across quiet hills where birds sang softly"
).split()
# label, type, shots, delimiter, random baseline (percent)
TASKS = [
    ("mc_zero", "multiple_choice", 0, " ", 25.0),
    ("mc_shots", "multiple_choice", 3, "\nAnswer: ", 25.0),
    ("schema_one", "schema", 1, " ", 50.0),
    ("lm_zero", "language_modeling", 0, " ", 0.0),
    ("lm_shots", "language_modeling", 2, ":  ", 0.0),
]


def words(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def make_items(task_type, rng, n=9):
    items = []
    for i in range(n):
        long = i % 4 == 3  # too long for 64 tokens with its shots: cropped from the left
        if task_type == "multiple_choice":
            lead = words(rng, 1)  # choices sharing their first word: a common prefix past the query
            choices = [f"{lead} {words(rng, rng.randint(1, 3))}" for _ in range(4)]
            query = words(rng, 70 if long else rng.randint(3, 8)).capitalize() + "?"
            items.append({"query": query, "choices": choices, "gold": rng.randrange(4)})
        elif task_type == "schema":
            options = [words(rng, 60 if long else rng.randint(3, 7)) for _ in range(2)]
            cont = words(rng, rng.randint(2, 4)) + "."
            items.append(
                {"context_options": options, "continuation": cont, "gold": rng.randrange(2)}
            )
        else:  # trailing whitespace in contexts, as some of the bundle's datasets have
            context = words(rng, 60 if long else rng.randint(4, 9)) + " " * (i % 3)
            items.append({"context": context, "continuation": words(rng, rng.randint(1, 2))})
    return items


def write_bundle(folder, tasks=TASKS, data=None):
    """nanochat's bundle layout in `folder`: the tasks' items are `data`'s (label -> items) or made
    up."""
    os.makedirs(os.path.join(folder, "eval_data"))
    with open(os.path.join(folder, "core.yaml"), "w") as f:
        f.write("icl_tasks:\n")
        for label, kind, shots, delimiter, _ in tasks:
            f.write(
                f"- label: {label}\n  dataset_uri: {label}.jsonl\n  num_fewshot: [{shots}]\n"
                f"  icl_task_type: {kind}\n  continuation_delimiter: {json.dumps(delimiter)}\n"
            )
    with open(os.path.join(folder, "eval_meta_data.csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["Eval Task", "Task Category", "Random baseline", "Centered Metric?"])
        for label, _, _, _, baseline in tasks:
            writer.writerow([label, "test", baseline, "yes"])
    for seed, (label, kind, *_) in enumerate(tasks):
        with open(os.path.join(folder, "eval_data", f"{label}.jsonl"), "w") as f:
            for item in (data or {}).get(label) or make_items(kind, random.Random(seed)):
                f.write(json.dumps(item) + "\n")
    return folder
