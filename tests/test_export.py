"""python -m pytest tests/test_export.py -q

nanoGPT's ckpt.pt in (against a faithful torch nanoGPT, parity/nanogpt_reference.py: its logits,
and sample.py's greedy text on a character-level one) and out (export.py --format=nanogpt, loaded
by nanoGPT's strict key set); export.py to HF (bias and no bias) and back; an export whole or not
at all; export.py's bad input; the exported config.json as transformers reads it (HF directories
read in: test_weights.py)."""

import json
import os
import pickle
import stat
import subprocess
import sys

import numpy as np
import pytest
import torch
from flax import nnx
from helpers import REPO, random_nanogpt, rel_diff, save_ours, tiny_config
from safetensors import safe_open

import export
import sample
from archs.models import build
from configurator import UsageError, exit_on_bad_input
from dataio import storage
from dataio.tokenizer import save_vocab
from dataio.weights import hf_config_for, load_hf_model, state_dict
from model import GPT
from parity import nanogpt_reference as nanogpt
from parity.check_logits import FP32_MAX_REL_TOL as FP32_LOGITS_TOL  # max |Δlogit| / max |logit|
from run import checkpoint
from tools.gcs_emulator import FORBIDDEN


def nanogpt_logits(model, tokens):
    with torch.no_grad():
        return model(torch.from_numpy(tokens), torch.from_numpy(tokens))[0].numpy()  # all positions


@pytest.mark.parametrize("bias, flash, compiled", [(True, True, True), (False, False, False)])
def test_nanogpt_ckpt_in_gives_its_logits(tmp_path, bias, flash, compiled):
    """torch.compile's `_orig_mod.` prefix, no flash attention (the attn.bias mask buffer),
    bias=False."""
    ref = random_nanogpt(seed=1, bias=bias, flash=flash)
    if not flash:
        assert "transformer.h.0.attn.bias" in ref.state_dict()
    nanogpt.save_ckpt(
        ref, tmp_path / "ckpt.pt", config={"dataset": "shakespeare_char"}, compiled=compiled
    )
    model, train_config = checkpoint.load_model(str(tmp_path))  # a nanoGPT out_dir
    assert (
        model.config.gelu == "exact" and model.config.bias == bias and model.config.vocab_size == 65
    )
    assert train_config == {"dataset": "shakespeare_char"}
    tokens = np.random.default_rng(0).integers(0, 65, (2, 32))
    assert rel_diff(model(tokens)[0], nanogpt_logits(ref, tokens)) < FP32_LOGITS_TOL


@pytest.mark.slow
def test_export_nanogpt_loads_in_nanogpt_with_the_same_logits(tmp_path):
    model = GPT(tiny_config(gelu="exact", bias=False, vocab_size=65), nnx.Rngs(3))
    save_ours(tmp_path / "run", model, {"dataset": "shakespeare_char"})
    assert (
        export.main(
            [f"--out_dir={tmp_path / 'run'}", "--format=nanogpt", f"--to={tmp_path / 'nano'}"]
        )
        == 0
    )
    ref, ckpt = nanogpt.load_ckpt(tmp_path / "nano" / "ckpt.pt")  # strict: nanoGPT's exact key set
    assert ckpt["iter_num"] == 5 and ckpt["config"]["dataset"] == "shakespeare_char"
    assert ckpt["model_args"] == dict(
        n_layer=2, n_head=2, n_embd=64, block_size=32, bias=False, vocab_size=65, dropout=0.0
    )
    tokens = np.random.default_rng(0).integers(0, 65, (2, 32))
    assert rel_diff(nanogpt_logits(ref, tokens), model(tokens)[0]) < FP32_LOGITS_TOL
    # and in again: the same params, bit for bit
    back, _ = checkpoint.load_model(str(tmp_path / "nano"))
    for k, v in state_dict(model).items():
        np.testing.assert_array_equal(state_dict(back)[k], v, err_msg=k)


def test_sample_greedy_on_a_char_level_nanogpt_ckpt_equals_nanogpt(tmp_path, capsys):
    chars = sorted(set("\n !',.:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz-&$3"))
    assert len(chars) == 65  # shakespeare_char's vocabulary size
    with open(tmp_path / "meta.pkl", "wb") as f:
        pickle.dump(
            {
                "vocab_size": 65,
                "itos": dict(enumerate(chars)),
                "stoi": {c: i for i, c in enumerate(chars)},
            },
            f,
        )
    ref = random_nanogpt(seed=2)
    nanogpt.save_ckpt(ref, tmp_path / "ckpt.pt", config={"dataset": str(tmp_path)})
    assert (
        sample.main(
            [
                f"--init_from={tmp_path / 'ckpt.pt'}",
                "--start=ROMEO:",
                "--temperature=0",
                "--num_samples=1",
                "--max_new_tokens=24",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out.split("\n" + sample.SEPARATOR)[0]
    start = torch.tensor([[chars.index(c) for c in "ROMEO:"]])
    expected = "".join(chars[i] for i in ref.generate(start, 24, temperature=0)[0].tolist())
    assert text == expected


@pytest.mark.parametrize("bias", [True, False])
def test_export_hf_gives_our_logits_in_transformers_and_round_trips(tmp_path, bias):
    model = GPT(tiny_config(bias=bias), nnx.Rngs(4))
    save_ours(tmp_path / "run", model, {"dataset": "x"})
    assert (
        export.main([f"--out_dir={tmp_path / 'run'}", "--format=hf", f"--to={tmp_path / 'hf'}"])
        == 0
    )
    tokens = np.random.default_rng(0).integers(0, 128, (2, 32))
    with torch.no_grad():
        theirs = load_hf_model(str(tmp_path / "hf"))(torch.from_numpy(tokens)).logits.numpy()
    assert rel_diff(theirs, model(tokens)[0]) < FP32_LOGITS_TOL
    back, _ = checkpoint.load_model(str(tmp_path / "hf"))  # init_from=DIR
    exported = state_dict(back)
    for k, v in state_dict(model, zero_biases=True).items():
        np.testing.assert_array_equal(exported[k], v, err_msg=k)
    assert any(k.endswith(".bias") for k in exported) and (
        bias or not any(exported[k].any() for k in exported if k.endswith(".bias"))
    )
    # the file as transformers' save_pretrained writes it: the metadata that transformers 4 and
    # other loaders check ("format" "pt"), every tensor float32 (a bias=False model's zero biases
    # too)
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="np") as f:
        assert f.metadata() == {"format": "pt"}
        assert {k: f.get_tensor(k).dtype for k in f.keys()} == dict.fromkeys(
            f.keys(), np.dtype(np.float32)
        )


def test_an_export_is_whole_or_not_at_all(tmp_path, capsys):
    """An existing, empty directory takes an HF export; one holding an earlier export (here a
    character vocabulary a BPE model must never be decoded with) is refused in one line naming the
    fix, and --overwrite=True replaces the earlier export whole (issue 33)."""
    save_ours(tmp_path / "run", GPT(tiny_config(), nnx.Rngs(0)), {})
    (tmp_path / "hf").mkdir()
    assert export.main([f"--out_dir={tmp_path / 'run'}", f"--to={tmp_path / 'hf'}"]) == 0
    # as a character-level export into the same place would leave it
    save_vocab(tmp_path / "hf", ["a", "b"])
    with pytest.raises(
        UsageError,
        match=r"hf holds an earlier export \(config\.json, model\.safetensors, meta\.json, "
        r"meta\.pkl\): give a new --to, or --overwrite=True to replace it whole$",
    ):
        export.main([f"--out_dir={tmp_path / 'run'}", f"--to={tmp_path / 'hf'}"])
    assert (
        export.main(
            [f"--out_dir={tmp_path / 'run'}", f"--to={tmp_path / 'hf'}", "--overwrite=True"]
        )
        == 0
    )
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "model.safetensors"]


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_each_export_and_checkpoint_file_gets_the_umasks_mode(dataset, tmp_path, umask):
    """Checkpoints saved as train.py saves them, and each format's export (a character-level run's
    with its vocabulary beside): files 0666 & ~umask, folders 0777 & ~umask, as any program's files.
    safetensors alone wrote model.safetensors 0600 (a temporary file, renamed)."""
    char_level = GPT(tiny_config(gelu="exact", vocab_size=64), nnx.Rngs(0))
    exports = [("run", "hf", "hf"), ("run", "nanogpt", "nano"), ("speedrun", "modded", "s.pt")]
    old = os.umask(umask)
    try:
        save_ours(tmp_path / "run", char_level, {"dataset": str(dataset)})
        save_ours(
            tmp_path / "speedrun", build(tiny_config(arch="speedrun", bias=False), nnx.Rngs(0))
        )
        for run, fmt, to in exports:
            argv = [f"--out_dir={tmp_path / run}", f"--format={fmt}", f"--to={tmp_path / to}"]
            assert export.main(argv) == 0
    finally:
        os.umask(old)
    modes = {}
    for top in ("run", "speedrun", "hf", "nano", "s.pt"):
        modes[top] = os.stat(tmp_path / top).st_mode
        for root, dirs, files in os.walk(tmp_path / top):
            for name in dirs + files:
                path = os.path.join(root, name)
                modes[os.path.relpath(path, tmp_path)] = os.stat(path).st_mode
    assert {"hf/model.safetensors", "hf/meta.json", "nano/ckpt.pt", "nano/meta.pkl"} <= set(modes)
    assert any(p.startswith("run/ckpt/5/params/") for p in modes)
    wrong = {
        path: oct(stat.S_IMODE(mode))
        for path, mode in modes.items()
        if stat.S_IMODE(mode) != (0o777 if stat.S_ISDIR(mode) else 0o666) & ~umask
    }
    assert wrong == {}, f"umask {umask:#o}"


def test_export_cli_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys):
    save_ours(tmp_path / "tanh", GPT(tiny_config(), nnx.Rngs(0)), {})
    (tmp_path / "a_file").write_text("")
    cases = [
        ([f"--out_dir={tmp_path / 'nothing'}", f"--to={tmp_path / 'o1'}"], "no checkpoint in"),
        (
            [f"--out_dir={tmp_path / 'tanh'}", "--step=7", f"--to={tmp_path / 'o2'}"],
            "no checkpoint of step 7",
        ),
        (
            [f"--out_dir={tmp_path / 'tanh'}", "--format=nanogpt", f"--to={tmp_path / 'o3'}"],
            "exact GELU",
        ),
        (
            [f"--out_dir={tmp_path / 'tanh'}", "--format=onnx", f"--to={tmp_path / 'o4'}"],
            "--format must be",
        ),
        ([f"--out_dir={tmp_path / 'tanh'}"], "--to is required"),
        (
            [f"--out_dir={tmp_path / 'tanh'}", f"--to={tmp_path / 'a_file' / 'hf'}"],
            "cannot write to",
        ),
        (
            [f"--out_dir={tmp_path / 'tanh'}", "--format=nanogpt", f"--to={tmp_path / 'a_file'}"],
            "cannot write to",
        ),
        (
            [f"--out_dir={tmp_path / 'tanh'}", "--to=/proc/nanogpt-jax-export"],
            "cannot write to /proc/nanogpt-jax",
        ),
    ]
    before = sorted(os.listdir(tmp_path))
    for argv, message in cases:
        with pytest.raises(SystemExit) as e:
            exit_on_bad_input(lambda: export.main(argv))
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err and err.count("\n") == 1, (argv, err)
    assert sorted(os.listdir(tmp_path)) == before
    cli = subprocess.run(
        [sys.executable, "export.py", f"--out_dir={tmp_path / 'nothing'}", "--to=x"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert (
        cli.returncode == 2
        and cli.stderr.startswith("error: no checkpoint in")
        and cli.stderr.count("\n") == 1
    )


@pytest.mark.parametrize(
    "vocab_size, eot", [(50257, 50256), (50304, 50256), (50256, None), (65, None)]
)
def test_the_exported_config_is_the_model_as_transformers_reads_it(tmp_path, vocab_size, eot):
    """config.json (weights.hf_config_for) read by transformers: each setting ours computes with,
    where transformers' default is another (its dropouts are 0.1; ours 0.0) or could be; GPT-2's
    <|endoftext|> (50256) as bos and eos only where the vocabulary holds it."""
    from transformers import GPT2Config

    for gelu, activation in (("tanh", "gelu_new"), ("exact", "gelu")):
        config = tiny_config(vocab_size=vocab_size, gelu=gelu, dropout=0.0)
        (tmp_path / "config.json").write_text(json.dumps(hf_config_for(config)))
        hf = GPT2Config.from_pretrained(tmp_path)
        assert hf.architectures == ["GPT2LMHeadModel"] and hf.model_type == "gpt2"
        assert (hf.n_positions, hf.vocab_size, hf.n_layer, hf.n_head, hf.n_embd) == (
            config.block_size,
            vocab_size,
            config.n_layer,
            config.n_head,
            config.n_embd,
        )
        assert hf.activation_function == activation and hf.layer_norm_epsilon == 1e-5
        assert hf.resid_pdrop == hf.embd_pdrop == hf.attn_pdrop == 0.0
        assert hf.tie_word_embeddings is True and hf.bos_token_id == hf.eos_token_id == eot
        assert hf.dtype in (torch.float32, "float32")


@pytest.mark.slow
def test_an_export_to_gs_is_the_local_exports_files(tmp_path, gcs_dir):
    """--to on gs://: written in a staging folder, then uploaded, the files a local export writes
    (hf: its folder; nanogpt: the folder of its ckpt.pt); a bucket that does not exist is one line
    naming --to. An earlier nanogpt export is refused as an HF one is, and a path under a file, even
    an executable one, is no writable directory."""
    model = GPT(tiny_config(gelu="exact", vocab_size=65), nnx.Rngs(0))
    save_ours(tmp_path / "run", model, {"dataset": "x"})
    run = f"--out_dir={tmp_path / 'run'}"
    for fmt in ("hf", "nanogpt"):
        assert export.main([run, f"--format={fmt}", f"--to={gcs_dir}/{fmt}"]) == 0
        assert export.main([run, f"--format={fmt}", f"--to={tmp_path / fmt}"]) == 0
        names = sorted(os.listdir(tmp_path / fmt))
        assert names == (["config.json", "model.safetensors"] if fmt == "hf" else ["ckpt.pt"])
        for name in names:
            got = storage.read_bytes(f"{gcs_dir}/{fmt}/{name}")
            assert got == (tmp_path / fmt / name).read_bytes(), name
        with pytest.raises(UsageError, match="holds an earlier export"):
            export.main([run, f"--format={fmt}", f"--to={tmp_path / fmt}"])
    with pytest.raises(UsageError, match=r"^--to gs://nanogpt-no-such-bucket/hf: the bucket"):
        export.main([run, "--to=gs://nanogpt-no-such-bucket/hf"])
    with pytest.raises(UsageError, match=rf"^--to gs://{FORBIDDEN}/hf: permission denied on"):
        export.main([run, f"--to=gs://{FORBIDDEN}/hf"])
    (tmp_path / "exe").write_text("")
    (tmp_path / "exe").chmod(0o755)  # W_OK | X_OK even for root: only "not a directory" refuses
    with pytest.raises(UsageError, match=r"exe is not a writable directory$"):
        export.main([run, f"--to={tmp_path / 'exe' / 'hf'}"])
