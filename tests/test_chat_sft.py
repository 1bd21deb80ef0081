"""nanochat's finetuning through train.py (config/chat_sft.py, docs/chat.md): from a nanochat
checkpoint directory, on conversations, the loss on the assistant's tokens, one epoch's steps at
chat_sft's rates of the mixture's progress, the base run's batch and rates inherited, the
optimizer warm-started from the state saved beside the base (or fresh, with nanochat's warning,
where there is none); with NANOCHAT_CHECKOUT, parity/check_chat.py against nanochat's own
chat_sft, warm-started and fresh.

    python -m pytest tests/test_chat_sft.py -q
"""

import json
import math
import os
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import REPO, read_log
from helpers.nanochat_data import shakespeare_folder

import train
from archs import nanochat_sft
from archs.models import build
from configurator import UsageError, command_line_keys, configure
from dataio.chat_tokenizer import ChatTokenizer
from dataio.nanochat_checkpoint import save_nanochat
from model import GPTConfig
from run import train_setup
from run.settings import DEFAULTS, validate

CHECKOUT = os.environ.get("NANOCHAT_CHECKOUT")
CONFIG = os.path.join(REPO, "config", "chat_sft.py")
VOCAB = 320
NAMES = ["Romeo", "Juliet", "Hamlet", "Ophelia"]
BASE_CONFIG = GPTConfig(
    arch="nanochat", bias=False, block_size=64, vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=32,
    window_pattern="L",
)  # fmt: skip


def conversation(i):
    a, b = NAMES[i % 4], NAMES[(i + 1) % 4]
    return [
        {"role": "user", "content": f"Who loves {a}?"},
        {"role": "assistant", "content": f"{b} loves {a}, {i} times."},
    ]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A nanochat base directory: tokenizer/, a tiny model's checkpoint in base_checkpoints/d2 (its
    meta: base_train's batch and rates), and a folder of train.jsonl and val.jsonl."""
    root = tmp_path_factory.mktemp("nanochat_base")
    shakespeare_folder(root / "text", VOCAB, docs=300)
    os.rename(root / "text" / "tokenizer", root / "tokenizer")
    run = {"device_batch_size": 2, "total_batch_size": 256}
    run["user_config"] = {"embedding_lr": 0.2, "unembedding_lr": 0.006, "matrix_lr": 0.01}
    save_nanochat(build(BASE_CONFIG, nnx.Rngs(0)), str(root / "base_checkpoints" / "d2"), 0, run)
    data = root / "chat"
    data.mkdir()
    for split, n in (("train", 40), ("val", 8)):
        with open(data / f"{split}.jsonl", "w") as f:
            f.writelines(json.dumps(conversation(i)) + "\n" for i in range(n))
    return root


WARM_STEPS, WARM_DECAY = 7, 0.0125  # the warm base's optimizer: AdamW's steps, Muon's decay


@pytest.fixture(scope="module")
def warm(base):
    """base_checkpoints/d2warm: the base's checkpoint with an optimizer state beside it, as
    base_train saves one (random moments and buffers, AdamW at WARM_STEPS, Muon's decay
    WARM_DECAY), written by our writer (tests/test_sft_warm_start.py holds it to torch's)."""
    from archs import nanochat_optim, nanochat_optim_state
    from dataio import nanochat_optimizer_state as files

    directory = base / "base_checkpoints" / "d2warm"
    shutil.copytree(base / "base_checkpoints" / "d2", directory)
    shapes = {n: a.shape for n, a in build(BASE_CONFIG, nnx.Rngs(0)).nanochat_state().items()}
    rng, groups, state = np.random.default_rng(0), [], {}
    rates = nanochat_optim.group_rates(32, 0.006, 0.2, 0.01, 0.5)
    draw = lambda shape: np.abs(rng.normal(size=shape)).astype(np.float32) * 1e-3  # noqa: E731
    for label, names in files.torch_order(shapes):
        groups.append((label, names, nanochat_optim_state.group_settings(label, rates, WARM_DECAY)))
        for n in names:
            if label == "muon":
                second = files.second_moment_shape(shapes[n])
                state[n] = {
                    "momentum_buffer": draw(shapes[n]),
                    "second_momentum_buffer": draw(second),
                }
            else:
                state[n] = {
                    "step": WARM_STEPS,
                    "exp_avg": draw(shapes[n]),
                    "exp_avg_sq": draw(shapes[n]),
                }
    files.save_optimizer_state(str(directory), 0, files.NanochatOptimizerState(groups, state))
    return directory


def adamw_steps_before(opt_state):
    return {
        int(x)
        for p, x in jax.tree_util.tree_flatten_with_path(opt_state)[0]
        if "steps_before" in jax.tree_util.keystr(p)
    }


def test_the_warm_start_puts_the_files_state_in_our_optimizer(warm, capsys):
    """train_setup.warm_start and init_state as train.py calls them: the moments of the file in
    our optimizer state (lm_head's, transposed where nanochat's is a Linear: smear_gate), AdamW's
    step counting on, Muon's decay into the settings; --load_optimizer=False's path, the fresh
    one, is the runs' above (the warning where there is no file)."""
    from archs import nanochat_optim
    from compute import sharding
    from dataio import nanochat_optimizer_state as files
    from dataio.pretrained import read_pretrained
    from run.train_step import init_state

    c = {"init_from": str(warm), "weight_decay": 0.0}
    args, weights, _ = read_pretrained(str(warm))
    warmed = train_setup.warm_start(c, GPTConfig(**args), weights, master=True)
    assert c["weight_decay"] == WARM_DECAY and "loaded optimizer state" in capsys.readouterr().out
    tx = nanochat_optim.muon_adamw(
        nanochat_optim.group_rates(32, 0.006, 0.2, 0.01, 0.5), lambda it: 1.0, lambda it: 0.9,
        lambda it: WARM_DECAY,
    )  # fmt: skip
    mesh = sharding.make_mesh(1, 1)
    _, _, opt_state = init_state(GPTConfig(**args), mesh, tx, weights=warmed)
    assert adamw_steps_before(opt_state) == {WARM_STEPS}
    saved = files.read_optimizer_state(str(warm), 0, shapes_of(args))
    inner = opt_state.inner_states
    np.testing.assert_array_equal(
        inner["lm_head"].inner_state.exp_avg["lm_head"].get_value(),
        saved.state["lm_head.weight"]["exp_avg"],
    )
    np.testing.assert_array_equal(
        inner["smear"].inner_state.exp_avg_sq["smear_gate"]["kernel"].get_value(),
        saved.state["smear_gate.weight"]["exp_avg_sq"].T,
    )


def shapes_of(args):
    return {n: a.shape for n, a in build(GPTConfig(**args), nnx.Rngs(0)).nanochat_state().items()}


@pytest.mark.slow
def test_a_base_with_its_optimizer_state_starts_warm(base, warm, tmp_path, capsys):
    """chat_sft's --load-optimizer=1: the file's moments in our optimizer, AdamW's steps counting
    on, Muon's weight decay the file's; --load_optimizer=False (or no file: nanochat's warning)
    starts fresh; a file of another model is one line."""
    argv = sft_argv(base, tmp_path / "warm", f"--init_from={warm}")
    t = train.Trainer(configure(DEFAULTS, argv), typed=command_line_keys(argv))
    t.lock.close()
    assert t.c["weight_decay"] == WARM_DECAY and adamw_steps_before(t.opt_state) == {WARM_STEPS}
    assert "loaded optimizer state from" in capsys.readouterr().out
    argv = sft_argv(base, tmp_path / "fresh", f"--init_from={warm}", "--load_optimizer=False")
    t = train.Trainer(configure(DEFAULTS, argv), typed=command_line_keys(argv))
    t.lock.close()
    assert t.c["weight_decay"] == 0.0 and adamw_steps_before(t.opt_state) == {0}
    assert "optimizer" not in capsys.readouterr().out
    (warm / "optim_000000_rank0.pt").rename(tmp_path / "kept.pt")
    (warm / "optim_000000_rank0.pt").write_bytes(b"garbage")
    try:
        argv = sft_argv(base, tmp_path / "bad", f"--init_from={warm}")
        with pytest.raises(UsageError, match="not a torch checkpoint.*--load_optimizer=False"):
            train.Trainer(configure(DEFAULTS, argv), typed=command_line_keys(argv))
    finally:
        (tmp_path / "kept.pt").replace(warm / "optim_000000_rank0.pt")


def sft_argv(base, out_dir, *extra):
    return [
        CONFIG,
        f"--init_from={base / 'base_checkpoints' / 'd2'}",
        f"--dataset={base / 'chat'}",
        f"--out_dir={out_dir}",
        "--dtype=float32",
        "--eval_interval=100",
        "--val_tokens=0",
        "--eval_iters=1",
        *extra,
    ]


def test_one_epoch_at_chat_sfts_rates_with_the_base_runs_batch(base, tmp_path, capsys):
    argv = sft_argv(base, tmp_path)
    t = train.Trainer(configure(DEFAULTS, argv), typed=command_line_keys(argv))
    c = t.c
    # the base run's meta: its rows, batch and three rates; its model's width (the AdamW rates'
    # 1/sqrt(n_embd / 768)); its tokenizer, two folders up as nanochat keeps it
    assert (c["block_size"], c["batch_size"], c["total_batch_size"]) == (64, 2, 256)
    assert (c["embed_learning_rate"], c["learning_rate"], c["muon_learning_rate"]) == (
        0.2, 0.006, 0.01,
    )  # fmt: skip
    assert c["n_embd"] == 32 and c["tokenizer"] == str(base / "tokenizer")
    steps, progress = nanochat_sft.progress_table(t.train_loader.fresh(), t.accum)
    assert c["max_iters"] == steps and progress[-1] >= 1 > progress[-2]
    t.run()
    with open(tmp_path / "log.jsonl") as f:
        steps_logged = [r for r in map(json.loads, f) if "loss" in r]
    expected = [0.006 * 0.8 * float(nanochat_sft.lr_multiplier(p, 0.0, 0.5, 0.0)) for p in progress]
    np.testing.assert_allclose([r["lr"] for r in steps_logged], expected, rtol=1e-6)
    losses = [r["loss"] for r in steps_logged]
    assert len(losses) == steps and all(math.isfinite(v) for v in losses)
    out = capsys.readouterr().out
    assert f"finetuning on 40 conversations: {steps} steps (one epoch)" in out
    assert "WARNING: optimizer checkpoint not found" in out  # chat_sft's, and a fresh start


@pytest.mark.slow
def test_typed_settings_win_over_the_base_runs(base, tmp_path):
    argv = sft_argv(base, tmp_path, "--batch_size=4", "--learning_rate=0.001")
    t = train.Trainer(configure(DEFAULTS, argv), typed=command_line_keys(argv))
    assert (t.c["batch_size"], t.c["learning_rate"], t.c["embed_learning_rate"]) == (4, 0.001, 0.2)
    t.lock.close()


def test_the_loss_is_the_assistants_tokens_only(base):
    """A batch's targets are -1 on the user's turn, BOS and padding: the loss is the mean over
    the rest, what the model's loss gives on those targets."""
    from dataio import sft_loader

    sft = {"num_iterations": 0, "mix": {}}
    loader = sft_loader.for_folder(
        str(base / "chat"), "train", 63, 2, None, VOCAB, str(base / "tokenizer"), sft
    )
    x, y = loader.next(1)
    tok = ChatTokenizer.from_directory(str(base / "tokenizer"))
    learned = tok.decode([int(t) for t in y[0][y[0] >= 0]])
    assert "loves" in learned and "Who" not in learned and "<|assistant_end|>" in learned


@pytest.mark.parametrize(
    "extra, line",
    [
        (["--optimizer=adamw"], "lr_schedule='sft' is nanochat's finetuning"),
        (["--init_lr_frac=0"], "init_lr_frac must be in (0, 1]"),
        (["--warmup_frac=0.6"], "warmup_frac + cooldown_frac at most 1, got 0.8, 0.6 + 0.5"),
    ],
)
def test_bad_finetuning_settings_are_one_line(base, tmp_path, extra, line):
    with pytest.raises(UsageError, match=re.escape(line)):
        validate(configure(DEFAULTS, sft_argv(base, tmp_path, *extra)))


def test_the_inheritance_reads_only_what_the_meta_holds():
    c = {"block_size": 2048, "batch_size": 32, "learning_rate": 0.004, "total_batch_size": 1}
    c |= {"embed_learning_rate": 0.3, "muon_learning_rate": 0.02}
    train_setup.inherit_pretraining(c, {"max_seq_len": 512, "user_config": {"matrix_lr": 0.05}}, ())
    assert c["block_size"] == 512 and c["muon_learning_rate"] == 0.05
    assert c["batch_size"] == 32 and c["learning_rate"] == 0.004  # not in the meta: the config's


def check_chat(*argv):
    return subprocess.run(
        [sys.executable, "-m", "parity.check_chat", *argv], cwd=REPO, capture_output=True, text=True
    )


@pytest.mark.slow
@pytest.mark.skipif(not CHECKOUT, reason="NANOCHAT_CHECKOUT is not set: chat_sft needs a checkout")
def test_chat_sft_py_is_nanochats_own_step_by_step():
    done = check_chat("--own", CHECKOUT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().endswith("nanochat's finetuning: OK")


@pytest.mark.slow
@pytest.mark.skipif(not CHECKOUT, reason="NANOCHAT_CHECKOUT is not set: chat_sft needs a checkout")
def test_chat_sft_py_from_a_fresh_optimizer_is_nanochats_own():
    done = check_chat("--own", CHECKOUT, "--load_optimizer=0")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "both optimizers fresh" in done.stdout
    assert done.stdout.strip().endswith("nanochat's finetuning: OK")


@pytest.mark.slow
@pytest.mark.skipif(not CHECKOUT, reason="NANOCHAT_CHECKOUT is not set: chat_sft needs a checkout")
@pytest.mark.parametrize("slip", ["init_lr_frac=0.7", "load_optimizer=False"])
def test_a_slip_on_our_side_only_is_caught(slip):
    """A rate, or our optimizer fresh where nanochat's is warm-started."""
    done = check_chat("--own", CHECKOUT, f"--slip={slip}")
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.strip().endswith("nanochat's finetuning: NOT OK")


def test_the_check_without_a_checkout_is_one_line(tmp_path):
    done = check_chat("--own", str(tmp_path))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"error: --own {tmp_path}: no scripts/chat_sft.py there (a nanochat checkout?)"
    ]


def test_the_checkouts_mixture_needs_neither_identity_nor_words(tmp_path):
    """chat_sft as it is now: SmolTalk, MMLU x3, GSM8K x4, in TaskMixture's order; its history's
    identity conversations and spelling tasks only when asked for."""
    from helpers import chat_task_files

    from dataio import sft_loader, task_folder

    hub = chat_task_files.write_hub(str(tmp_path))
    os.remove(os.path.join(hub, task_folder.IDENTITY_FILE))
    os.remove(os.path.join(hub, task_folder.WORDS_FILE))
    mix = {"identity_epochs": 0, "simple_spelling": 0, "spelling_bee": 0}
    train = sft_loader.mixture(hub, "train", **mix)
    assert [type(t).__name__ for t in train.tasks] == ["SmolTalk"] + ["MMLU"] * 3 + ["GSM8K"] * 4
    with pytest.raises(Exception, match="identity_conversations.jsonl"):
        sft_loader.mixture(hub, "train", **(mix | {"identity_epochs": 1}))


@pytest.mark.slow
def test_a_resumed_finetuning_ends_where_the_straight_one_ends(base, warm, tmp_path, monkeypatch):
    """Stopped after 3 steps (as SIGTERM stops it) and resumed with the config alone: the settings
    it inherited from the base run and its tokenizer come back from its own checkpoint, the
    loader and the rates' table continue, and every loss and param is the straight run's. From a
    warm start: its Muon weight decay and AdamW's steps come back from its own checkpoint."""
    argv = sft_argv(base, tmp_path / "a", f"--init_from={warm}")
    straight = train.Trainer(configure(DEFAULTS, argv), typed=command_line_keys(argv)).run()
    with monkeypatch.context() as m:
        m.setattr(train_setup.Stops, "agreed", lambda self, it: "SIGTERM" if it == 3 else None)
        argv = sft_argv(base, tmp_path / "b", f"--init_from={warm}")
        train.Trainer(configure(DEFAULTS, argv), typed=command_line_keys(argv)).run()
    argv = [
        CONFIG,
        "--init_from=resume",
        f"--dataset={base / 'chat'}",
        f"--out_dir={tmp_path / 'b'}",
    ]
    argv += ["--dtype=float32", "--eval_interval=100", "--val_tokens=0", "--eval_iters=1"]
    argv += ["--log_interval=1"]
    resumed = train.Trainer(configure(DEFAULTS, argv), typed=command_line_keys(argv)).run()
    assert resumed.c["batch_size"] == 2 and resumed.c["tokenizer"] == str(base / "tokenizer")
    assert resumed.c["weight_decay"] == WARM_DECAY
    assert read_log(tmp_path / "a", "loss") == read_log(tmp_path / "b", "loss")
    for a, b in zip(jax.tree.leaves(straight.params), jax.tree.leaves(resumed.params)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_an_export_carries_the_optimizer_state(base, warm, tmp_path):
    """export.py --format=nanochat of a muonadamw run writes optim_NNNNNN_rank0.pt beside the
    weights: our state as nanochat's state_dict, AdamW's steps the moments' updates in all (the
    warm start's and the run's), Muon's weight decay the run's; it reads back tensor for tensor."""
    import export
    from archs import nanochat_optim, nanochat_optim_state
    from dataio import nanochat_optimizer_state as files
    from run import checkpoint

    model = build(BASE_CONFIG, nnx.Rngs(0))
    shapes = {n: a.shape for n, a in model.nanochat_state().items()}
    held = files.read_optimizer_state(str(warm), 0, shapes)
    c = dict(DEFAULTS)
    c |= {"optimizer": "muonadamw", "lr_schedule": "sft", "weight_decay": WARM_DECAY}
    c |= {"n_embd": 32, "tokenizer": str(base / "tokenizer"), "dtype": "float32"}
    tx = nanochat_optim.for_run(c, lambda it: 1.0)
    params = nnx.state(model, nnx.Param)
    state = nanochat_optim_state.warm_started(tx.init(params), held.state, model.weight_rows())
    ran = 2  # the finetuning's own updates, on top of the file's WARM_STEPS
    state = jax.tree_util.tree_map_with_path(
        lambda p, x: x + ran if jax.tree_util.keystr(p).endswith(".count") else x, state
    )
    mngr = checkpoint.manager(str(tmp_path / "run"))
    meta = checkpoint.meta_for(model.config, c, ran, 1.5, {})
    checkpoint.save(mngr, ran, nnx.state(model), state, meta)
    mngr.wait_until_finished()
    mngr.close()
    to = tmp_path / "export"
    assert export.main([f"--out_dir={tmp_path / 'run'}", "--format=nanochat", f"--to={to}"]) == 0
    read = files.read_optimizer_state(str(to), ran, shapes)
    assert read.muon_weight_decay() == WARM_DECAY
    for name, theirs in held.state.items():
        for key, value in theirs.items():
            expected = value + ran if key == "step" else value
            np.testing.assert_array_equal(read.state[name][key], expected)
