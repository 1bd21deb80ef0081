"""The local tasks' data, read from files beside this one (any working directory): lm-eval's
`custom_dataset`."""

import re
from pathlib import Path

import datasets
from lm_eval.tasks.hellaswag.utils import process_docs

HERE = Path(__file__).resolve().parent
hellaswag_docs = process_docs  # lm-eval's own hellaswag preprocessing


def _jsonl(path, split):
    return datasets.DatasetDict({split: datasets.Dataset.from_json(str(path))})


def hellaswag_small(**_):
    """The 20 HellaSwag validation examples of the test fixture (the official jsonl's fields)."""
    return _jsonl(HERE.parent / "tests" / "fixtures" / "hellaswag_small.jsonl", "validation")


def shakespeare_docs(**_):
    return _jsonl(HERE / "data" / "shakespeare_docs.jsonl", "test")


def shakespeare_lines(**_):
    return _jsonl(HERE / "data" / "shakespeare_lines.jsonl", "test")


def perplexity_results(doc, results):
    """wikitext's metrics (lm-eval's preprocess_wikitext), over a plain text: words and bytes of the
    document."""
    (loglikelihood,) = results
    words, n_bytes = len(re.split(r"\s+", doc["text"])), len(doc["text"].encode("utf-8"))
    return {
        "word_perplexity": (loglikelihood, words),
        "byte_perplexity": (loglikelihood, n_bytes),
        "bits_per_byte": (loglikelihood, n_bytes),
    }
