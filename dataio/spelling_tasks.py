"""
nanochat's spelling tasks (tasks/spellingbee.py, deleted from nanochat in 950a1dc; read at its
parent): conversations made from a word list (dwyl/english-words' words_alpha.txt, one word a
line), example i drawn from random.Random(i) (the test split's from Random(10_000_000 + i)), so that
a task of any size needs no file but the words. SpellingBee counts a letter in a word, by hand and
then with a Python tool call, and ends on '#### N' (judged as GSM8K's); SimpleSpelling spells a
word, the hard part of counting for a model that sees tokens, not letters.
"""

import os
import random

from configurator import InputNotFound, UsageError
from dataio.chat_tasks import Task
from dataio.hub_tasks import answer_is_right

ALPHABET = "abcdefghijklmnopqrstuvwxyz"
WORDS_URL = "https://raw.githubusercontent.com/dwyl/english-words/refs/heads/master/words_alpha.txt"
TEST_SEED_OFFSET = 10_000_000  # past the 370K words, so the test split's seeds are not train's
SPLITS = ("train", "test")
# the user's question, in many phrasings and languages (nanochat's augmentation)
QUESTIONS = (
    "How many {letter} are in the word {word}",
    "How many {letter} are in {word}",
    "Count the number of {letter} in {word}",
    "How many times does {letter} appear in {word}",
    "What's the count of {letter} in {word}",
    "In the word {word}, how many {letter} are there",
    "How many letter {letter} are in the word {word}",
    "Count how many {letter} appear in {word}",
    "Tell me the number of {letter} in {word}",
    "How many occurrences of {letter} are in {word}",
    "Find the count of {letter} in {word}",
    "Can you count the {letter} letters in {word}",
    "What is the frequency of {letter} in {word}",
    "How many {letter}s are in {word}",
    "How many {letter}'s are in {word}",
    "Count all the {letter} in {word}",
    "How many times is {letter} in {word}",
    "Number of {letter} in {word}",
    "Total count of {letter} in {word}",
    "How many {letter} does {word} have",
    "How many {letter} does {word} contain",
    "What's the number of {letter} in {word}",
    "{word} has how many {letter}",
    "In {word}, count the {letter}",
    "How many {letter} appear in {word}",
    "Count the {letter} in {word}",
    "Give me the count of {letter} in {word}",
    "How many instances of {letter} in {word}",
    "Show me how many {letter} are in {word}",
    "Calculate the number of {letter} in {word}",
    "¿Cuántas {letter} hay en {word}?",
    "¿Cuántas veces aparece {letter} en {word}?",
    "Cuenta las {letter} en {word}",
    "¿Cuántas letras {letter} tiene {word}?",
    "{word}中有多少个{letter}",
    "{word}里有几个{letter}",
    "数一下{word}中的{letter}",
    "{word}这个词里有多少{letter}",
    "{word}에 {letter}가 몇 개 있나요",
    "{word}에서 {letter}의 개수는",
    "{word}에 {letter}가 몇 번 나오나요",
    "{word}라는 단어에 {letter}가 몇 개",
    "Combien de {letter} dans {word}",
    "Combien de fois {letter} apparaît dans {word}",
    "Compte les {letter} dans {word}",
    "Wie viele {letter} sind in {word}",
    "Wie oft kommt {letter} in {word} vor",
    "Zähle die {letter} in {word}",
    "{word}に{letter}は何個ありますか",
    "{word}の中に{letter}がいくつ",
    "{word}に{letter}が何回出てくる",
)


def read_words(path):
    """The word list: each line stripped, as nanochat reads it (a blank line, which nanochat would
    draw and fail on, is refused)."""
    if not os.path.isfile(path):
        raise InputNotFound(f"no word list {path}: download {WORDS_URL}")
    try:
        with open(path, encoding="utf-8") as f:
            words = [line.strip() for line in f]
    except UnicodeDecodeError:
        raise UsageError(f"{path} is not UTF-8 text: one word a line, as {WORDS_URL}") from None
    for number, word in enumerate(words, 1):
        if not word:
            raise UsageError(f"{path} line {number} is blank: one word a line, as {WORDS_URL}")
    if not words:
        raise UsageError(f"{path} is empty: one word a line, as {WORDS_URL}")
    return words


class SpellingTask(Task):
    """`size` examples drawn from the words at `path`, for `split`."""

    eval_type = "generative"

    def __init__(self, path, size=1000, split="train", **kwargs):
        super().__init__(**kwargs)
        if split not in SPLITS:
            raise UsageError(f"{type(self).__name__} split {split!r}: it is train or test")
        self.size, self.split = size, split
        self.words = read_words(path)

    def num_examples(self):
        return self.size

    def rng(self, index):
        return random.Random(index if self.split == "train" else TEST_SEED_OFFSET + index)


class SpellingBee(SpellingTask):
    """'How many r are in strawberry?': the word spelt out, the letter counted along it, the count
    checked with a Python call ('strawberry'.count('r')), then '#### 3'."""

    def get_example(self, index):
        rng = self.rng(index)
        word = rng.choice(self.words)
        letter = rng.choice(word) if rng.random() < 0.9 else rng.choice(ALPHABET)
        count = word.count(letter)
        question = rng.choice(QUESTIONS)
        if rng.random() < 0.3:  # some people never press shift
            question = question.lower()
        letter_quote, word_quote = rng.choice(["", "'", '"']), rng.choice(["", "'", '"'])
        question = question.format(
            letter=f"{letter_quote}{letter}{letter_quote}", word=f"{word_quote}{word}{word_quote}"
        )
        if rng.random() < 0.5:  # and half leave out the question mark
            question += "?"
        lines = [
            f"We are asked to find the number '{letter}' in the word '{word}'. "
            "Let me try a manual approach first.\n",
            "First spell the word out:",
            f"{word}:{','.join(word)}\n",
            f"Then count the occurrences of '{letter}':",
        ]
        hits = 0
        for position, char in enumerate(word, 1):
            hits += char == letter
            # no space between position and letter: " a" is another token than "a"
            lines.append(
                f"{position}:{char} hit! count={hits}" if char == letter else f"{position}:{char}"
            )
        parts = [
            {"type": "text", "text": "\n".join(lines) + f"\n\nThis gives us {hits}."},
            {"type": "text", "text": "\n\nLet me double check this using Python:\n\n"},
            {"type": "python", "text": f"'{word}'.count('{letter}')"},
            {"type": "python_output", "text": str(count)},
            {
                "type": "text",
                "text": f"\n\nPython gives us {count}.\n\nMy final answer is:\n\n#### {count}",
            },
        ]
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": parts}]
        return {"messages": messages}

    def evaluate(self, conversation, completion):
        return answer_is_right(conversation, completion)

    def reward(self, conversation, completion):
        return float(self.evaluate(conversation, completion))


class SimpleSpelling(SpellingTask):
    """'Spell the word: apple' -> 'apple:a,p,p,l,e', over the words in another order (shuffled by
    Random(42)) than SpellingBee's. Training data: nanochat gives it no evaluation."""

    def __init__(self, path, size=1000, split="train", **kwargs):
        super().__init__(path, size, split, **kwargs)
        random.Random(42).shuffle(self.words)

    def get_example(self, index):
        word = self.rng(index).choice(self.words)
        messages = [
            {"role": "user", "content": f"Spell the word: {word}"},
            {"role": "assistant", "content": f"{word}:{','.join(word)}"},
        ]
        return {"messages": messages}

    def evaluate(self, conversation, completion):
        raise UsageError("SimpleSpelling is training data: chat_eval does not score it")
