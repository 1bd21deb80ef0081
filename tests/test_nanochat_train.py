"""nanochat through train.py and sample.py (docs/nanochat.md): a data folder as
data/nanochat/prepare.py leaves it (shards/*.parquet, tokenizer/), the depth dial setting the
model's shape and the run's horizon, batch, rates and weight decay as nanochat's base_train does,
val bits per byte, an exact resume, sampling in its tokenizer, and the settings it refuses."""

import math
import os

import jax
import numpy as np
import pytest
from helpers import exit_line, read_log
from helpers.core_bundle import write_bundle
from helpers.nanochat_data import shakespeare_folder, tiny_argv

import eval as eval_py
import sample
import train
from archs import nanochat_recipe
from configurator import InputNotFound, UsageError, command_line_keys, configure
from dataio.chat_tokenizer import ChatTokenizer
from run import train_setup
from run.settings import DEFAULTS, validate

VOCAB = 320
GPT2 = ["--arch=gpt2", "--bias=True", "--window_pattern=SSSL"]


@pytest.fixture(scope="module")
def nanochat_data(tmp_path_factory):
    """Shakespeare's paragraphs as three shards of row groups of 64 documents, a tokenizer of
    VOCAB ids."""
    return shakespeare_folder(tmp_path_factory.mktemp("nanochat"), VOCAB)


def trainer(data, out_dir, *extra):
    args = tiny_argv(data, out_dir, *extra)
    return train.Trainer(configure(DEFAULTS, args), typed=command_line_keys(args))


def test_the_dial_sets_what_base_train_sets(nanochat_data, tmp_path):
    """The run's shape, horizon, batch, rates and weight decay are nanochat_recipe.resolve's (held
    against base_train's own arithmetic in tests/test_nanochat_recipe.py) for the same inputs;
    the model built is that shape."""
    t = trainer(nanochat_data, tmp_path, "--max_iters=0", "--target_param_data_ratio=4")
    recipe = nanochat_recipe.resolve(
        depth=2,
        aspect_ratio=16,
        head_dim=16,
        max_seq_len=32,
        vocab_size=VOCAB,
        window_pattern="SL",
        target_param_data_ratio=4,
        device_batch_size=4,
        total_batch_size=256,
        warmup_steps=2,
    )
    c = t.c
    assert (c["n_layer"], c["n_head"], c["n_embd"]) == (2, 2, 32)
    assert t.model_config.vocab_size == VOCAB and t.model_config.window_pattern == "SL"
    assert c["max_iters"] == recipe.num_iterations > 0
    assert (t.accum, c["batch_size"]) == (recipe.grad_accum_steps, 4)
    assert math.isclose(c["weight_decay"], recipe.weight_decay)
    assert math.isclose(c["learning_rate"], 0.008 * recipe.batch_lr_scale)
    assert math.isclose(c["muon_learning_rate"], recipe.rates["muon"])
    t.lock.close()


@pytest.mark.slow
def test_it_trains_reports_bits_per_byte_and_samples_in_its_tokenizer(
    nanochat_data, tmp_path, capsys
):
    t = trainer(nanochat_data, tmp_path).run()
    assert t.model_config.arch == "nanochat"
    losses = [v for _, v in read_log(tmp_path, "loss")]
    assert len(losses) == 6 and losses[-1] < losses[0]
    bpb = read_log(tmp_path, "val_bpb")
    assert [it for it, _ in bpb] == [0, 3, 6] and bpb[-1][1] < bpb[0][1]
    out = capsys.readouterr().out
    assert "nanochat's MuonAdamW: Muon (lr " in out and "val bpb" in out
    # bits per byte from the val loss: nats over the bytes the val tokens spell, BOS (0 bytes) out
    val = read_log(tmp_path, "val_loss")[-1][1]
    assert 0.5 < bpb[-1][1] / (val / math.log(2)) < 2
    sample.main(
        [f"--out_dir={tmp_path}", "--start=ROMEO:", "--num_samples=1", "--max_new_tokens=8"]
    )
    text = capsys.readouterr().out
    assert "<|bos|>ROMEO:" in text
    # CORE in its own tokenizer (its BOS first); lm-eval's tasks, in GPT-2's BPE, refused
    bundle = write_bundle(tmp_path / "bundle")
    core = ["--init_from=resume", f"--out_dir={tmp_path}", f"--core_bundle={bundle}"]
    assert eval_py.main([*core, "--tasks=core", "--batch_size=4"]) == 0
    assert "CORE metric: " in capsys.readouterr().out
    lm_eval = [f"--out_dir={tmp_path}", "--init_from=resume", "--tasks=hellaswag"]
    code, line = exit_line(lambda: eval_py.main(lm_eval), capsys)
    assert code == 2 and "speaks nanochat's tokenizer" in line and "--tasks=core" in line


# make test-slow (CI runs it): the same claim as GPT-2's resume (test_train_loop.py) with other
# state. make test holds nanochat's loader resuming exactly (test_bestfit_loader.py) and GPT-2's
# run, optimizer state included, resuming bit for bit
@pytest.mark.slow
def test_resume_is_bit_for_bit(nanochat_data, tmp_path, monkeypatch):
    """The loader's buffer read again, Muon's and Adam's state and the schedules' count restored:
    a run stopped after 3 of its 6 steps (as SIGTERM stops it: its schedules are fractions of
    max_iters, so it is the same run), then resumed, ends where 6 straight steps end."""
    straight = trainer(nanochat_data, tmp_path / "a").run()
    with monkeypatch.context() as m:
        m.setattr(train_setup.Stops, "agreed", lambda self, it: "SIGTERM" if it == 3 else None)
        trainer(nanochat_data, tmp_path / "b").run()
    assert [it for it, _ in read_log(tmp_path / "b", "loss")] == [0, 1, 2]
    resumed = trainer(nanochat_data, tmp_path / "b", "--init_from=resume").run()
    assert read_log(tmp_path / "a", "loss") == read_log(tmp_path / "b", "loss")
    for a, b in zip(jax.tree.leaves(straight.params), jax.tree.leaves(resumed.params)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "extra, line",
    [
        (GPT2 + ["--optimizer=adamw"], "depth is nanochat's depth dial: use it with --arch"),
        (["--n_layer=4"], r"depth=2 sets n_layer \(nanochat's dial\): leave n_layer out"),
        (["--lr_schedule=cosine"], "optimizer='muonadamw' takes nanochat's schedule"),
        (GPT2 + ["--depth=0"], "optimizer='muonadamw' is nanochat's MuonAdamW"),
        (["--window_pattern=SXL"], "window_pattern of the letters S and L"),
        (["--total_batch_size=200"], "must be a multiple of device_batch_size x max_seq_len"),
        (["--tokenizer=nowhere"], r"no tokenizer at nowhere/tokenizer.pkl: train it again"),
    ],
)
def test_bad_settings_are_one_line(nanochat_data, tmp_path, extra, line):
    with pytest.raises((UsageError, InputNotFound), match=line):
        args = tiny_argv(nanochat_data, tmp_path, *extra)
        c = configure(DEFAULTS, args)
        validate(c)
        train.Trainer(c, typed=command_line_keys(args))
    assert not os.path.exists(tmp_path / "ckpt")


def test_a_tokenizer_directory_elsewhere(nanochat_data, tmp_path):
    """--tokenizer: the shards of one folder in the tokenizer of another (nanochat's own
    ~/.cache/nanochat/tokenizer, say)."""
    os.makedirs(tmp_path / "data")
    os.symlink(nanochat_data / "shards", tmp_path / "data" / "shards")
    t = trainer(tmp_path / "data", tmp_path / "out", f"--tokenizer={nanochat_data / 'tokenizer'}")
    assert t.model_config.vocab_size == VOCAB
    x, _ = t.train_loader.next(1)
    assert x[0, 0, 0] == ChatTokenizer.from_directory(nanochat_data / "tokenizer").bos_token_id
    t.lock.close()


def test_bits_per_byte_is_nanochats_formula():
    """The eval step's [loss, nats, bytes] over two batches -> bits per byte: the cross-entropy of
    the targets that spell bytes, summed, over ln 2 x their bytes (a special token's 0 bytes leave
    it out), as nanochat's evaluate_bpb sums them; the loss over every target."""
    from flax import nnx
    from helpers import tiny_config

    from archs.models import build
    from run.train_step import bits_per_byte, make_eval_step

    model = build(tiny_config(arch="nanochat", bias=False, n_embd=32), nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    rng = np.random.default_rng(0)
    token_bytes = rng.integers(0, 5, 128)
    token_bytes[:8] = 0  # special tokens
    step = make_eval_step(graphdef, params, token_bytes)
    batches = [rng.integers(0, 128, (2, 2, 16)) for _ in range(2)]
    terms = [step(jax.tree.leaves(params), x, y) for x, y in batches]
    loss, bpb = bits_per_byte(terms)
    nats, nbytes, every = 0.0, 0, []
    for x, y in batches:
        logits = np.asarray(model(x)[0], np.float64)
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        nll = -np.take_along_axis(logp, y[..., None], -1)[..., 0]
        nats += nll[token_bytes[y] > 0].sum()
        nbytes += token_bytes[y].sum()
        every.append(nll.mean())
    assert math.isclose(bpb, nats / (math.log(2) * nbytes), rel_tol=1e-5)
    assert math.isclose(loss, np.mean(every), rel_tol=1e-5)
