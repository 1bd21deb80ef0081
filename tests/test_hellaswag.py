"""python -m pytest tests/test_hellaswag.py -q

HellaSwag scored: the batched JAX scorer (padding never changes a loss) against a numpy computation
from full logits and against the torch reference (transformers' GPT2LMHeadModel,
parity/check_hellaswag.py) on a random HF checkpoint, 8 fake devices against 1, both command lines
(hellaswag.py, python -m parity.check_hellaswag) end to end, in process, and a bug planted in our
loaders caught by the parity check. The rendering, batching and accuracies without a model:
tests/test_hellaswag_rendering.py; bad input and the download: tests/test_hellaswag_input.py.
"""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_close, fake_devices, transpose_c_proj_on_restore
from helpers.hellaswag import BLOCK, FIXTURE

import hellaswag
from compute import sharding
from dataio import hellaswag_data
from parity import check_hellaswag

ROOT = Path(__file__).resolve().parent.parent
TINY = dict(n_layer=2, n_head=2, n_embd=64, n_positions=BLOCK)  # vocab 50257: real BPE tokens
LOSS_RTOL = 1e-5  # fp32, relative, per ending loss (the bar)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from parity.common import save_random_hf_model

    return str(save_random_hf_model(tmp_path_factory.mktemp("hf") / "tiny", seed=0, **TINY))


@pytest.fixture(scope="module")
def model(hf_dir):
    from model import GPT

    return GPT.from_pretrained(hf_dir)


@pytest.fixture(scope="module")
def jax_score(model, examples):
    # 3 batches of 8, 8 and 4 examples: the scorer's batching, bucketing and reordering all take
    # part
    return hellaswag.evaluate(model, examples, batch_size=8)


def losses(score):
    return np.array([r.sum_losses + r.mean_losses for r in score.results])  # (N, 8)


# ------------------------------------------------------------------------------------------------
# the scorer


def test_padding_never_changes_a_loss(model, examples):
    """The same batch with random ids in every padded slot (after each row's end, and in filler
    rows)."""
    import jax

    mesh = hellaswag.make_mesh(jax.devices()[:1])
    # jax_score's last batch shape: no recompile
    L, E, n, idx = hellaswag.plan_batches(examples, 8, 128)[-1]
    idx = idx[: n - 1]  # and one filler example
    b = hellaswag.make_batch([examples[i] for i in idx], n, L, E)
    real = np.zeros_like(b.tokens, bool)
    for k, i in enumerate(idx):
        for j, e in enumerate(examples[i].endings):
            real[4 * k + j, : len(examples[i].ctx) + len(e)] = True
    noisy = np.where(
        real, b.tokens, np.random.default_rng(0).integers(0, 50257, b.tokens.shape)
    ).astype(np.int32)
    assert (noisy != b.tokens).any()
    score = hellaswag._jitted_ending_losses(mesh)
    clean = np.asarray(score(model, *sharding.put_rows(b, mesh)))
    dirty = np.asarray(score(model, *sharding.put_rows(b._replace(tokens=noisy), mesh)))
    assert np.array_equal(clean, dirty)  # bitwise: right padding is causally invisible, and masked
    assert (clean[: 4 * len(idx)] > 0).all() and (clean[4 * len(idx) :] == 0).all()


@pytest.mark.slow
def test_scorer_matches_numpy_from_full_logits(model, examples, reference_rows, jax_score):
    """Full logits (B, T, vocab) from the model's plain forward, then build-nanogpt's masked
    cross-entropy in float64 numpy over each row's real tokens."""
    import jax.numpy as jnp
    from flax import nnx

    # one shape for all: rows right-padded to block_size
    forward = nnx.jit(lambda model, idx: model(idx)[0])
    assert jax_score.count == len(examples) == 20
    for r, res, (tokens, mask, _) in zip(examples, jax_score.results, reference_rows):
        padded = np.zeros((4, TINY["n_positions"]), np.int32)
        padded[:, : tokens.shape[1]] = tokens
        logits = np.asarray(forward(model, jnp.asarray(padded)))  # (4, 128, vocab)
        want_sum, want_mean = [], []
        for row, m, z, e in zip(tokens, mask, logits, r.endings):
            n = len(r.ctx) + len(e)
            z = z[: n - 1].astype(np.float64)  # the real tokens' rows only, past them padding
            logp = z - z.max(-1, keepdims=True)  # position t predicts token t + 1
            logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
            nll = -logp[np.arange(n - 1), row[1:n]]
            want_sum.append(float((nll * m[1:n]).sum()))
            want_mean.append(want_sum[-1] / m[1:n].sum())
        assert_close(res.sum_losses, want_sum, rtol=LOSS_RTOL, what=f"line {r.line} summed losses")
        assert_close(res.mean_losses, want_mean, rtol=LOSS_RTOL, what=f"line {r.line} mean losses")
        assert res.pred == int(np.argmin(want_sum)) and res.pred_norm == int(np.argmin(want_mean))
        assert res.label == r.label and res.line == r.line


def test_jax_matches_torch_reference(hf_dir, examples, jax_score):
    from parity import torch_side

    ref = check_hellaswag.evaluate_torch(torch_side.from_hf(hf_dir), str(FIXTURE))
    assert [x.line for x in ref.results] == [x.line for x in jax_score.results]
    assert [(x.pred, x.pred_norm) for x in jax_score.results] == [
        (x.pred, x.pred_norm) for x in ref.results
    ]
    assert (jax_score.acc, jax_score.acc_norm, jax_score.count) == (
        ref.acc,
        ref.acc_norm,
        ref.count,
    )
    assert_close(losses(jax_score), losses(ref), rtol=LOSS_RTOL, what="jax vs torch losses")


def test_scorer_refuses_what_it_cannot_score(model, examples):
    ex = hellaswag_data.read_examples(str(FIXTURE))[10]
    ex = ex | {"ctx": ex["ctx"] * 2}
    long = hellaswag_data.render_example(ex)
    n = len(long.ctx) + max(map(len, long.endings))
    with pytest.raises(
        ValueError, match=f"^an example of {n} tokens exceeds block_size 128: render with max_len="
    ):
        hellaswag.evaluate(model, [long])
    # exactly 128 tokens: scored, one example per batch too
    cut = hellaswag_data.render_example(ex, max_len=128)
    assert hellaswag.evaluate(model, [cut], batch_size=1).count == 1
    with pytest.raises(ValueError, match="^batch_size must be >= 1, got 0$"):
        hellaswag.evaluate(model, [cut], batch_size=0)
    with pytest.raises(ValueError, match="^no examples to score$"):
        hellaswag.evaluate(model, [])
    with pytest.raises(
        ValueError, match="^the model's vocab_size 50256 does not cover GPT-2's 50257 BPE tokens$"
    ):
        hellaswag.check_vocab(50256)


# 8 fake CPU devices in a fresh process (the device count is fixed when jax starts); weights travel
# as .npz
MULTI_DEVICE = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    from flax import nnx
    import hellaswag
    from dataio import hellaswag_data
    from compute import sharding
    from model import GPT, GPTConfig
    from dataio.weights import load_state_dict

    weights, out = sys.argv[1], sys.argv[2]
    config = GPTConfig(**json.load(open(weights + ".json")))
    model = nnx.eval_shape(lambda: GPT(config, nnx.Rngs(0)))
    load_state_dict(model, dict(np.load(weights)))
    examples = hellaswag_data.load_examples(sys.argv[3], max_len=config.block_size)
    mesh = sharding.make_mesh(fsdp=2)  # as train.py makes it with --fsdp=2: params split, rows over data x fsdp
    L, E, n, idx = hellaswag.plan_batches(examples, 1, config.block_size, sharding.batch_shards(mesh))[0]
    tokens = sharding.put_rows(hellaswag.make_batch([examples[i] for i in idx], n, L, E), mesh)[0]
    score = hellaswag.evaluate(model, examples, mesh, batch_size=1)  # 1 example (4 rows) per device
    np.save(out, np.array([r.sum_losses + r.mean_losses for r in score.results]))
    print(json.dumps({"devices": jax.device_count(), "rows": tokens.shape[0],
                      "rows_per_shard": tokens.sharding.shard_shape(tokens.shape)[0],
                      "shards": len(tokens.addressable_shards)}))
""")  # noqa: E501


@pytest.mark.slow  # a mesh computes what one device does: make test checks it (test_sharding.py)
def test_eight_devices_give_the_same_losses(model, jax_score, tmp_path):
    from dataclasses import asdict

    from dataio.weights import state_dict

    weights = tmp_path / "w.npz"
    np.savez(weights, **state_dict(model))
    (tmp_path / "w.npz.json").write_text(json.dumps(asdict(model.config)))
    env = {**fake_devices(8), "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", MULTI_DEVICE, str(weights), str(tmp_path / "out.npy"), str(FIXTURE)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert info == {"devices": 8, "rows": 32, "rows_per_shard": 4, "shards": 8}
    # the same 8-example batches as jax_score (batch_size 8 on 1 device), now split over 8 devices
    assert_close(np.load(tmp_path / "out.npy"), losses(jax_score), rtol=1e-6, what="8 devices vs 1")


# ------------------------------------------------------------------------------------------------
# the command line, end to end (the "done when")


@pytest.fixture(scope="module")
def resume_dir(model, tmp_path_factory):
    """out_dir with a checkpoint of the same weights, as train.py leaves it."""
    import jax
    from flax import nnx

    from run import checkpoint

    out = tmp_path_factory.mktemp("run") / "out"
    mngr = checkpoint.manager(out)
    checkpoint.save(
        mngr,
        10,
        nnx.state(model, nnx.Param),
        {"count": jax.numpy.zeros((), "int32")},
        checkpoint.meta_for(model.config, {}, 10, 2.0, {}),
    )
    mngr.wait_until_finished()
    mngr.close()
    return str(out)


# an HF folder's in make test-slow (CI runs it): tests/test_sample.py reads HF folders in make test
@pytest.mark.parametrize("source", [pytest.param("hf_dir", marks=pytest.mark.slow), "resume"])
def test_cli_and_parity_cli(source, hf_dir, resume_dir, jax_score, tmp_path, capsys):
    """hellaswag.py writes the scorer's predictions and prints its accuracies;
    parity.check_hellaswag finds the torch reference in agreement (with resume: the reference reads
    the checkpoint with orbax itself)."""
    init = (
        [f"--init_from={hf_dir}"]
        if source == "hf_dir"
        else ["--init_from=resume", f"--out_dir={resume_dir}"]
    )
    out = tmp_path / "preds.jsonl"
    assert hellaswag.main(["--path", str(FIXTURE), *init, "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert "hellaswag: 100%|" in printed.err  # the progress bar
    final = printed.out.strip().splitlines()[-1]
    assert final.startswith(
        f"hellaswag: acc {jax_score.acc:.4f} acc_norm {jax_score.acc_norm:.4f} count 20 "
    ), final
    preds = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(preds) == 20 and set(preds[0]) == {
        "line",
        "ind",
        "label",
        "pred",
        "pred_norm",
        "sum_losses",
        "mean_losses",
    }
    assert [(p["pred"], p["pred_norm"]) for p in preds] == [
        (r.pred, r.pred_norm) for r in jax_score.results
    ]
    raw = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
    assert [(p["line"], p["ind"]) for p in preds] == [
        (i + 1, ex["ind"]) for i, ex in enumerate(raw)
    ]
    assert_close(
        [p["sum_losses"] + p["mean_losses"] for p in preds],
        losses(jax_score),
        rtol=LOSS_RTOL,
        what="CLI losses",
    )

    assert check_hellaswag.main(["--path", str(FIXTURE), *init]) == 0
    printed = capsys.readouterr().out
    for name, acc in (
        ("acc (sum losses)", jax_score.acc),
        ("acc_norm (mean losses)", jax_score.acc_norm),
    ):
        row = next(line for line in printed.splitlines() if line.startswith(name)).split()
        assert row[-4:] == ["yes", "(20/20)", f"{acc:.4f}", f"{acc:.4f}"], row
    assert printed.strip().endswith(
        "HellaSwag parity (losses within 1e-05 relative, identical predictions): OK"
    )


def test_parity_cli_exits_1_on_a_mismatch(hf_dir, monkeypatch, capsys):
    """One ending's loss of the reference moved by 2e-5 relative: beyond the tolerance, same
    predictions."""
    evaluate_torch = check_hellaswag.evaluate_torch

    def nudged(hf_model, path, limit=None, progress=False):
        score = evaluate_torch(hf_model, path, limit, progress)
        r = score.results[3]
        sums = [s * (1 + 2e-5) if j == r.pred_norm else s for j, s in enumerate(r.sum_losses)]
        means = [s * (1 + 2e-5) if j == r.pred_norm else s for j, s in enumerate(r.mean_losses)]
        score.results[3] = r._replace(sum_losses=sums, mean_losses=means)
        return score

    monkeypatch.setattr(check_hellaswag, "evaluate_torch", nudged)
    # 4 examples, the nudged one among them: one batch shape, and enough
    init = [f"--init_from={hf_dir}", "--limit=4"]
    assert check_hellaswag.main(["--path", str(FIXTURE), *init]) == 1
    printed = capsys.readouterr().out
    assert "yes (4/4)" in printed and printed.strip().endswith(": NOT OK"), printed


@pytest.mark.parametrize("source", ["nanogpt", "resume"])
def test_parity_cli_catches_a_bug_in_our_loader(source, resume_dir, tmp_path, monkeypatch, capsys):
    """A square weight (layer 0's attn.c_proj) left in nanoGPT's (out, in) layout by
    pretrained.read_nanogpt, or transposed by checkpoint.load_checkpoint_model: the reference loads
    the file by its own path (parity/torch_side.py), so the check fails; with the loaders as they
    are, it passes."""
    from dataio import pretrained
    from parity.common import save_random_nanogpt_ckpt

    if source == "nanogpt":
        ckpt = save_random_nanogpt_ckpt(
            tmp_path / "ckpt.pt", vocab_size=50257, block_size=128, n_layer=2, n_head=2, n_embd=64
        )
        # 4 examples: one batch shape to compile, and enough
        init = [f"--init_from={ckpt}", "--limit=4"]
        # resume's is test_cli_and_parity_cli's
        assert check_hellaswag.main(["--path", str(FIXTURE), *init]) == 0
        names = pretrained.linear_names
        monkeypatch.setattr(
            pretrained,
            "linear_names",
            lambda *a: names(*a) - {"transformer.h.0.attn.c_proj.weight"},
        )
    else:
        init = ["--init_from=resume", f"--out_dir={resume_dir}", "--limit=4"]
        transpose_c_proj_on_restore(monkeypatch)
    capsys.readouterr()
    assert check_hellaswag.main(["--path", str(FIXTURE), *init]) == 1
    assert capsys.readouterr().out.strip().endswith(": NOT OK")
