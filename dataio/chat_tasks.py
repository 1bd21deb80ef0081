"""
nanochat's chat tasks (tasks/common.py) read from local files: a Task is a list of conversations
({"messages": [...]}, dataio/conversations.py) with, for the tasks chat_eval scores, an eval_type
('categorical': the answer is one of `letters`; 'generative': the completion is sampled) and
evaluate(conversation, completion). Tasks slice (start, stop, step), mix (TaskMixture: one
deterministic shuffle of every task's examples, seed 42) and chain (TaskSequence) as nanochat's.

The files are each dataset's own, as the Hugging Face hub publishes them (parquet, read with
pyarrow) and as nanochat shuffles them (numpy's default_rng(42) permutation, which is what
`datasets.Dataset.shuffle(seed=42)` draws); the identity conversations are their JSONL. A file in
another format is one line naming the fix (a UsageError). The tasks themselves: dataio/hub_tasks.py
(ARC, MMLU, GSM8K, HumanEval, SmolTalk) and dataio/spelling_tasks.py.
"""

import bisect
import glob
import gzip
import json
import os
import random

import numpy as np

from configurator import InputNotFound, UsageError
from dataio.unpickling import short

SHUFFLE_SEED = 42  # nanochat's: every hub dataset's .shuffle(seed=42) and TaskMixture's Random(42)
PARQUET_MAGIC = b"PAR1"
IDENTITY_URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/identity_conversations.jsonl"


class Task:
    """A view start:stop:step over a task's examples (nanochat's Task). A stop past the end is the
    end, as a Python slice (nanochat's counts the rows that are not there and fails on reaching
    them). Subclasses give num_examples() and get_example(i); the tasks chat_eval scores also give
    eval_type and evaluate."""

    eval_type = None  # 'categorical' | 'generative' for a task chat_eval scores

    def __init__(self, start=0, stop=None, step=1):
        for name, value in (("start", start), ("stop", stop), ("step", step)):
            if not (value is None and name == "stop") and not isinstance(value, int):
                raise UsageError(f"{name}={short(value)}: a task's {name} is an int")
        if start < 0 or step < 1 or (stop is not None and stop < start):
            raise UsageError(
                f"start={start}, stop={stop}, step={step}: 0 <= start <= stop, step>=1"
            )
        self.start, self.stop, self.step = start, stop, step

    def num_examples(self):
        raise NotImplementedError

    def get_example(self, index):
        raise NotImplementedError

    def __len__(self):
        stop = self.num_examples() if self.stop is None else min(self.stop, self.num_examples())
        return max(0, -(-(stop - self.start) // self.step))  # ceil((stop - start) / step)

    def __getitem__(self, index):
        if not isinstance(index, int) or not 0 <= index < len(self):
            raise IndexError(f"example {short(index)} of a task of {len(self)}")
        return self.get_example(self.start + index * self.step)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def evaluate(self, conversation, completion):
        raise UsageError(f"{type(self).__name__} is training data: chat_eval does not score it")


class TaskMixture(Task):
    """Every example of `tasks` in one deterministic shuffle (Python's random.Random(42) over the
    list of (task, example) pairs, as nanochat's), so that each task is spread through training. A
    task given twice is seen twice (nanochat's way to oversample)."""

    def __init__(self, tasks, **kwargs):
        super().__init__(**kwargs)
        self.tasks = list(tasks)
        self.ends = np.cumsum([len(task) for task in self.tasks]).tolist()  # each task's end
        # random.shuffle draws from the list's length only: shuffling the pairs' positions gives
        # nanochat's order of the pairs themselves
        self.order = list(range(self.ends[-1] if self.ends else 0))
        random.Random(SHUFFLE_SEED).shuffle(self.order)

    def num_examples(self):
        return len(self.order)

    def locate(self, index):
        """(task, example) of the mixture's example `index`."""
        position = self.order[index]
        task = bisect.bisect_right(self.ends, position)
        return task, position - (self.ends[task - 1] if task else 0)

    def get_example(self, index):
        task, local = self.locate(index)
        return self.tasks[task][local]


class TaskSequence(Task):
    """The tasks one after another (nanochat's curriculum)."""

    def __init__(self, tasks, **kwargs):
        super().__init__(**kwargs)
        self.tasks = list(tasks)
        self.ends = np.cumsum([len(task) for task in self.tasks]).tolist()

    def num_examples(self):
        return self.ends[-1] if self.ends else 0

    def get_example(self, index):
        task = bisect.bisect_right(self.ends, index)
        return self.tasks[task][index - (self.ends[task - 1] if task else 0)]


# -- the files
# ------------------------------------------------------------------------------------------------


class HubRows:
    """A split of a hub dataset as nanochat reads it: its parquet files in name order, one table,
    each row a dict (a struct a dict, a list a list), in the order of nanochat's seeded shuffle."""

    def __init__(self, table, seed=SHUFFLE_SEED):
        self.table = table
        self.permutation = np.random.default_rng(seed).permutation(table.num_rows)

    def __len__(self):
        return self.table.num_rows

    def row_number(self, index):
        """The row of the files (0 the first file's first) that shuffled row `index` is."""
        return int(self.permutation[index])

    def __getitem__(self, index):
        row = self.row_number(index)
        return {name: self.table[name][row].as_py() for name in self.table.column_names}


def split_files(folder, subset, split, dataset):
    """The parquet files of `subset`'s `split` under a dataset's folder, in name order: the hub
    repository's layout (SUBSET/SPLIT-00000-of-00001.parquet; a dataset without subsets in data/),
    or its parquet export's and nanochat's cache's (SUBSET/SPLIT/0000.parquet); `folder` may be one
    parquet file. None there is one line naming the download."""
    if os.path.isfile(folder):
        return [folder]
    if not os.path.isdir(folder):
        raise InputNotFound(f"no folder {folder}: {download(dataset)}")
    repo_dir = "data" if subset == "default" else subset
    patterns = [(repo_dir, f"{split}-*.parquet"), (subset, split, "*.parquet")]
    for pattern in patterns:
        paths = sorted(glob.glob(os.path.join(glob.escape(folder), *pattern)))
        if paths:
            return paths
    tried = " or ".join(os.path.join(*p) for p in patterns)
    raise InputNotFound(f"{folder} has no {tried}: {download(dataset)}")


def download(dataset):
    """The command that fetches a hub dataset into the folder its task reads."""
    name = dataset.split("/")[-1]
    return f"download it with hf download {dataset} --repo-type=dataset --local-dir=DIR/{name}"


def read_parquet(paths, columns, dataset):
    """One pyarrow table of `paths`, checked: each a parquet file with `columns` ({name: kind},
    SCHEMA_KINDS) of their kinds. A file in another format is one line naming the dataset's."""
    import pyarrow as pa  # the nanochat extras
    import pyarrow.parquet as pq

    expected = ", ".join(f"{name} ({kind})" for name, kind in columns.items())
    fix = f"{dataset}'s parquet files hold {expected}"
    tables = []
    for path in paths:
        with open(path, "rb") as f:
            head = f.read(4)
        if head != PARQUET_MAGIC:
            raise UsageError(f"{path} is not a parquet file (it begins {head!r}): {fix}")
        try:
            table = pq.read_table(path)
        except pa.ArrowException as e:
            why = (str(e).splitlines() or [""])[0][:200]
            raise UsageError(f"{path}: pyarrow cannot read it ({why}): {fix}") from None
        for name, kind in columns.items():
            if name not in table.column_names:
                got = ", ".join(table.column_names)
                raise UsageError(f"{path} has no column {name!r} (it has {got}): {fix}")
            if not SCHEMA_KINDS[kind](table.schema.field(name).type):
                got = table.schema.field(name).type
                raise UsageError(f"{path}: column {name!r} is {got}, not {kind}: {fix}")
        tables.append(table.select(list(columns)))
    return pa.concat_tables(tables)


def _is_string(t):
    import pyarrow as pa

    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _is_list_of(t, item):
    import pyarrow as pa

    is_list = pa.types.is_list(t) or pa.types.is_large_list(t)
    return is_list and item(t.value_type)


def _is_struct_of(t, fields):
    import pyarrow as pa

    if not pa.types.is_struct(t):
        return False
    names = {t.field(i).name: t.field(i).type for i in range(t.num_fields)}
    return all(name in names and kind(names[name]) for name, kind in fields.items())


def _is_int(t):
    import pyarrow as pa

    return pa.types.is_integer(t)


SCHEMA_KINDS = {  # a column's kind in an error line -> the check of its arrow type
    "string": _is_string,
    "int": _is_int,
    "list of strings": lambda t: _is_list_of(t, _is_string),
    "{text: list of strings, label: list of strings}": lambda t: _is_struct_of(
        t,
        {
            "text": lambda u: _is_list_of(u, _is_string),
            "label": lambda u: _is_list_of(u, _is_string),
        },
    ),
    "list of {role: string, content: string}": lambda t: _is_list_of(
        t, lambda u: _is_struct_of(u, {"role": _is_string, "content": _is_string})
    ),
}


def read_jsonl(path, what):
    """The JSON values of a JSONL file (.jsonl or .jsonl.gz), with their line numbers; blank lines
    skipped. A line that is not JSON is one line naming it and `what` each line holds."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise InputNotFound(f"no file {path}: {what}")
    opener = gzip.open if path.endswith(".gz") else open
    values = []
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    values.append((number, json.loads(line)))
    except (UnicodeDecodeError, gzip.BadGzipFile, EOFError) as e:
        raise UsageError(f"{path} is not UTF-8 JSON lines ({type(e).__name__}): {what}") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"{path} line {number} is not JSON ({e.msg}): {what}") from None
    return values


class CustomJSON(Task):
    """Conversations from a JSONL file, one per line as a JSON array of messages, user first and
    assistant in turn, each content a string (nanochat's CustomJSON; its identity conversations:
    IDENTITY_URL). A missing file is an error here (nanochat warns and trains without it)."""

    def __init__(self, path, **kwargs):
        super().__init__(**kwargs)
        what = (
            'each line is a JSON array of messages [{"role": "user", "content": "..."}, '
            '{"role": "assistant", "content": "..."}, ...]'
        )
        if not os.path.exists(path):
            raise InputNotFound(f"no file {path}: the identity conversations are {IDENTITY_URL}")
        self.conversations = []
        for number, messages in read_jsonl(path, what):
            where = f"{path} line {number}"
            if not isinstance(messages, list) or len(messages) < 2:
                raise UsageError(f"{where} holds {short(messages)}: {what}, two at least")
            for i, message in enumerate(messages):
                role = ("user", "assistant")[i % 2]
                if not isinstance(message, dict) or message.get("role") != role:
                    raise UsageError(f"{where}: message {i} is not the {role}'s: {what}")
                if not isinstance(message.get("content"), str):
                    raise UsageError(f"{where}: message {i} has no string content: {what}")
            self.conversations.append(messages)

    def num_examples(self):
        return len(self.conversations)

    def get_example(self, index):
        return {"messages": self.conversations[index]}
