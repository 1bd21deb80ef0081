"""HellaSwag's test fixture, for test_hellaswag.py and test_hellaswag_rendering.py (conftest.py's
`examples` and `reference_rows`): its examples as we render them and as build-nanogpt's reference
does, at the tiny model's block size."""

from pathlib import Path

from dataio import hellaswag_data
from helpers import HELLASWAG_FIXTURE
from parity import check_hellaswag

FIXTURE = Path(HELLASWAG_FIXTURE)
BLOCK = 128  # the tiny model's n_positions: the longest row a rendered example may have


def examples():
    return hellaswag_data.load_examples(str(FIXTURE), max_len=BLOCK)


def reference_rows():
    """build-nanogpt's (tokens, mask, label) of each fixture example, by the reference's own
    code."""
    enc = check_hellaswag.reference_encoding()
    return [
        check_hellaswag.render_example(ex, enc, BLOCK)
        for _, ex in check_hellaswag.iterate_examples(str(FIXTURE))
    ]
