"""python -m pytest tests/test_nanochat_interop.py -q

nanochat's checkpoints both ways (docs/interop.md): a tiny nanochat run exported with
export.py --format=nanochat and read back by --init_from; a checkpoint written as nanochat's
save_checkpoint writes one (_orig_mod. keys, bf16 embeddings, its base dir's tokenizer/) read by
--init_from; the one-line refusals. With NANOCHAT_CHECKOUT (a karpathy/nanochat checkout),
nanochat's own build_model loads our export strictly and its own save_checkpoint writes what we
read, each giving the other's logits."""

import importlib
import json
import os
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_close, exit_line, read_log, rel_diff, save_ours, tiny_config
from helpers.nanochat_data import shakespeare_folder, tiny_argv

import export
import sample
import train
from configurator import InputNotFound, UsageError, command_line_keys, configure
from dataio.chat_tokenizer import ChatTokenizer
from dataio.pretrained import read_pretrained
from model import GPT
from run import checkpoint
from run.settings import DEFAULTS

# make test-slow (CI runs it): nanochat's checkpoints both ways (make test: the chat stages read a
# nanochat checkpoint, test_chat_sft.py and test_chat_cli.py)
pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")

VOCAB = 320  # a multiple of 64: nanochat pads its tables to one
STEP = 2  # the run's steps: the export's step number
CHECKOUT = os.environ.get("NANOCHAT_CHECKOUT")
own_code = pytest.mark.skipif(
    not CHECKOUT,
    reason="NANOCHAT_CHECKOUT (a karpathy/nanochat checkout) is not set: nanochat's own "
    "checkpoint_manager is not here to load and write checkpoints",
)
# logits soft-capped at 15 in float32 (an ulp at 15 is 1e-6), after layers whose ops torch and XLA
# order differently: a few ulps apart
LOGIT_TOL = 1e-5
# and of the largest logit: the fp32 parity bar (docs/parity.md), which also holds a young run's
# small logits (a tiny head: 0.03 after two steps) to float32's precision
PARITY_BAR = 3e-6
# base_train's meta_NNNNNN.json, in its order
BASE_TRAIN_KEYS = [
    "step",
    "val_bpb",
    "model_config",
    "user_config",
    "device_batch_size",
    "max_seq_len",
    "total_batch_size",
    "dataloader_state_dict",
    "loop_state",
]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A tiny nanochat run of STEP steps (config/nanochat_cpu.py at depth 2, as
    tests/test_nanochat_train.py runs it) on Shakespeare's paragraphs in a tokenizer of VOCAB ids;
    -> its out_dir."""
    folder = tmp_path_factory.mktemp("nanochat")
    shakespeare_folder(folder / "data", VOCAB, docs=600, shards=2, row_group_size=600)
    train_run(folder / "data", folder / "run")
    return folder / "run"


def train_run(data, out_dir, *extra):
    """train.py with config/nanochat_cpu.py at depth 2: 2 layers of 2 heads of 16, 32 tokens, 4
    rows a step, an eval at the start and at STEP."""
    args = tiny_argv(
        data,
        out_dir,
        "--total_batch_size=128",
        f"--max_iters={STEP}",
        "--warmup_iters=1",
        f"--eval_interval={STEP}",
        "--val_tokens=128",
        *extra,
    )
    return train.Trainer(configure(DEFAULTS, args), typed=command_line_keys(args)).run()


@pytest.fixture(scope="module")
def exported(run_dir, tmp_path_factory):
    """run_dir exported to nanochat's layout -> the directory."""
    to = tmp_path_factory.mktemp("export") / "d2"
    assert export.main([f"--out_dir={run_dir}", "--format=nanochat", f"--to={to}"]) == 0
    return to


def logits(model, idx):
    """The model's logits (B, T, vocab) at every position of idx (B, T)."""
    return np.asarray(model.logits(model.hidden_states(jnp.asarray(idx))[1]))


def tokens(seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, (2, 24))


def greedy(capsys, *args):
    capsys.readouterr()
    sample.main(
        [*args, "--start=ROMEO:", "--num_samples=1", "--max_new_tokens=12", "--temperature=0"]
    )
    return capsys.readouterr().out


def test_an_export_is_nanochats_layout_and_reads_back(run_dir, exported, capsys):
    files = sorted(os.listdir(exported))
    assert files == [
        f"meta_{STEP:06d}.json",
        f"model_{STEP:06d}.pt",
        f"optim_{STEP:06d}_rank0.pt",
        "tokenizer",
    ]
    assert sorted(os.listdir(exported / "tokenizer")) == ["token_bytes.pt", "tokenizer.pkl"]
    with open(exported / f"meta_{STEP:06d}.json") as f:
        meta = json.load(f)
    assert list(meta) == BASE_TRAIN_KEYS and meta["step"] == STEP
    assert meta["model_config"] == {
        "sequence_len": 32,
        "vocab_size": VOCAB,
        "n_layer": 2,
        "n_head": 2,
        "n_kv_head": 2,
        "n_embd": 32,
        "window_pattern": "SL",
    }
    logged = [json.loads(line) for line in open(run_dir / "log.jsonl")]
    assert meta["val_bpb"] == next(
        r["val_bpb"] for r in logged if r.get("iter") == STEP and "val_bpb" in r
    )
    batch = {k: meta[k] for k in ("device_batch_size", "max_seq_len", "total_batch_size")}
    assert batch == {"device_batch_size": 4, "max_seq_len": 32, "total_batch_size": 128}
    state = torch.load(exported / f"model_{STEP:06d}.pt", weights_only=True)
    assert {v.dtype for v in state.values()} == {torch.float32}
    # the weights bit for bit, and so the same greedy text from the export as from the run
    ours, _ = checkpoint.load_checkpoint_model(str(run_dir))
    back, _ = checkpoint.load_model(str(exported))
    assert back.config.window_pattern == "SL" and back.config.arch == "nanochat"
    for name, value in ours.nanochat_state().items():
        np.testing.assert_array_equal(back.nanochat_state()[name], value, err_msg=name)
    text = greedy(capsys, f"--init_from={exported}")
    assert "<|bos|>ROMEO:" in text
    assert text == greedy(capsys, "--init_from=resume", f"--out_dir={run_dir}")


@pytest.mark.slow
def test_train_continues_from_an_export(run_dir, exported, tmp_path):
    """train.py --init_from=DIR: the model nanochat's meta describes, holding its weights: the
    first eval of the new run is the last of the run exported (the same val tokens)."""
    data = checkpoint.load_checkpoint_model(str(run_dir))[1]["config"]["dataset"]
    t = train_run(data, tmp_path, f"--init_from={exported}", "--eval_only=True")
    assert t.model_config.arch == "nanochat" and t.model_config.window_pattern == "SL"
    assert read_log(tmp_path, "val_loss") == [(0, read_log(run_dir, "val_loss")[-1][1])]


def nanochat_save(directory, step, model, window_pattern=True, lambdas=True):
    """model's weights as nanochat's save_checkpoint writes them from a compiled bf16 run: its
    state dict under _orig_mod., the embedding tables bf16; its meta. Without `window_pattern` or
    `lambdas`: a checkpoint from before them."""
    state = {}
    for name, value in model.nanochat_state().items():
        tensor = torch.from_numpy(value)
        if name == "transformer.wte.weight" or name.startswith("value_embeds."):
            tensor = tensor.to(torch.bfloat16)
        if lambdas or name not in ("resid_lambdas", "x0_lambdas"):
            state["_orig_mod." + name] = tensor
    os.makedirs(directory, exist_ok=True)
    torch.save(state, os.path.join(directory, f"model_{step:06d}.pt"))
    c = model.config
    model_config = dict(sequence_len=c.block_size, vocab_size=c.vocab_size, n_layer=c.n_layer)
    model_config.update(n_head=c.n_head, n_kv_head=c.n_head, n_embd=c.n_embd)
    if window_pattern:
        model_config["window_pattern"] = c.window_pattern
    with open(os.path.join(directory, f"meta_{step:06d}.json"), "w") as f:
        json.dump({"step": step, "model_config": model_config}, f)


def test_nanochats_own_files_read_by_init_from(run_dir, tmp_path, capsys):
    """As its base_train leaves them: ~/.cache/nanochat/base_checkpoints/d2/ of several steps, the
    tokenizer in ~/.cache/nanochat/tokenizer/, two levels up."""
    ours, meta = checkpoint.load_checkpoint_model(str(run_dir))
    d2 = tmp_path / "base_checkpoints" / "d2"
    nanochat_save(d2, 1, ours, lambdas=False)  # an earlier step: other weights
    nanochat_save(d2, 7, ours)
    ChatTokenizer.from_directory(meta["config"]["dataset"] + "/tokenizer").save(
        tmp_path / "tokenizer", token_bytes_pt=False
    )
    back, _ = checkpoint.load_model(str(d2))  # the largest step
    for name, value in ours.nanochat_state().items():
        if name == "transformer.wte.weight" or name.startswith("value_embeds."):
            value = np.asarray(jnp.asarray(value, jnp.bfloat16), np.float32)  # as saved
        np.testing.assert_array_equal(back.nanochat_state()[name], value, err_msg=name)
    assert "<|bos|>ROMEO:" in greedy(capsys, f"--init_from={d2 / 'model_000001.pt'}")
    # from before the windows and the lambdas: all windows long, the lambdas neutral
    nanochat_save(tmp_path / "old", 3, ours, window_pattern=False, lambdas=False)
    args, state, vocab = read_pretrained(str(tmp_path / "old"))
    assert args["window_pattern"] == "L" and vocab == {"vocab": "nanochat"}
    np.testing.assert_array_equal(state["resid_lambdas"], np.ones(2, np.float32))
    np.testing.assert_array_equal(state["x0_lambdas"], np.zeros(2, np.float32))


def test_bad_input_is_one_line(run_dir, exported, tmp_path, capsys):
    (tmp_path / "no_model").mkdir()
    (tmp_path / "no_model" / "meta_000005.json").write_text("{}")
    (tmp_path / "no_config").mkdir()
    torch.save({"x": torch.zeros(1)}, tmp_path / "no_config" / "model_000005.pt")
    (tmp_path / "no_config" / "meta_000005.json").write_text('{"step": 5}')
    (tmp_path / "other").mkdir()
    torch.save({"model": {}, "model_args": {}}, tmp_path / "other" / "model_000005.pt")
    (tmp_path / "other" / "meta_000005.json").write_text(
        (exported / f"meta_{STEP:06d}.json").read_text()
    )
    (tmp_path / "lone").mkdir()
    os.symlink(exported / f"model_{STEP:06d}.pt", tmp_path / "lone" / f"model_{STEP:06d}.pt")
    os.symlink(exported / f"meta_{STEP:06d}.json", tmp_path / "lone" / f"meta_{STEP:06d}.json")
    cases = [
        ("no_model", UsageError, r"holds nanochat's meta_\*\.json but no model_NNNNNN\.pt"),
        ("no_config", UsageError, "has no model_config of nanochat's GPTConfig fields"),
        (
            "other",
            UsageError,
            r"is not a state dict as nanochat's base_train saves them .*model_args",
        ),
        ("lone", InputNotFound, "no tokenizer/tokenizer.pkl is in .*lone, "),
    ]
    for where, error, line in cases:
        with pytest.raises(error, match=line):
            checkpoint.load_with_codec(str(tmp_path / where), "out", "float32")
    # export.py: a model nanochat's files cannot hold, a .pt target, an earlier export
    save_ours(tmp_path / "gpt2", GPT(tiny_config(), nnx.Rngs(0)))
    refusals = [
        (
            [f"--out_dir={tmp_path / 'gpt2'}", f"--to={tmp_path / 'x'}"],
            "--format=nanochat cannot hold this model, arch='gpt2'",
        ),
        ([f"--out_dir={run_dir}", f"--to={tmp_path / 'x.pt'}"], "writes a directory"),
        ([f"--out_dir={run_dir}", f"--to={exported}"], "holds an earlier export"),
    ]
    for args, line in refusals:
        code, printed = exit_line(lambda: export.main([*args, "--format=nanochat"]), capsys)
        assert code == 2 and line in printed
    assert not os.path.exists(tmp_path / "x")


def nanochat(module):
    """A module of nanochat's own, from the checkout NANOCHAT_CHECKOUT names."""
    if CHECKOUT not in sys.path:
        sys.path.insert(0, CHECKOUT)
    return importlib.import_module(module)


@own_code
def test_nanochats_build_model_loads_our_export(exported, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(exported))  # its get_tokenizer: <base>/tokenizer
    manager = nanochat("nanochat.checkpoint_manager")
    theirs, tokenizer, meta = manager.build_model(str(exported), STEP, torch.device("cpu"), "eval")
    assert tokenizer.get_vocab_size() == VOCAB and meta["step"] == STEP
    ours, _ = checkpoint.load_model(str(exported))
    idx = tokens()
    with torch.no_grad():
        expected = theirs(torch.from_numpy(idx)).float().numpy()
    got = logits(ours, idx)
    assert_close(got, expected, atol=LOGIT_TOL, what="ours vs nanochat's build_model")
    assert rel_diff(got, expected) <= PARITY_BAR


@own_code
def test_nanochats_save_checkpoint_read_by_init_from(tmp_path):
    gpt, manager = nanochat("nanochat.gpt"), nanochat("nanochat.checkpoint_manager")
    config = dict(sequence_len=32, vocab_size=VOCAB, n_layer=3, n_head=2, n_kv_head=1, n_embd=32)
    config["window_pattern"] = "SSL"
    torch.manual_seed(0)
    theirs = gpt.GPT(gpt.GPTConfig(**config))
    theirs.init_weights()
    with torch.no_grad():  # init_weights zeroes some (c_proj, the lambdas' x0): all made to count
        for p in theirs.parameters():
            p.add_(0.02 * torch.randn_like(p))
    meta = {"step": 9, "val_bpb": None, "model_config": config}
    manager.save_checkpoint(str(tmp_path), 9, theirs.state_dict(), None, meta)
    ours, _ = checkpoint.load_model(str(tmp_path))
    assert (ours.config.n_kv_head, ours.config.window_pattern) == (1, "SSL")
    idx = tokens(1)
    with torch.no_grad():
        expected = theirs.eval()(torch.from_numpy(idx)).float().numpy()
    got = logits(ours, idx)
    assert_close(got, expected, atol=LOGIT_TOL, what="ours vs nanochat's save")
    assert rel_diff(got, expected) <= PARITY_BAR
