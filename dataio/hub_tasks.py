"""
nanochat's tasks from the Hugging Face hub (tasks/arc.py, mmlu.py, gsm8k.py, humaneval.py,
smoltalk.py), each read from a local folder of the dataset's parquet files (dataio/chat_tasks.py:
the hub repository's layout or its parquet export's) in nanochat's seeded shuffle, each example the
conversation nanochat builds from the same row, each answer judged as nanochat judges it.
"""

import os
import re

from configurator import UsageError
from dataio.chat_tasks import HubRows, Task, read_jsonl, read_parquet, split_files
from dataio.unpickling import short

MC_LETTERS = ("A", "B", "C", "D")  # MMLU's (a tuple in its conversations, as nanochat's)
GSM_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")  # openai/grade-school-math's final answer
CALCULATOR_CALL = re.compile(r"(<<[^>]+>>)")  # GSM8K's <<48/2=24>>
CODE_BLOCK = re.compile(r"```(?:python)?\s*\n(.*?)\n```", re.DOTALL)


def render_mc(question, letters, choices):
    """nanochat's multiple-choice prompt: each choice then its letter, with no space before the
    letter ("=A"), so that the prompt holds the very token the answer is ("A", not " A")."""
    lines = [f"Multiple Choice question: {question}\n"]
    lines += [f"- {choice}={letter}\n" for letter, choice in zip(letters, choices)]
    return "".join(lines) + "\nRespond only with the letter of the correct answer."


def extract_answer(completion):
    """The number after '####', commas dropped (GSM8K's and the spelling bee's answer); None
    without one."""
    match = GSM_ANSWER.search(completion)
    return match.group(1).strip().replace(",", "") if match else None


class HubTask(Task):
    """A split of a hub dataset: `path` is the dataset's folder (or one of its files); SUBSETS and
    SPLITS name what it has, COLUMNS what each row holds (chat_tasks.SCHEMA_KINDS)."""

    DATASET = SUBSETS = SPLITS = COLUMNS = None

    def __init__(self, path, subset, split, **kwargs):
        super().__init__(**kwargs)
        name = type(self).__name__
        for what, value, allowed in (
            ("subset", subset, self.SUBSETS),
            ("split", split, self.SPLITS),
        ):
            if value not in allowed:
                raise UsageError(f"{name} {what} {short(value)}: it is one of {', '.join(allowed)}")
        self.subset, self.split = subset, split
        self.rows = HubRows(self.read_table(os.fspath(path)))

    def read_table(self, path):
        return read_parquet(
            split_files(path, self.subset, self.split, self.DATASET), self.COLUMNS, self.DATASET
        )

    def num_examples(self):
        return len(self.rows)

    def bad_row(self, index, why):
        """One line for a row whose content the task cannot use."""
        where = f"{self.DATASET} {self.subset}/{self.split} row {self.rows.row_number(index)}"
        return UsageError(f"{where}: {why}")


class ARC(HubTask):
    """AI2's grade-school science questions (allenai/ai2_arc): categorical, its letters as given."""

    DATASET = "allenai/ai2_arc"
    SUBSETS = ("ARC-Easy", "ARC-Challenge")
    SPLITS = ("train", "validation", "test")
    COLUMNS = {
        "question": "string",
        "choices": "{text: list of strings, label: list of strings}",
        "answerKey": "string",
    }
    eval_type = "categorical"

    def get_example(self, index):
        row = self.rows[index]
        letters, answer = row["choices"]["label"], row["answerKey"]
        if answer not in letters:
            raise self.bad_row(index, f"answerKey {short(answer)} is none of its labels {letters}")
        question = render_mc(row["question"], letters, row["choices"]["text"])
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        return {"messages": messages, "letters": letters}

    def evaluate(self, conversation, completion):
        return letter_is_right(conversation, completion, conversation["letters"])


class MMLU(HubTask):
    """57 subjects' four-choice questions (cais/mmlu, its 'all' subset): categorical. Finetuning
    reads auxiliary_train (100K questions from other tests), chat_eval test."""

    DATASET = "cais/mmlu"
    SUBSETS = ("all",)
    SPLITS = ("auxiliary_train", "validation", "dev", "test")
    COLUMNS = {
        "question": "string",
        "subject": "string",
        "choices": "list of strings",
        "answer": "int",
    }
    eval_type = "categorical"
    letters = MC_LETTERS

    def get_example(self, index):
        row = self.rows[index]
        choices, answer = row["choices"], row["answer"]
        if len(choices) != len(MC_LETTERS) or answer not in range(len(MC_LETTERS)):
            raise self.bad_row(index, f"{len(choices)} choices, answer {answer}: 4 and 0-3")
        question = render_mc(row["question"], MC_LETTERS, choices)
        messages = [
            {"role": "user", "content": question},
            {"role": "assistant", "content": MC_LETTERS[answer]},
        ]
        return {"messages": messages, "subject": row["subject"], "letters": MC_LETTERS}

    def evaluate(self, conversation, completion):
        return letter_is_right(conversation, completion, MC_LETTERS)


def letter_is_right(conversation, completion, letters):
    """Whether a categorical answer is the conversation's; chat_eval only asks about its letters."""
    if completion not in letters:
        raise UsageError(f"the answer {short(completion)} is none of the letters {list(letters)}")
    return completion == conversation["messages"][-1]["content"]


class GSM8K(HubTask):
    """Grade-school math word problems (openai/gsm8k): generative, the answer the number after
    '####'. Its solutions' calculator annotations <<48/2=24>> become a python part (48/2) and its
    python_output part (24), the tool calls the model learns to make."""

    DATASET = "openai/gsm8k"
    SUBSETS = ("main", "socratic")
    SPLITS = ("train", "test")
    COLUMNS = {"question": "string", "answer": "string"}
    eval_type = "generative"

    def get_example(self, index):
        row = self.rows[index]
        parts = []
        for piece in CALCULATOR_CALL.split(row["answer"]):  # text, call, text, ... ('' included)
            if piece.startswith("<<") and piece.endswith(">>"):
                expression, equals, result = piece[2:-2].rpartition("=")
                if not equals:  # no '=': the whole is the call, and its result is empty
                    expression, result = result, ""
                parts.append({"type": "python", "text": expression})
                parts.append({"type": "python_output", "text": result})
            else:
                parts.append({"type": "text", "text": piece})
        messages = [
            {"role": "user", "content": row["question"]},
            {"role": "assistant", "content": parts},
        ]
        return {"messages": messages}

    def evaluate(self, conversation, completion):
        return answer_is_right(conversation, completion)

    def reward(self, conversation, completion):
        """chat_rl's reward: 1.0 for the right answer, else 0.0."""
        return float(self.evaluate(conversation, completion))


def answer_is_right(conversation, completion):
    """1 if the completion's '####' number is the one in the reference's last part, else 0 (two
    answers without a number are equal, as in nanochat)."""
    if not isinstance(completion, str):
        raise UsageError(f"the completion is {short(completion)}: a GSM8K answer is a str")
    reference = conversation["messages"][-1]["content"][-1]["text"]
    return int(extract_answer(completion) == extract_answer(reference))


class HumanEval(HubTask):
    """OpenAI's 164 Python functions to complete (openai/openai_humaneval, or the jsonl[.gz] of
    openai/human-eval): generative, a completion right when the program of the prompt's imports, its
    code and the task's tests exits 0 in the sandbox. `run_python` is that sandbox
    (run.sandbox.run_python, given by the caller: this floor does not run code)."""

    DATASET = "openai/openai_humaneval"
    SUBSETS = ("openai_humaneval",)
    SPLITS = ("test",)
    COLUMNS = {
        "prompt": "string",
        "canonical_solution": "string",
        "test": "string",
        "entry_point": "string",
    }
    eval_type = "generative"

    def __init__(self, path, run_python=None, **kwargs):
        self.run_python = run_python
        super().__init__(path, "openai_humaneval", "test", **kwargs)

    def read_table(self, path):
        if not path.endswith((".jsonl", ".jsonl.gz")):
            return super().read_table(path)
        import pyarrow as pa

        what = f"each line is a JSON object with {', '.join(self.COLUMNS)} (openai/human-eval's)"
        rows = []
        for number, row in read_jsonl(path, what):
            if not isinstance(row, dict) or not all(
                isinstance(row.get(c), str) for c in self.COLUMNS
            ):
                raise UsageError(f"{path} line {number} holds {short(row)}: {what}")
            rows.append({column: row[column] for column in self.COLUMNS})
        return pa.Table.from_pylist(
            rows, schema=pa.schema([(c, pa.string()) for c in self.COLUMNS])
        )

    def get_example(self, index):
        row = self.rows[index]
        solution = f"{row['prompt']}\n{row['canonical_solution']}"
        messages = [
            {"role": "user", "content": row["prompt"]},
            {"role": "assistant", "content": solution},
        ]
        return {"messages": messages, "entry_point": row["entry_point"], "test": row["test"]}

    def evaluate(self, conversation, completion):
        if self.run_python is None:
            raise UsageError("HumanEval(path, run_python=run.sandbox.run_python): its sandbox")
        return self.run_python(program(conversation, completion)).success


def program(conversation, completion):
    """What HumanEval runs: the prompt's imports (a completion often leaves them out), the code of
    the completion, the task's tests and their call."""
    imports = leading_imports(conversation["messages"][0]["content"])
    code = extract_program(completion)
    return f"{imports}\n\n{code}\n\n{conversation['test']}\ncheck({conversation['entry_point']})"


def leading_imports(prompt):
    """The import lines at the top of a prompt, comments and blank lines skipped, stripped."""
    imports = []
    for line in map(str.strip, prompt.split("\n")):
        if line.startswith(("import ", "from ")):
            imports.append(line)
        elif line and not line.startswith("#"):
            break
    return "\n".join(imports)


def extract_program(completion):
    """The first ```python (or ```) block of a completion, else the whole of it, stripped."""
    blocks = CODE_BLOCK.findall(completion)
    return (blocks[0] if blocks else completion).strip()


class SmolTalk(HubTask):
    """General conversations (HuggingFaceTB/smol-smoltalk, 460K train, 24K test): training data,
    an optional system message, then user and assistant in turn."""

    DATASET = "HuggingFaceTB/smol-smoltalk"
    SUBSETS = ("default",)
    SPLITS = ("train", "test")
    COLUMNS = {"messages": "list of {role: string, content: string}"}

    def __init__(self, path, split, **kwargs):
        super().__init__(path, "default", split, **kwargs)

    def get_example(self, index):
        messages = self.rows[index]["messages"]
        turns = messages[1:] if messages and messages[0]["role"] == "system" else messages
        roles = [m["role"] for m in turns]
        if len(turns) < 2 or roles != [("user", "assistant")[i % 2] for i in range(len(turns))]:
            raise self.bad_row(index, f"roles {roles}: user and assistant in turn, two at least")
        if not all(isinstance(m["content"], str) for m in messages):
            raise self.bad_row(index, "a message without content")
        return {"messages": messages}
