"""dataio/bestfit_loader.py: nanochat's BOS-aligned best-fit packing, by hand on a tiny case, its
rows' properties on shards, its exact resume, and (NANOCHAT_CHECKOUT set) nanochat's own loader on
the same shards."""

import os
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from configurator import UsageError
from dataio import bestfit_loader
from dataio.bestfit_loader import BestFitLoader, DocumentStream

BOS = 300  # the byte-level stand-in tokenizer's: ids 0..255 are bytes


def encode(texts):
    return [[BOS] + list(t.encode()) for t in texts]


def read(path, group):
    return pq.ParquetFile(path).read_row_group(group, columns=["text"]).column("text").to_pylist()


def row_groups(path):
    return pq.ParquetFile(path).num_row_groups


def write_shards(folder, shards, group_size):
    """Each shard's texts as shard_{k:05d}.parquet, `group_size` documents a row group."""
    paths = []
    for k, texts in enumerate(shards):
        path = os.path.join(folder, f"shard_{k:05d}.parquet")
        pq.write_table(pa.table({"text": texts}), path, row_group_size=group_size)
        paths.append(path)
    return paths


def texts_of(seed, n, longest=40):
    rng = np.random.default_rng(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    return ["".join(rng.choice(list(letters), rng.integers(1, longest))) for _ in range(n)]


@pytest.fixture
def shards(tmp_path):
    return write_shards(tmp_path, [texts_of(k, 300) for k in range(3)], group_size=50)


def loader(paths, T=24, rows=2, rank=0, world=1):
    return BestFitLoader(DocumentStream(paths, read, row_groups, rank, world), encode, T, rows)


def test_a_tiny_case_packs_as_worked_out_by_hand(tmp_path, monkeypatch):
    """Buffer 3, batches of 2: rows of T + 1 = 8 tokens from documents of 5, 3, 9, 2, 6, 4 tokens
    (BOS + 4, 2, 8, 1, 5, 3 letters)."""
    monkeypatch.setattr(bestfit_loader, "BUFFER_SIZE", 3)
    monkeypatch.setattr(bestfit_loader, "TOKENIZER_BATCH", 2)
    docs = ["aaaa", "bb", "cccccccc", "d", "eeeee", "fff"]
    (path,) = write_shards(tmp_path, [docs], group_size=6)
    x, y = loader([path], T=7, rows=4).next(1)
    # row 0: buffer a5 b3 c9 d2 -> a5 (the largest that fits 8), then b3 (fits the 3 left)
    # row 1: buffer c9 d2 e6 f4 -> e6, then d2
    # row 2: buffer c9 f4 a5 b3 (the second epoch's first batch) -> a5, then b3
    # row 3: buffer c9 f4 c9 d2 -> f4, d2, then 2 left: buffer c9 c9 e6 f4, none fits: the first
    #   shortest, f4, cropped to 2
    a, b, c, d, e, f = encode(docs)
    rows = [a + b, e + d, a + b, f + d + f[:2]]
    assert all(len(r) == 8 for r in rows)
    assert x[0].tolist() == [r[:-1] for r in rows] and y[0].tolist() == [r[1:] for r in rows]


def test_rows_start_with_bos_and_are_documents_then_one_cropped(shards):
    texts = [t for p in shards[:-1] for t in texts_of(shards.index(p), 300)]
    whole = {tuple(d) for d in encode(texts)}
    x, y = loader(shards[:-1]).next(3)
    assert x.shape == y.shape == (3, 2, 24) and x.dtype == np.int32
    for row in np.concatenate([x, y[..., -1:]], axis=-1).reshape(-1, 25).tolist():
        assert row[0] == BOS
        starts = [i for i, t in enumerate(row) if t == BOS] + [len(row)]
        docs = [tuple(row[i:j]) for i, j in zip(starts, starts[1:])]
        assert all(doc in whole for doc in docs[:-1])  # whole documents, then
        assert any(doc[: len(docs[-1])] == docs[-1] for doc in whole)  # a document's start


def test_resume_continues_exactly(shards):
    """A loader restored from another's state after k batches gives the batches the other gives
    next: the buffered documents read again, epochs included."""
    first = loader(shards, T=64, rows=3)
    for _ in range(6):
        first.next(2)
    state = first.state_dict()
    second = loader(shards, T=64, rows=3)
    second.load_state_dict(state)
    for _ in range(40):  # through the end of the shards and into the next epoch
        a, b = first.next(2), second.next(2)
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    assert first.position[0] == 2  # the second epoch was reached


def test_processes_read_their_own_row_groups(shards):
    seen = []
    for rank in (0, 1):
        one = loader(shards, rank=rank, world=2)
        one.next(4)
        seen.append({(s, g) for s, g, _ in one.state_dict()["buffer"]})
        assert all(g % 2 == rank for _, g in seen[-1])
    assert not seen[0] & seen[1]


def test_eval_batches_are_the_same_every_time(shards):
    val = loader(shards[-1:])
    one, two = list(val.eval_batches(3)), list(val.eval_batches(3))
    assert len(one) == 3 and one[0][0].shape == (2, 24)
    assert all(np.array_equal(a[0], b[0]) for a, b in zip(one, two))


def test_a_state_from_other_shards_is_one_line(shards):
    one = loader(shards)
    one.next(1)
    state = one.state_dict()
    state["buffer"][0] = [7, 0, 0]
    with pytest.raises(UsageError, match="resume on the shards it was saved with"):
        loader(shards).load_state_dict(state)
    with pytest.raises(UsageError, match="give process 7 of 8 nothing"):
        loader(shards[:1], rank=7, world=8)  # 6 row groups


@pytest.mark.skipif(
    not os.environ.get("NANOCHAT_CHECKOUT"),
    reason="nanochat's own loader: set NANOCHAT_CHECKOUT to a karpathy/nanochat checkout",
)
@pytest.mark.parametrize("rank", [0, 1])
def test_nanochats_own_loader_gives_the_same_rows(shards, monkeypatch, rank):
    sys.path.insert(0, os.environ["NANOCHAT_CHECKOUT"])
    try:
        from nanochat import dataloader
    finally:
        sys.path.pop(0)

    class Tokenizer:  # what its loader asks of nanochat's tokenizer
        def get_bos_token_id(self):
            return BOS

        def encode(self, texts, prepend, num_threads):
            assert prepend == BOS
            return encode(texts)

    monkeypatch.setattr(dataloader, "list_parquet_files", lambda **_: list(shards))
    monkeypatch.setattr(dataloader, "get_dist_info", lambda: (True, rank, rank, 2))
    theirs = dataloader.tokenizing_distributed_data_loader_with_state_bos_bestfit(
        Tokenizer(), 2, 24, "train", device="cpu"
    )
    ours = loader(shards[:-1], rank=rank, world=2)
    for _ in range(30):
        x, y, _ = next(theirs)
        ox, oy = ours.next(1)
        assert x.tolist() == ox[0].tolist() and y.tolist() == oy[0].tolist()


def test_a_nanochat_folder_loads_through_make_loader(tmp_path):
    """data/nanochat's layout (shards/, tokenizer/): the train loader packs the train shards in the
    folder's tokenizer; a process of two packs the rows rank 1 of 2 packs."""
    from dataio.chat_tokenizer import ChatTokenizer
    from dataio.dataloader import make_loader

    os.makedirs(tmp_path / "shards")
    shards = write_shards(tmp_path / "shards", [texts_of(k, 200) for k in range(3)], 40)
    tokenizer = ChatTokenizer.train((t for k in range(2) for t in texts_of(k, 200)), 300)
    tokenizer.save(tmp_path / "tokenizer", token_bytes_pt=False)
    x, y = make_loader(str(tmp_path), "train", 16, 4, seed=0, vocab_size=300).next(2)
    assert x.shape == (2, 4, 16) and (x[..., 0] == tokenizer.bos_token_id).all()
    assert np.array_equal(x[..., 1:], y[..., :-1])
    half = make_loader(str(tmp_path), "train", 16, 4, seed=0, row_slice=slice(2, 4))
    stream = DocumentStream(shards[:-1], read, row_groups, rank=1, world=2)
    bos = tokenizer.bos_token_id
    alone = BestFitLoader(stream, lambda t: tokenizer.encode(t, prepend=bos), 16, 2)
    assert np.array_equal(half.next(3)[0], alone.next(3)[0])
    val = make_loader(str(tmp_path), "val", 16, 4, seed=0)
    val.next(1)
    assert val.stream.paths == shards[-1:]
    assert {s for s, _, _ in val.state_dict()["buffer"]} == {0}
