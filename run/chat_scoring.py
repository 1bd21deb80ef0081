"""
nanochat's chat_eval (karpathy/nanochat, scripts/chat_eval.py) over any of our models: a task's
problems scored as its run_chat_eval scores them, and ChatCORE over the tasks.

- categorical (ARC, MMLU): the problems in batches of `batch_size`, each prompt rendered by
  render_for_completion and padded on the right with <|bos|> (the causal model never sees it); the
  logits at each prompt's last position narrowed to the problem's letters, the argmax the
  predicted letter, judged by the task's evaluate. No sampling: the model is asked only which letter
  it prefers.
- generative (GSM8K, HumanEval, SpellingBee): one problem at a time, `num_samples` completions
  sampled by the engine (run/chat_engine.py: the calculator tool in play) from the prompt, each
  decoded and judged by evaluate; a problem passes when any of them does.

ChatCORE (chatcore) is CORE's centering: each task's accuracy moved so that guessing scores 0 and
a perfect model 1, then their mean; chat_eval prints it only when all five of its tasks were
scored. The logits are jitted with fixed shapes (a batch of `batch_size` rows, lengths rounded up to
whole LENGTH_BUCKETs): a new batch compiles nothing unless its longest prompt needs a longer bucket.
"""

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configurator import UsageError
from dataio.conversations import render_for_completion
from dataio.task_folder import CHAT_EVAL_BASELINES, chat_eval_task
from run.chat_engine import Engine
from run.sandbox import run_python

# chat_eval's all_tasks, in its order: what it scores by default and what ChatCORE needs
CHAT_EVAL_TASKS = ("ARC-Easy", "ARC-Challenge", "MMLU", "GSM8K", "HumanEval")
LENGTH_BUCKET = 64  # a batch's length is rounded up to this: few lengths, few compilations


@dataclass
class Settings:
    """chat_eval's settings (its defaults): categorical batches of `batch_size`, and the generative
    tasks' sampling: `num_samples` completions of at most `max_new_tokens` each, at `temperature`
    (0: greedy) from the `top_k` most likely tokens. `max_problems` None: every problem."""

    batch_size: int = 8
    num_samples: int = 1
    max_new_tokens: int = 512
    temperature: float = 0.0
    top_k: int = 50
    max_problems: int | None = None

    def check(self):
        """One line for the first bad setting."""
        for key in ("batch_size", "num_samples", "max_new_tokens"):
            value = getattr(self, key)
            if not (isinstance(value, int) and value >= 1):
                raise UsageError(f"{key} must be an integer >= 1, got {value!r}")
        if self.max_problems is not None and not (
            isinstance(self.max_problems, int) and self.max_problems >= 1
        ):
            raise UsageError(
                f"max_problems must be an integer >= 1 or None, got {self.max_problems!r}"
            )
        if not self.temperature >= 0:
            raise UsageError(f"temperature must be >= 0 (0: greedy), got {self.temperature}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise UsageError(f"top_k must be an integer >= 0 (0: no top-k), got {self.top_k!r}")
        return self


def task_names(tasks):
    """--tasks ('ARC-Easy,MMLU', nanochat's names; '' for chat_eval's five) -> the names, each one
    chat_eval knows, or one line."""
    names = [t.strip() for t in tasks.split(",") if t.strip()] if tasks else list(CHAT_EVAL_TASKS)
    for name in names:
        if name not in CHAT_EVAL_BASELINES:
            raise UsageError(
                f"no chat_eval task {name!r}: give --tasks as a comma-separated list of "
                f"{', '.join(CHAT_EVAL_BASELINES)}"
            )
    return names


def load_tasks(names, root):
    """{name: task} from the task files under `root` (dataio/task_folder.py), every file read
    before a model is loaded; HumanEval's programs run in the sandbox."""
    return {name: chat_eval_task(name, root, run_python=run_python) for name in names}


def chatcore(accuracies):
    """chat_eval's ChatCORE of {task: accuracy}: the mean of (accuracy - baseline) / (1 -
    baseline) over every task given, or None unless all of CHAT_EVAL_TASKS are among them."""
    if not all(name in accuracies for name in CHAT_EVAL_TASKS):
        return None
    centered = [
        (acc - CHAT_EVAL_BASELINES.get(name, 0.0)) / (1.0 - CHAT_EVAL_BASELINES.get(name, 0.0))
        for name, acc in accuracies.items()
    ]
    return sum(centered) / len(centered)


def problem_count(task, max_problems):
    return len(task) if max_problems is None else min(len(task), max_problems)


class ChatScorer:
    """Scores `model` (any of ours) with `tokenizer` (nanochat's interface:
    dataio/chat_tokenizer.ChatTokenizer) on chat_eval's tasks; progress and results printed to
    stdout unless `quiet`. Its logits and its engine compile once for the model's structure; the
    weights are read at each call, so a model that trains between calls (SFT) is scored as it is."""

    def __init__(self, model, tokenizer, quiet=False):
        self.model, self.tokenizer, self.quiet = model, tokenizer, quiet
        self.engine = Engine(model, tokenizer)
        graphdef = nnx.graphdef(model)
        self._logits_at = jax.jit(lambda state, ids, at: logits_at(graphdef, state, ids, at))
        self._letter_ids = {}  # letter -> its token id (chat_eval's letter_to_id_cache)

    def say(self, *args, **kwargs):
        if not self.quiet:
            print(*args, **kwargs, flush=True)

    def logits(self, prompts, rows):
        """Lists of ids -> (len(prompts), V) float32 numpy: each prompt's logits at its last token,
        from one forward of `rows` rows (the prompts, then <|bos|> rows) padded with <|bos|>."""
        block = self.model.config.block_size
        longest = max(map(len, prompts))
        if longest > block:
            raise UsageError(
                f"a prompt of {longest} tokens is longer than the model's context ({block}): "
                "score a model with a longer context, or tasks with shorter prompts"
            )
        length = min(-(-longest // LENGTH_BUCKET) * LENGTH_BUCKET, block)
        ids = np.full((rows, length), self.tokenizer.get_bos_token_id(), np.int32)  # (B, T)
        at = np.zeros(rows, np.int32)
        for row, prompt in enumerate(prompts):
            ids[row, : len(prompt)] = prompt
            at[row] = len(prompt) - 1  # the answer's position: the logits after <|assistant_start|>
        out = self._logits_at(nnx.state(self.model), jnp.asarray(ids), jnp.asarray(at))
        return np.asarray(out)[: len(prompts)]

    def letter_id(self, letter):
        if letter not in self._letter_ids:
            ids = self.tokenizer.encode(letter)
            if len(ids) != 1:
                raise UsageError(
                    f"the answer letter {letter!r} is {len(ids)} tokens in this tokenizer: each "
                    "letter must be a single token (chat_eval compares their logits)"
                )
            self._letter_ids[letter] = ids[0]
        return self._letter_ids[letter]

    def predicted_letters(self, task, batch_size=8, max_problems=None):
        """run_categorical_eval's prediction of each of the first max_problems problems: the
        letter, among the problem's, whose logit after <|assistant_start|> is the largest (the
        first of equals, as torch's argmax)."""
        n = problem_count(task, max_problems)
        letters = []
        for start in range(0, n, batch_size):
            conversations = [task[i] for i in range(start, min(start + batch_size, n))]
            prompts = [render_for_completion(self.tokenizer, c) for c in conversations]
            for logits, conversation in zip(self.logits(prompts, batch_size), conversations):
                choices = conversation["letters"]
                narrowed = logits[[self.letter_id(letter) for letter in choices]]
                letters.append(choices[int(np.argmax(narrowed))])
        return letters

    def completions(self, conversation, settings):
        """run_generative_eval's completions of one problem: `num_samples` texts, each the tokens
        the engine took after the prompt (its tool's output included), decoded."""
        prompt = render_for_completion(self.tokenizer, conversation)
        results, _ = self.engine.generate_batch(
            prompt,
            num_samples=settings.num_samples,
            max_tokens=settings.max_new_tokens,
            temperature=settings.temperature,
            top_k=settings.top_k,
        )
        return [self.tokenizer.decode(row[len(prompt) :]) for row in results]

    def outcomes(self, task, settings=None):
        """Each problem's pass (True) or fail, scored as chat_eval scores the task's eval_type."""
        settings = (settings or Settings()).check()
        n = problem_count(task, settings.max_problems)
        if task.eval_type == "categorical":
            letters = self.predicted_letters(task, settings.batch_size, settings.max_problems)
            return [bool(task.evaluate(task[i], letter)) for i, letter in enumerate(letters)]
        if task.eval_type != "generative":
            raise UsageError(f"{type(task).__name__} is not a chat_eval task (its eval_type)")
        passed = []
        for i in range(n):
            conversation = task[i]
            judged = [
                task.evaluate(conversation, c) for c in self.completions(conversation, settings)
            ]
            passed.append(any(judged))
            k = sum(passed)
            self.say(f"\r\033[K{k}/{len(passed)} ({100 * k / len(passed):.2f}%)", end="")
        self.say()  # the progress line ends
        self.say("=" * 50)
        return passed

    def accuracy(self, task, settings=None):
        """run_chat_eval's accuracy on `task`, its "Final: passed/total (percent)" printed."""
        passed = self.outcomes(task, settings)
        if not passed:
            raise UsageError(f"{type(task).__name__} has no problems to score")
        acc = sum(passed) / len(passed)
        self.say(f"Final: {sum(passed)}/{len(passed)} ({100 * acc:.2f}%)")
        return acc

    def score(self, tasks, settings=None):
        """chat_eval's run over {name: task}: each task's accuracy printed as it prints it, then
        ChatCORE when all its five tasks were scored. -> ({name: accuracy}, ChatCORE or None)."""
        accuracies = {}
        for name, task in tasks.items():
            accuracies[name] = self.accuracy(task, settings)
            self.say(f"{name} accuracy: {100 * accuracies[name]:.2f}%")
        core = chatcore(accuracies)
        if core is not None:
            self.say(f"ChatCORE metric: {core:.4f}")
        return accuracies, core


def logits_at(graphdef, state, ids, at):
    """ids (B, T), at (B,) -> (B, V) float32: each row's logits at its position `at`, the head
    applied to those positions only."""
    model = nnx.merge(graphdef, state)
    _, x = model.hidden_states(ids)  # (B, T, C)
    x = jnp.take_along_axis(x, at[:, None, None], axis=1)[:, 0]  # (B, C)
    return model.logits(x).astype(jnp.float32)  # (B, V)
