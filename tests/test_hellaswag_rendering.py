"""python -m pytest tests/test_hellaswag_rendering.py -q

HellaSwag without a model: the fixture file in the real format; build-nanogpt's rendering (its rows
and mask, by the reference's own code), a long context cut from the left (from a file too, as
train.py and hellaswag.py read it); the length buckets, and batches that score only ending tokens;
the accuracies and the parity check's figures worked by hand (the scorer and the command lines:
test_hellaswag.py; the fixture's examples rendered: helpers/hellaswag.py)."""

import json
import re

import numpy as np
import pytest
from helpers.hellaswag import FIXTURE

import hellaswag
from dataio import hellaswag_data
from parity import check_hellaswag

# ------------------------------------------------------------------------------------------------
# reading and rendering


def test_fixture_is_the_real_format():
    raw = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
    assert len(raw) == 20
    keys = {
        "ind",
        "activity_label",
        "ctx_a",
        "ctx_b",
        "ctx",
        "split",
        "split_type",
        "label",
        "endings",
        "source_id",
    }
    assert all(set(ex) == keys for ex in raw)
    assert {type(ex["label"]) for ex in raw} == {int, str}  # both spellings of a label occur
    # endings starting with punctuation
    assert any(e[0] in ",.'-(" for ex in raw for e in ex["endings"])
    exs = hellaswag_data.read_examples(str(FIXTURE))
    assert [ex["label"] for ex in exs] == [int(ex["label"]) for ex in raw]
    assert all(isinstance(ex["label"], int) for ex in exs)
    assert [ex["_line"] for ex in exs] == list(range(1, 21))
    assert len(hellaswag_data.read_examples(str(FIXTURE), limit=5)) == 5


def test_rendering_matches_build_nanogpt(examples, reference_rows):
    """Our rendering against the reference's (its own tokenizer settings, rows and mask, as
    build-nanogpt's)."""
    from dataio.tokenizer import get_encoding

    enc = get_encoding()
    raw = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
    for i, (ex, r, (tokens, mask, label)) in enumerate(zip(raw, examples, reference_rows)):
        assert r.ctx == enc.encode(ex["ctx"]) and r.truncated == 0
        # the place each result names (hellaswag.py --out)
        assert (r.line, r.ind) == (i + 1, ex["ind"])
        assert r.endings == [enc.encode(" " + e) for e in ex["endings"]]
        # the space belongs to the ending's first token, punctuation included
        assert all(enc.decode(e[:1])[0] == " " for e in r.endings)
        assert label == r.label
        assert tokens.shape == mask.shape == (4, len(r.ctx) + max(len(e) for e in r.endings))
        for i, e in enumerate(r.endings):
            n = len(r.ctx) + len(e)
            assert tokens[i, :n].tolist() == r.ctx + e
            assert mask[i].tolist() == [0] * len(r.ctx) + [1] * len(e) + [0] * (tokens.shape[1] - n)
            assert (tokens[i, n:] == hellaswag.PAD).all()
    # not from a file
    unnumbered = hellaswag_data.render_example({k: v for k, v in raw[0].items() if k != "ind"})
    assert (unnumbered.line, unnumbered.ind) == (0, None)
    long = max(examples, key=lambda r: len(r.ctx))
    # the fixture's long context
    assert len(long.ctx) > 3 * np.median([len(r.ctx) for r in examples])


def test_long_context_is_cut_from_the_left():
    ex = hellaswag_data.read_examples(str(FIXTURE))[10]  # the long WikiHow context
    full = hellaswag_data.render_example(ex)
    cut = hellaswag_data.render_example(ex, max_len=64)
    longest = max(len(e) for e in full.endings)
    assert cut.endings == full.endings  # endings are scored whole
    assert cut.truncated == len(full.ctx) + longest - 64 > 0
    assert cut.ctx == full.ctx[cut.truncated :] and len(cut.ctx) + longest == 64
    # the same cut
    tokens, mask, _ = check_hellaswag.render_example(ex, check_hellaswag.reference_encoding(), 64)
    assert (
        tokens.shape == (4, 64)
        and [row[m == 1].tolist() for row, m in zip(tokens, mask)] == cut.endings
    )
    assert (tokens[:, : len(cut.ctx)] == cut.ctx).all()
    with pytest.raises(ValueError, match="no room for context"):
        hellaswag_data.render_example(ex, max_len=longest)
    # from the file, as train.py (load_examples) and hellaswag.py (render_all) read it: the same
    # cut, `limit` examples, and an error naming the file and line
    loaded = hellaswag_data.load_examples(str(FIXTURE), max_len=64, limit=11)
    assert len(loaded) == 11 and loaded[10] == cut
    assert (
        hellaswag.render_all(hellaswag_data.read_examples(str(FIXTURE), 11), 64, str(FIXTURE))
        == loaded
    )
    with pytest.raises(
        ValueError, match=rf"^{re.escape(str(FIXTURE))}:\d+: an ending of \d+ tokens leaves no room"
    ):
        hellaswag_data.load_examples(str(FIXTURE), max_len=longest)
    with pytest.raises(ValueError, match=r"^f\.jsonl:11: an ending of \d+ tokens leaves no room"):
        hellaswag.render_all([ex], longest, "f.jsonl")
    with pytest.raises(
        ValueError, match=r"^f\.jsonl:11: empty context: the first ending token would have nothing"
    ):
        hellaswag.render_all([dict(ex, ctx="")], 64, "f.jsonl")


def test_a_length_takes_the_least_bucket_that_holds_it_and_past_the_last_the_cap():
    assert [hellaswag.bucket(n, (32, 40), 64) for n in (1, 32, 33, 40, 41, 64)] == [
        32,
        32,
        40,
        40,
        64,
        64,
    ]
    assert hellaswag.bucket(30, (32, 40), 24) == 24  # the cap: the model's block_size


def test_batches_score_only_ending_tokens(examples):
    plan = hellaswag.plan_batches(examples, batch_size=8, block_size=128)
    assert sorted(i for *_, idx in plan for i in idx) == list(range(len(examples)))
    # by length: few shapes, little padding
    assert [L for L, *_ in plan] == sorted(L for L, *_ in plan)
    for L, E, n, idx in plan:
        assert len(idx) <= n and L in hellaswag.LENGTH_BUCKETS and E in hellaswag.ENDING_BUCKETS
        b = hellaswag.make_batch([examples[i] for i in idx], n, L, E)
        assert b.tokens.shape == (4 * n, L) and b.pos.shape == b.targets.shape == (4 * n, E)
        for k, i in enumerate(idx):
            r = examples[i]
            for j, e in enumerate(r.endings):
                row = 4 * k + j
                assert b.targets[row].tolist() == e + [-1] * (E - len(e))  # -1: not scored
                # each target is the token right after the position that predicts it
                assert b.tokens[row, b.pos[row, : len(e)] + 1].tolist() == e
                assert b.pos[row, 0] == len(r.ctx) - 1
        assert (b.targets[4 * len(idx) :] == -1).all()  # filler rows are never scored
    # a last batch of k examples: per batch shard, the least power of two that holds its share (1, 2
    # shards)
    for n_shards in (1, 2):
        batch_size = 8 // n_shards
        for k in range(1, 9):
            *full, (_, _, n, idx) = hellaswag.plan_batches(
                examples[: 8 + k], batch_size, 128, n_shards
            )
            assert [len(b[-1]) for b in full] == [8] and len(idx) == k
            per_shard = 1
            while per_shard * n_shards < k:
                per_shard *= 2
            assert n == n_shards * min(per_shard, batch_size), (n_shards, k, n)


# ------------------------------------------------------------------------------------------------
# the accuracies and the parity check's figures, by hand


def test_accuracies_worked_by_hand():
    """acc counts the lowest summed loss, acc_norm the lowest mean loss; a tie goes to the lower
    index."""
    cases = [  # label, summed losses, ending lengths -> pred, pred_norm
        # means 4, 3, 3, 2: acc right, acc_norm wrong
        (0, [4.0, 6.0, 9.0, 8.0], [1, 2, 3, 4], 0, 3),
        (1, [3.0, 1.0, 1.0, 5.0], [2, 2, 2, 2], 1, 1),  # a tie, both right
        # means 2, 3, 4, 1: acc right, acc_norm wrong
        (0, [2.0, 3.0, 4.0, 4.0], [1, 1, 1, 4], 0, 3),
        (3, [5.0, 5.0, 6.0, 2.0], [1, 1, 1, 1], 3, 3),  # both right
        (0, [2.0, 1.0, 3.0, 3.0], [1, 1, 1, 1], 1, 1),  # both wrong
    ]
    results = []
    for line, (label, sums, lengths, pred, pred_norm) in enumerate(cases, 1):
        r = hellaswag_data.Rendered([1], [[7] * n for n in lengths], label, line)
        res = hellaswag.make_result(r, sums, [s / n for s, n in zip(sums, lengths)])
        assert (res.pred, res.pred_norm, res.line) == (pred, pred_norm, line)
        results.append(res)
    score = hellaswag.summarize(results)
    assert (score.acc, score.acc_norm, score.count) == (4 / 5, 2 / 5, 5)


def test_parity_figures():
    """compare / agree on hand-made scores: a flipped prediction or a loss 2e-5 off fails, 5e-6 off
    passes."""
    r = hellaswag_data.Rendered([1], [[2], [3, 4], [5], [6]], 0, 1)
    ref = hellaswag.summarize(
        [hellaswag.make_result(r, [1.0, 3.0, 2.0, 4.0], [1.0, 1.5, 2.0, 4.0])]
    )
    for sums, means, ok in [
        ([1.0, 3.0, 2.0, 4.0], [1.0, 1.5, 2.0, 4.0], True),
        ([1.0, 3.0, 2.0, 4.00002], [1.0, 1.5, 2.0, 4.0], True),  # 5e-6
        ([1.0, 3.0, 2.0, 4.00008], [1.0, 1.5, 2.0, 4.0], False),  # 2e-5
        # pred_norm 3, not 0
        ([1.0, 3.0, 2.0, 4.0], [1.0, 1.5, 2.0, 0.5], False),
    ]:
        ours = hellaswag.summarize([hellaswag.make_result(r, sums, means)])
        figures = check_hellaswag.compare(ref, ours)
        assert check_hellaswag.agree(figures, 1) == ok, (sums, means, figures)
    assert figures["mean"]["max_abs"] == 3.5 and figures["mean"]["same_preds"] == 0
    assert (figures["mean"]["acc_ref"], figures["mean"]["acc"]) == (1.0, 0.0)
