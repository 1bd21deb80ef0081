"""
The folder of chat task files a user points at, and what nanochat builds from it: chat_sft's
training and validation mixtures (as at nanochat's 950a1dc^, the identity conversations and the
spelling tasks included) and chat_eval's tasks by name. Each hub dataset is a folder in it, where
`hf download DATASET --repo-type=dataset --local-dir=DIR/NAME` leaves it; the identity
conversations and the word list are files beside them. nanochat's own base directory
($NANOCHAT_BASE_DIR, ~/.cache/nanochat) is such a folder too: its task_data/ cache of each dataset
is found where the NAME folder is not.
"""

import os

from configurator import InputNotFound, UsageError
from dataio.chat_tasks import CustomJSON, TaskMixture, download
from dataio.hub_tasks import ARC, GSM8K, MMLU, HumanEval, SmolTalk
from dataio.spelling_tasks import SimpleSpelling, SpellingBee

IDENTITY_FILE = "identity_conversations.jsonl"  # nanochat's 1000 synthetic identity conversations
WORDS_FILE = "words_alpha.txt"  # the spelling tasks' 370K words
# chat_eval's tasks (nanochat's names) and the baseline accuracy of a model that guesses
CHAT_EVAL_BASELINES = {
    "ARC-Easy": 0.25,
    "ARC-Challenge": 0.25,
    "MMLU": 0.25,
    "GSM8K": 0.0,
    "HumanEval": 0.0,
    "SpellingBee": 0.0,
}


def dataset_folder(root, task):
    """The folder of `task`'s hub dataset (a HubTask class) under the tasks folder `root`:
    root/NAME, or nanochat's cache root/task_data/ORG--NAME."""
    name = task.DATASET.split("/")[-1]
    for folder in (name, os.path.join("task_data", task.DATASET.replace("/", "--"))):
        if os.path.isdir(os.path.join(root, folder)):
            return os.path.join(root, folder)
    raise InputNotFound(f"{root} has no folder {name}: {download(task.DATASET)}")


def sft_mixtures(
    root, mmlu_epochs=3, gsm8k_epochs=4, identity_epochs=2, simple_spelling=200_000,
    spelling_bee=80_000,
):  # fmt: skip
    """chat_sft's (train, val) TaskMixtures: SmolTalk, the identity conversations
    `identity_epochs` times, MMLU's auxiliary_train `mmlu_epochs` times, GSM8K's train
    `gsm8k_epochs` times and the two spelling tasks of those sizes (the defaults: its history's,
    950a1dc^; its checkout's chat_sft has neither identity nor spelling: 0); validation on
    SmolTalk's test, MMLU's first 5200 test questions and GSM8K's first 420 (to keep the training
    ratios). A task given 0 times needs no file."""
    words = os.path.join(root, WORDS_FILE)
    identity = (
        [CustomJSON(os.path.join(root, IDENTITY_FILE))] * identity_epochs if identity_epochs else []
    )
    spelling = (
        [SimpleSpelling(words, size=simple_spelling, split="train")] if simple_spelling else []
    )
    spelling += [SpellingBee(words, size=spelling_bee, split="train")] if spelling_bee else []
    train = [
        SmolTalk(dataset_folder(root, SmolTalk), "train"),
        *identity,
        *[MMLU(dataset_folder(root, MMLU), "all", "auxiliary_train")] * mmlu_epochs,
        *[GSM8K(dataset_folder(root, GSM8K), "main", "train")] * gsm8k_epochs,
        *spelling,
    ]
    val = [
        SmolTalk(dataset_folder(root, SmolTalk), "test"),
        MMLU(dataset_folder(root, MMLU), "all", "test", stop=5200),
        GSM8K(dataset_folder(root, GSM8K), "main", "test", stop=420),
    ]
    return TaskMixture(train), TaskMixture(val)


def chat_eval_task(name, root, run_python=None):
    """chat_eval's task `name` (CHAT_EVAL_BASELINES' keys) from the tasks folder `root`; HumanEval
    runs its completions through `run_python` (run.sandbox.run_python)."""
    if name in ("ARC-Easy", "ARC-Challenge"):
        return ARC(dataset_folder(root, ARC), name, "test")
    if name == "MMLU":
        return MMLU(dataset_folder(root, MMLU), "all", "test")
    if name == "GSM8K":
        return GSM8K(dataset_folder(root, GSM8K), "main", "test")
    if name == "HumanEval":
        return HumanEval(dataset_folder(root, HumanEval), run_python=run_python)
    if name == "SpellingBee":
        return SpellingBee(os.path.join(root, WORDS_FILE), size=256, split="test")
    raise UsageError(f"no chat_eval task {name!r}: one of {', '.join(CHAT_EVAL_BASELINES)}")
