"""python -m pytest tests/test_speedrun_files.py -q

modded-nanogpt's state_step*.pt files (record 5): one the record's script saved loads for sample.py,
hellaswag and eval with the record's logits and greedy continuation, and train.py trains on from it;
export.py --format=modded writes one the record's GPT loads strictly and that reads back the same;
a bad file or export is one line, exit 2, and writes nothing (the model against the record:
test_speedrun_model.py)."""

import os

import helpers
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from helpers import rel_diff, save_ours, tiny_config
from helpers.record5 import (
    RECORD,
    highest_precision,  # noqa: F401 (autouse: fp32 matmuls as written, on both sides)
    ours_of,
    random_record,
    record_logits,
    tokens,
)

import export
import sample
import train
from archs.models import load_pretrained
from configurator import UsageError, exit_on_bad_input
from dataio.pretrained import (
    COMPILED_PREFIX,
    from_modded_state,
    modded_config,
    read_modded,
    read_pretrained,
    to_modded_state,
)
from dataio.tokenizer import save_vocab
from dataio.weights import state_dict
from model import GPT
from parity import speedrun_reference as record
from parity.check_logits import FP32_MAX_REL_TOL
from run import checkpoint

# --- state_step*.pt in and out
# -----------------------------------------------------------------------


def save_record_file(
    state, path, code="model = GPT(GPTConfig(vocab_size=num_vocab, n_layer=2, n_head=2, n_embd=64))"
):
    """A state_step*.pt as the record's training script saves it: its torch.compile'd model's state
    dict."""
    state = {COMPILED_PREFIX + k: v for k, v in state.items()}
    torch.save(
        {
            "step": 7,
            "code": code,
            "model": state,
            "optimizers": [{"state": {}, "param_groups": []}],
        },
        path,
    )


@pytest.mark.slow
def test_a_record_file_loads_for_the_scripts_with_the_records_logits(tmp_path, capsys):
    ref = random_record(seed=14)
    save_record_file(ref.state_dict(), tmp_path / "state_step000007.pt")
    # sample, hellaswag, eval
    model, train_config = checkpoint.load_model(str(tmp_path / "state_step000007.pt"))
    assert (model.config.arch, model.config.n_head, model.config.bias, train_config) == (
        "speedrun",
        2,
        False,
        None,
    )
    x = tokens(seed=15)
    assert rel_diff(model(jnp.asarray(x))[0], record_logits(ref, x)[0]) < FP32_MAX_REL_TOL
    # the heads come from the file's code; without one, from n_head (the record's 6 by default)
    save_record_file(ref.state_dict(), tmp_path / "no_code.pt", code="")
    assert read_pretrained(str(tmp_path / "no_code.pt"), n_head=2)[0]["n_head"] == 2
    assert load_pretrained(str(tmp_path / "no_code.pt"), n_head=2)[0].config.n_head == 2
    with pytest.raises(UsageError, match="n_head=6 does not split n_embd=64"):
        read_pretrained(str(tmp_path / "no_code.pt"))
    # sample.py greedy, with a character vocabulary beside the file: the record's own greedy
    # continuation
    chars = [chr(48 + i) for i in range(RECORD["vocab_size"])]
    save_vocab(tmp_path, chars)
    assert (
        sample.main(
            [
                f"--init_from={tmp_path / 'state_step000007.pt'}",
                "--start=ab",
                "--temperature=0",
                "--num_samples=1",
                "--max_new_tokens=6",
                "--dtype=float32",
            ]
        )
        == 0
    )
    ids = [chars.index(c) for c in "ab"]
    for _ in range(6):
        ids.append(int(record_logits(ref, [ids])[0][0, -1].argmax()))
    assert (
        capsys.readouterr().out == "".join(chars[i] for i in ids) + "\n" + sample.SEPARATOR + "\n"
    )


@pytest.mark.slow
def test_train_py_trains_on_from_a_record_file(tmp_path, dataset):
    """train.py --init_from=state_step*.pt with the recipe's settings: the record's weights are the
    run's first params, and its Muon steps train them on."""
    ref = random_record(seed=18)
    save_record_file(ref.state_dict(), tmp_path / "state_step000007.pt")
    recipe = [
        "--arch=speedrun",
        "--bias=False",
        "--optimizer=muon",
        "--muon_learning_rate=0.01",
        "--lr_schedule=trapezoid",
        "--warmup_iters=0",
        "--warmdown_iters=2",
        "--n_head=2",
        "--block_size=32",
        f"--init_from={tmp_path / 'state_step000007.pt'}",
    ]
    trainer = train.Trainer(helpers.settings(dataset, tmp_path / "out", *recipe))
    first = to_modded_state(nnx.merge(trainer.graphdef, trainer.params))
    for k, v in ref.state_dict().items():
        np.testing.assert_array_equal(first[k], v.numpy(), err_msg=k)
    trainer.run()
    losses = [loss for _, loss in helpers.read_log(tmp_path / "out", "loss")]
    assert len(losses) == 4 and losses[-1] < losses[0], losses


def test_export_modded_loads_in_the_record_and_round_trips(tmp_path):
    model = ours_of(random_record(seed=16))
    save_ours(tmp_path / "run", model)
    to = tmp_path / "logs" / "state_step000005.pt"
    assert export.main([f"--out_dir={tmp_path / 'run'}", "--format=modded", f"--to={to}"]) == 0
    saved = torch.load(to, weights_only=True)
    assert saved["step"] == 5 and set(saved) == {"step", "code", "model", "optimizers"}
    assert all(k.startswith(COMPILED_PREFIX) for k in saved["model"])
    ref = record.GPT(record.GPTConfig(**RECORD))
    # strict
    ref.load_state_dict({k.removeprefix(COMPILED_PREFIX): v for k, v in saved["model"].items()})
    x = tokens(seed=17)
    assert rel_diff(record_logits(ref, x)[0], model(jnp.asarray(x))[0]) < FP32_MAX_REL_TOL
    back, _ = checkpoint.load_model(str(to))  # n_head from the code export wrote
    assert back.config.n_head == 2
    for k, v in state_dict(model).items():
        np.testing.assert_array_equal(state_dict(back)[k], v, err_msg=k)


# --- bad input
# ---------------------------------------------------------------------------------------


def test_bad_files_and_exports_are_one_line_exit_2_and_write_nothing(tmp_path, capsys):
    ref = random_record(seed=18)
    save_record_file(ref.state_dict(), tmp_path / "record.pt")
    torch.save({"step": 1, "model": {"w": torch.zeros(2)}}, tmp_path / "neither.pt")
    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint")
    # a later record's: an extra param
    save_record_file(
        {**ref.state_dict(), "transformer.h.0.attn.lamb": torch.zeros(())}, tmp_path / "later.pt"
    )
    save_ours(tmp_path / "gpt2", GPT(tiny_config(), nnx.Rngs(0)))
    save_ours(tmp_path / "speedrun", ours_of(ref))
    runs = [
        (
            lambda: sample.main([f"--init_from={tmp_path / 'neither.pt'}"]),
            "is neither a nanoGPT ckpt.pt (a dict with model and model_args) nor a state_step*.pt "
            "of modded-nanogpt's record 5 or 20",
        ),
        (
            lambda: sample.main([f"--init_from={tmp_path / 'garbage.pt'}"]),
            "is not a torch checkpoint",
        ),
        (
            lambda: sample.main([f"--init_from={tmp_path / 'later.pt'}"]),
            "unexpected ['transformer.h.0.attn.lamb']",
        ),
        (lambda: read_pretrained(str(tmp_path / "record.pt"), n_head=4), "not 4: set n_head=2"),
        (
            lambda: export.main(
                [f"--out_dir={tmp_path / 'gpt2'}", "--format=modded", f"--to={tmp_path / 'a.pt'}"]
            ),
            "--format=modded cannot hold this model, arch='gpt2' (GPT-2): export it with "
            "--format=hf or --format=nanogpt\n",
        ),
        (
            lambda: export.main(
                [f"--out_dir={tmp_path / 'speedrun'}", "--format=hf", f"--to={tmp_path / 'hf'}"]
            ),
            "--format=hf cannot hold this model, arch='speedrun' (modded-nanogpt's record 5): "
            "export it with --format=modded\n",
        ),
        (
            lambda: export.main(
                [f"--out_dir={tmp_path / 'speedrun'}", "--format=nanogpt", f"--to={tmp_path / 'n'}"]
            ),
            "--format=nanogpt cannot hold this model, arch='speedrun' (modded-nanogpt's record 5): "
            "export it with --format=modded\n",
        ),
        (
            lambda: export.main(
                [
                    f"--out_dir={tmp_path / 'speedrun'}",
                    "--format=modded",
                    f"--to={tmp_path / 'dir'}",
                ]
            ),
            "--to must end in .pt",
        ),
    ]
    before = sorted(os.listdir(tmp_path))
    for run, message in runs:
        with pytest.raises(SystemExit) as e:
            exit_on_bad_input(run)
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err and err.count("\n") == 1, (message, err)
    assert sorted(os.listdir(tmp_path)) == before
    with pytest.raises(UsageError, match="a modded-nanogpt state dict has transformer.wte.weight"):
        from_modded_state({"transformer.h.0.attn.c_q.weight": np.zeros((2, 2))})


def test_a_record_file_read_at_its_edges():
    """q, k and v fuse only where all three are there (a lone c_q passes through, for
    load_state_dict to name as unexpected); one head is a model; a file that is not a dict names
    what it holds."""
    wte = np.zeros((8, 4), np.float32)
    q = np.ones((4, 4), np.float32)
    lone = from_modded_state({"transformer.wte.weight": wte, "transformer.h.0.attn.c_q.weight": q})
    assert sorted(lone) == ["transformer.h.0.attn.c_q.weight", "transformer.wte.weight"]
    assert modded_config({"transformer.wte.weight": wte}, n_head=1)["n_head"] == 1
    with pytest.raises(UsageError, match="n_head=0 does not split n_embd=4"):
        modded_config({"transformer.wte.weight": wte}, n_head=0)
    with pytest.raises(UsageError, match=r"it holds list$"):
        read_modded("state_step000100.pt", ckpt=[1, 2])
