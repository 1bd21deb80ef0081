"""python -m pytest tests/test_weights.py -q

Interop (dataio/weights.py): HF directories load without torch, bit for bit as transformers reads
them; sharded and pytorch_model.bin-only ones to the saved model's logits; the exact-GELU setting; a
directory that is not GPT-2's, an lm_head that is not wte, a pickle that runs code, a variant of
GPT-2 our model does not compute: one line each; a bf16 directory read in float32; a hub name,
downloaded or not; the weights placed on a mesh as they are read (nanoGPT's ckpt.pt in and out,
export.py: test_export.py)."""

import dataclasses
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys

import huggingface_hub
import jax
import numpy as np
import pytest
import torch
from flax import nnx
from helpers import Call, rel_diff

from archs.models import model_from
from compute import sharding
from configurator import UsageError
from dataio.weights import (
    MASK_BUFFERS,
    TIED_KEY,
    config_from_hf,
    hf_directory,
    load_hf_model,
    read_hf_weights,
)
from model import GPT
from parity.check_logits import FP32_MAX_REL_TOL as FP32_LOGITS_TOL  # max |Δlogit| / max |logit|
from parity.check_logits import check
from parity.common import random_hf_model, save_random_hf_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_HF = dict(n_layer=2, n_head=2, n_embd=32, n_positions=16, vocab_size=64)


@pytest.mark.slow
def test_hf_directories_load_without_torch_bit_identical_to_transformers(tmp_path):
    """A tanh-GELU and an exact-GELU directory, loaded in one process where torch and transformers
    cannot be imported; the params equal what transformers reads, bit for bit."""
    dirs = {
        act: str(save_random_hf_model(tmp_path / act, seed=7, activation_function=act, **TINY_HF))
        for act in ("gelu_new", "gelu")
    }
    script = (
        "import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"
        "import numpy as np; from model import GPT; from dataio.weights import state_dict\n"
        f"for name, path in {dirs!r}.items():\n"
        "    m = GPT.from_pretrained(path); print(name, m.config.gelu)\n"
        f"    np.savez(f'{tmp_path}/{{name}}.npz', **state_dict(m))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["gelu_new", "tanh", "gelu", "exact"]
    for act, path in dirs.items():
        ours = dict(np.load(tmp_path / f"{act}.npz"))
        reference = {
            k: v.numpy()
            for k, v in load_hf_model(path).state_dict().items()
            if k != TIED_KEY and not k.endswith(MASK_BUFFERS)
        }
        assert ours.keys() == reference.keys()
        for k in ours:
            np.testing.assert_array_equal(ours[k], reference[k], err_msg=k)


def test_exact_gelu_logits_match_transformers(tmp_path):
    """HF's activation_function="gelu" computes the exact GELU; so must the model loaded from it
    (with the tanh one the logits differ far beyond the bar: the check can fail)."""
    hf_model = random_hf_model(seed=8, activation_function="gelu", **TINY_HF)
    # MLP inputs of order 1, where the two GELUs differ (at 0.02-scale weights they agree)
    with torch.no_grad():
        for block in hf_model.transformer.h:
            block.mlp.c_fc.weight.mul_(30)
    hf_dir = tmp_path / "hf"
    hf_model.save_pretrained(hf_dir)
    ok, figures = check(str(hf_dir), text="", batch=2)
    assert ok, figures  # check()'s bar: max_rel <= FP32_LOGITS_TOL, and the loss
    exact = GPT.from_pretrained(str(hf_dir))
    tanh = model_from(dataclasses.replace(exact.config, gelu="tanh"), read_hf_weights(str(hf_dir)))
    tokens = np.random.default_rng(0).integers(0, 64, (2, 16))
    assert rel_diff(tanh(tokens)[0], exact(tokens)[0]) > 10 * FP32_LOGITS_TOL


def test_sharded_and_bin_only_hf_directories_give_transformers_logits(tmp_path):
    """HF directories without model.safetensors (docs/interop.md): a sharded
    model.safetensors.index.json (save_pretrained with a small max_shard_size), and
    pytorch_model.bin alone, as transformers 4 wrote it with safe_serialization=False (5 writes
    safetensors only: torch.save of the state dict), also with GPT2Model's names and no lm_head, as
    the hub's older GPT-2 repositories hold it. Each loads to the logits of the model saved."""
    hf_model = random_hf_model(seed=9, **TINY_HF)
    hf_model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    files = os.listdir(tmp_path / "sharded")
    assert "model.safetensors.index.json" in files and "model.safetensors" not in files
    assert sum(f.endswith(".safetensors") for f in files) > 1
    for name, state in [
        ("bin", hf_model.state_dict()),
        ("bin_no_prefix", hf_model.transformer.state_dict()),
    ]:
        hf_model.config.save_pretrained(tmp_path / name)
        torch.save(state, tmp_path / name / "pytorch_model.bin")
    tokens = np.random.default_rng(0).integers(0, 64, (2, 16))
    with torch.no_grad():
        expected = hf_model(torch.from_numpy(tokens)).logits.numpy()
    for name in ("sharded", "bin", "bin_no_prefix"):
        assert (
            rel_diff(GPT.from_pretrained(str(tmp_path / name))(tokens)[0], expected)
            < FP32_LOGITS_TOL
        ), name


def test_an_lm_head_that_is_not_wte_is_one_line_naming_the_directory(tmp_path):
    """GPT-2 ties lm_head to wte: a file holding another lm_head.weight (safetensors or
    pytorch_model.bin) is refused, naming where it was read."""
    from safetensors.numpy import load_file, save_file

    hf_model = random_hf_model(seed=9, **TINY_HF)
    hf_model.save_pretrained(tmp_path / "safetensors")
    state = load_file(tmp_path / "safetensors" / "model.safetensors")
    state["lm_head.weight"] = state["transformer.wte.weight"] + 1
    save_file(state, tmp_path / "safetensors" / "model.safetensors", metadata={"format": "pt"})
    hf_model.config.save_pretrained(tmp_path / "bin")
    torch.save(
        {k: torch.from_numpy(v) for k, v in state.items()}, tmp_path / "bin" / "pytorch_model.bin"
    )
    for name in ("safetensors", "bin"):
        with pytest.raises(
            UsageError,
            match=f"^{re.escape(str(tmp_path / name))}: lm_head.weight differs from "
            "wte.weight; GPT-2 ties them$",
        ):
            GPT.from_pretrained(str(tmp_path / name))


def test_a_directory_that_is_not_an_hf_gpt2_one_is_one_line(tmp_path):
    """An HF directory needs config.json and a weights file (either alone is refused), and a
    config.json that says gpt2."""
    hf_model = random_hf_model(seed=9, **TINY_HF)
    hf_model.config.save_pretrained(tmp_path / "config_only")
    hf_model.save_pretrained(tmp_path / "weights_only")
    os.remove(tmp_path / "weights_only" / "config.json")
    for name in ("config_only", "weights_only"):
        with pytest.raises(
            UsageError,
            match=f"^{re.escape(str(tmp_path / name))} is not an HF GPT-2 directory: "
            r"it needs config.json and model.safetensors \(as written by "
            r"save_pretrained\)$",
        ):
            GPT.from_pretrained(str(tmp_path / name))
    hf_model.save_pretrained(tmp_path / "bert")
    config = json.loads((tmp_path / "bert" / "config.json").read_text())
    (tmp_path / "bert" / "config.json").write_text(json.dumps({**config, "model_type": "bert"}))
    with pytest.raises(
        UsageError, match=f"^{re.escape(str(tmp_path / 'bert'))} holds a 'bert' model, not gpt2$"
    ):
        GPT.from_pretrained(str(tmp_path / "bert"))
    (tmp_path / "bert" / "config.json").write_text(
        json.dumps({**config, "n_positions": 2 * config["n_positions"]})
    )
    with pytest.raises(
        UsageError,
        match=r"^shape mismatch for transformer.wpe.weight: checkpoint \(16, 32\), model "
        r"\(32, 32\)$",
    ):
        GPT.from_pretrained(str(tmp_path / "bert"))
    with pytest.raises(
        UsageError,
        match=r"^unknown model 'gpt3': use one of gpt2, .*, an HF directory, a nanoGPT "
        r"ckpt.pt or a modded-nanogpt state_step\*.pt$",
    ):
        GPT.from_pretrained("gpt3")


def test_a_bf16_directory_loads_into_float32_params(tmp_path):
    random_hf_model(seed=9, **TINY_HF).to(torch.bfloat16).save_pretrained(tmp_path)
    params = jax.tree.leaves(nnx.state(GPT.from_pretrained(str(tmp_path)), nnx.Param))
    assert {x.dtype for x in params} == {np.dtype(np.float32)}


def test_a_pytorch_model_bin_that_runs_code_is_one_line_and_runs_nothing(tmp_path):
    """torch.load with weights_only: the state dict's pickle names os.system, which is refused, not
    run."""
    marker = tmp_path / "ran"
    random_hf_model(seed=9, **TINY_HF).config.save_pretrained(tmp_path / "hf")
    torch.save(
        {"transformer.wte.weight": Call(os.system, f"touch {marker}")},
        tmp_path / "hf" / "pytorch_model.bin",
    )
    # torch's why
    refusal = (
        r"pytorch_model.bin is not a torch checkpoint \(UnpicklingError: Weights only load failed"
    )
    with pytest.raises(UsageError, match=refusal) as e:
        GPT.from_pretrained(str(tmp_path / "hf"))
    assert "\n" not in str(e.value) and not marker.exists()


def test_hf_variants_our_model_does_not_compute_are_refused_in_one_line():
    """GPT-2's architecture as transformers' GPT2Config can vary it: each variant our model would
    compute otherwise, named with its value; GPT-2's own values (n_inner 4 * n_embd written out)
    taken."""
    assert config_from_hf({}) == dict(
        block_size=1024,
        vocab_size=50257,
        n_layer=12,
        n_head=12,
        n_embd=768,
        # keys left out: GPT2Config's defaults, GPT-2 124M
        bias=True,
        gelu="tanh",
    )
    ok = {"n_embd": 64, "n_layer": 2, "n_head": 2, "n_positions": 32, "vocab_size": 128}
    assert config_from_hf({**ok, "n_inner": 256, "activation_function": "gelu"})["gelu"] == "exact"
    for key, value in [
        ("activation_function", "relu"),
        ("layer_norm_epsilon", 1e-6),
        ("n_inner", 128),
        ("scale_attn_weights", False),
        ("scale_attn_by_inverse_layer_idx", True),
        ("tie_word_embeddings", False),
    ]:
        with pytest.raises(
            UsageError,
            match=rf"^not a GPT-2 architecture this model computes: "
            rf"\{{'{key}': {re.escape(repr(value))}\}}$",
        ):
            config_from_hf({**ok, key: value})


def test_the_torch_side_loads_a_bf16_directory_in_float32(tmp_path):
    """load_hf_model, the parity checks' transformers side: float32 whatever dtype the files were
    saved in."""
    hf = random_hf_model(0, n_layer=1, n_head=2, n_embd=32, n_positions=16, vocab_size=64)
    hf.to(torch.bfloat16).save_pretrained(tmp_path)
    assert {p.dtype for p in load_hf_model(str(tmp_path)).parameters()} == {torch.float32}


def test_a_hub_name_downloads_only_the_config_and_the_safetensors(tmp_path, monkeypatch):
    """The hub stood in for by a local HF directory, filtered by the patterns hf_directory asks
    snapshot_download for (as the hub filters them): config.json and model.safetensors come, nothing
    else does."""
    hub = save_random_hf_model(
        tmp_path / "hub", n_layer=1, n_head=2, n_embd=32, n_positions=16, vocab_size=64
    )
    (hub / "pytorch_model.bin").write_bytes(b"the same weights, not wanted")

    def snapshot_download(name, allow_patterns):
        os.makedirs(tmp_path / name)
        for f in os.listdir(hub):
            if any(fnmatch.fnmatchcase(f, pattern) for pattern in allow_patterns):
                shutil.copy(hub / f, tmp_path / name / f)
        return str(tmp_path / name)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert sorted(os.listdir(hf_directory("gpt2"))) == ["config.json", "model.safetensors"]


def test_a_hub_name_neither_downloadable_nor_cached_is_one_line(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # as HF_HUB_OFFLINE=1, or no network
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))  # an empty cache
    with pytest.raises(
        UsageError,
        match=r"^could not load 'gpt2' from the HF hub or the local HF cache \(offline\?\); "
        r"pass a local directory written by save_pretrained instead$",
    ):
        hf_directory("gpt2")


def test_weights_read_onto_a_mesh_are_the_weights_placed_on_it(tmp_path):
    """With a mesh (train.py's finetune), each value is placed as it is read, the blocks' stacked
    too (scan_layers): here one device, so each param is the one read without a mesh, held under a
    sharding of that mesh."""
    path = str(save_random_hf_model(tmp_path / "hf", seed=9, **TINY_HF))
    mesh = sharding.make_mesh(devices=jax.devices()[:1])
    for scan in (False, True):
        placed, plain = (
            jax.tree.leaves(
                nnx.state(GPT.from_pretrained(path, mesh=m, scan_layers=scan), nnx.Param)
            )
            for m in (mesh, None)
        )
        for a, b in zip(placed, plain, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            assert isinstance(a.sharding, jax.sharding.NamedSharding) and a.sharding.mesh == mesh
