"""python -m pytest tests/test_checkpoint.py -q

Checkpoints that verify themselves, and a rotation that keeps the best: a flipped bit in any array
file never loads (orbax's error or our checksum's, one line naming the step to fall back on); an
array's checksum is the same on any mesh, and is the sums it says it is; a meta no model can be made
from is one line in train, sample and export; the checkpoint of the best val loss outlives rotation,
across a resume; a step is restored by its number. A save that fails: tests/test_failed_saves.py."""

import json
import math
import os
import pickle
import random
import re
import stat
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import REPO, fake_devices, run, settings, tiny_config

import export
import sample
import train
from compute import sharding
from configurator import UsageError
from dataio import checksums
from model import GPT
from run import checkpoint, train_step


def flip_bit(path, offset, bit):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))


def array_files(out_dir, step, item):
    """The files holding an item's arrays (tensorstore's OCDBT data files: chunks and the tree that
    finds them)."""
    root = os.path.join(out_dir, "ckpt", str(step), item)
    return sorted(
        os.path.join(r, f) for r, _, fs in os.walk(root) for f in fs if os.path.basename(r) == "d"
    )


@pytest.mark.slow
def test_a_flipped_bit_in_any_array_file_never_loads(dataset, tmp_path):
    """Bits flipped at random in params and opt_state files, one at a time: each restore either
    fails in one line (orbax cannot read it, or the checksum of an array differs) or returns exactly
    the saved arrays (the bit was one nothing reads). Orbax alone loads some of them as other
    numbers; ours catches them in both items."""
    out = tmp_path / "out"
    t = run(dataset, out, "--max_iters=4", "--eval_interval=2")  # checkpoints 2 and 4
    meta = checkpoint.restore(out)["meta"]
    config, tx = checkpoint.model_config_from_meta(meta), train_step.make_optimizer(t.c)
    restore = lambda: checkpoint.restore_state(out, 4, meta, config, tx)  # noqa: E731 (what a resume reads)
    saved = [np.asarray(x) for x in jax.tree.leaves(restore())]
    rng = random.Random(0)
    caught = {"params": 0, "opt_state": 0}
    for item in caught:
        files = array_files(out, 4, item)
        for trial in range(60):
            if caught[item] and trial >= 10:
                break
            path = rng.choice(files)
            offset, bit = rng.randrange(os.path.getsize(path)), rng.randrange(8)
            flip_bit(path, offset, bit)
            try:
                restored = restore()
            except checkpoint.CheckpointError as e:
                message = str(e)
                assert "\n" not in message and re.search(
                    r"ckpt/4 did not restore \(.*\); move it away to resume from "
                    r"step 2$",
                    message,
                ), message
                checksum = re.search(
                    r"\((\S+) differs from the checksum saved with it: the checkpoint is corrupt\)",
                    message,
                )
                if checksum:
                    assert checksum[1].startswith(f"{item}/"), message
                    caught[item] += 1
                else:  # orbax's error: its type and its first line
                    kind, words = re.search(
                        r"did not restore \((\w+): (.*)\); move", message
                    ).groups()
                    assert kind.endswith(("Error", "Exception")) and words != "None", message
            else:
                for a, b in zip(jax.tree.leaves(restored), saved):
                    np.testing.assert_array_equal(
                        np.asarray(a), b, err_msg=f"{path} +{offset} bit {bit} loaded"
                    )
            finally:
                flip_bit(path, offset, bit)
    assert caught["params"] and caught["opt_state"], caught


# The digests of the same values (pickled by the test) placed on meshes of 8 fake devices, printed
# as JSON.
DIGESTS_ON_MESHES = r"""
import json, pickle, sys
import jax, ml_dtypes  # ml_dtypes: the pickled bfloat16 array's dtype
from jax.sharding import NamedSharding, PartitionSpec as P
from dataio import checksums
from compute import sharding
with open(sys.argv[1], "rb") as f:
    values = pickle.load(f)
out = {}
for fsdp, tp in ((8, 1), (2, 2)):
    mesh = sharding.make_mesh(fsdp, tp)
    where = {"params": sharding.shardings_for(values["params"], mesh),  # train.py's layout of each param
             # the others split along whichever axes divide: fsdp the first, tensor the second
             "mixed": {k: NamedSharding(mesh, P(*[name if x.shape[a] % mesh.shape[name] == 0 else None
                                                  for a, name in enumerate(("fsdp", "tensor")[:x.ndim])]))
                       for k, x in values["mixed"].items()}}
    placed = jax.device_put(values, where)
    assert sum(not x.sharding.is_fully_replicated for x in jax.tree.leaves(placed)) > 10
    out[f"fsdp {fsdp} x tensor {tp}"] = checksums.digests(placed)
    out[f"whole axes {fsdp} x {tp}"] = checksums._whole_axes(placed["mixed"]["f32"])
print("DIGESTS " + json.dumps(out))
"""  # noqa: E501


def gpt_params():
    return nnx.state(
        GPT(
            tiny_config(n_layer=2, n_embd=64, n_head=4, vocab_size=96, scan_layers=True),
            nnx.Rngs(0),
        )
    )


def mixed_arrays():
    rng = np.random.default_rng(0)
    return {
        "f32": rng.standard_normal((64, 40), np.float32),
        "bf16": rng.standard_normal((7, 9)).astype(ml_dtypes.bfloat16),
        "int8": rng.integers(-128, 128, (16, 24), np.int8),
        "uint16": rng.integers(0, 2**16, (8, 3), np.uint16),
        "bool": rng.random(8) > 0.5,
        "scalar": np.int32(7),
        "long": rng.standard_normal(3000, np.float32),
        # an odd axis: summed whole, not halved
        "odd": rng.standard_normal((3, 1001), np.float32),
    }


def reference_digest(x):
    """The definition, in numpy, over the flattened array: two sums mod 2^32 of its bits as
    uint32."""
    x = np.asarray(x)
    x = x.astype(np.uint8) if x.dtype == bool else x
    bits = (
        x.reshape(-1).view({1: np.uint8, 2: np.uint16}.get(x.itemsize, np.uint32)).astype(np.uint64)
    )
    i = np.arange(bits.size, dtype=np.uint64)
    m = np.uint64(2**32 - 1)
    h = bits ^ ((i * np.uint64(0x9E3779B9)) & m)
    h ^= h >> np.uint64(16)
    h = (h * np.uint64(0x85EBCA6B)) & m
    h ^= h >> np.uint64(13)
    h = (h * np.uint64(0xC2B2AE35)) & m
    h ^= h >> np.uint64(16)
    return f"{int(((bits * (2 * i + 1)) & m).sum()) % 2**32:08x}{int(h.sum()) % 2**32:08x}"


@pytest.mark.slow
def test_an_arrays_checksum_is_the_same_on_any_mesh_and_is_its_definition(tmp_path):
    params = {
        jax.tree_util.keystr(p, simple=True, separator=".").removesuffix(".value"): np.asarray(x)
        # the blocks stacked (scan_layers)
        for p, x in jax.tree_util.tree_leaves_with_path(gpt_params())
    }
    values = {"params": params, "mixed": mixed_arrays()}
    with open(tmp_path / "values.pkl", "wb") as f:
        pickle.dump(values, f)
    env = fake_devices(8)
    p = subprocess.run(
        [sys.executable, "-c", DIGESTS_ON_MESHES, str(tmp_path / "values.pkl")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    meshes = json.loads(next(x for x in p.stdout.splitlines() if x.startswith("DIGESTS "))[8:])
    # the axes a device holds whole, summed where they lie: (64, 40) split 8 ways by rows, then 2 x
    # 2
    assert (meshes.pop("whole axes 8 x 1"), meshes.pop("whole axes 2 x 2")) == ([1], [])
    here = checksums.digests(values)  # this process's one device
    for mesh, digests in meshes.items():
        assert digests == here, mesh
    for item, arrays in values.items():
        for key, x in arrays.items():
            assert here[f"{item}/{key}"] == reference_digest(x), key
    # the path, without /value
    assert "params/h/attn/c_attn/kernel" in checksums.digests({"params": gpt_params()})
    with jax.enable_x64(True):  # 8-byte dtypes: two uint32 each, summed as uint32
        wide = {
            "f64": np.random.default_rng(1).standard_normal((5, 300)),
            "i64": np.arange(-700, 700) * 2**40,
        }
        assert checksums.digests(wide) == {k: reference_digest(x) for k, x in wide.items()}
    # one flipped bit anywhere changes it: the weighted sum alone sees every one
    x = mixed_arrays()["long"]
    for i, bit in ((0, 0), (1234, 31), (2999, 17)):
        y = x.copy()
        y.view(np.uint32)[i] ^= np.uint32(1 << bit)
        assert checksums.digests({"x": y})["x"][:8] != here["mixed/long"][:8]


BAD_META = {  # (what is changed, the one line's reason)
    "an unknown model_args key": (
        {"model_args": {"n_layers": 2}},
        "its model_args has 'n_layers', which is not a model.GPTConfig field",
    ),
    "a str for an int": ({"model_args": {"n_layer": "2"}}, "its model_args n_layer='2' is not int"),
    "an int for a bool": ({"model_args": {"bias": 1}}, "its model_args bias=1 is not bool"),
    "scan_layers not a bool": (
        {"model_args": {"scan_layers": "yes"}},
        "its model_args scan_layers='yes' is not bool",
    ),
    "a float for an int": (
        {"model_args": {"n_embd": 32.0}},
        "its model_args n_embd=32.0 is not int",
    ),
    "no model": (
        {"model_args": {"n_head": 3}},
        "its model_args are no model: n_embd=32 must be divisible by n_head=3",
    ),
    "an embed_dtype of no dtype": (
        {"model_args": {"embed_dtype": "fp16"}},
        "its model_args are no model: embed_dtype must be 'float32' or 'bfloat16', got 'fp16'",
    ),
    "iter_num not an int": ({"iter_num": "2"}, "its meta's iter_num is '2', not an integer >= 0"),
    "best_val_loss not a number": (
        {"best_val_loss": None},
        "its meta's best_val_loss is None, not a number",
    ),
    "config not an object": ({"config": [1]}, "its meta's config is list, not a JSON object"),
    "digests not strings": (
        {"digests": {"params/wte/embedding": 5}},
        "its meta's digests are not a JSON object of",
    ),
    "a checksum missing": (
        lambda meta: {
            **meta,
            "digests": {k: v for k, v in meta["digests"].items() if k != "params/wte/embedding"},
        },
        "its meta has no checksum of params/wte/embedding",
    ),
    "not an object": (lambda meta: [meta], "its meta is not a JSON object"),
    "keys missing": (
        lambda meta: {k: v for k, v in meta.items() if k not in ("loader", "config")},
        "its meta lacks config, loader",
    ),
    "architecture missing": (
        lambda meta: {
            **meta,
            "model_args": {
                k: v for k, v in meta["model_args"].items() if k not in ("bias", "n_layer")
            },
        },
        "its model_args lack n_layer, bias",
    ),
}


@pytest.mark.slow
def test_a_bad_meta_is_one_line_in_train_sample_and_export(dataset, tmp_path, capsys):
    out = tmp_path / "out"
    run(dataset, out, "--max_iters=4", "--eval_interval=2")
    meta_file = out / "ckpt" / "4" / "meta" / "metadata"
    good = json.loads(meta_file.read_text())
    # the caller's, not the run's
    assert checkpoint.load_model("resume", out, dropout=0.1)[0].config.dropout == 0.1

    # a checkpoint saved before the checksums: it loads, and one line says it is unverified
    meta_file.write_text(json.dumps({k: v for k, v in good.items() if k != "digests"}))
    capsys.readouterr()
    checkpoint.load_model("resume", out)
    err = capsys.readouterr().err.strip()
    assert re.fullmatch(
        r"checkpoint \S+/ckpt/4 carries no checksums \(saved before they were kept\): its arrays "
        r"load unverified",
        err,
    ), err

    for what, (change, reason) in BAD_META.items():
        meta = json.loads(json.dumps(good))
        if callable(change):
            meta = change(meta)
        else:
            for key, value in change.items():
                meta[key] = {**meta[key], **value} if key == "model_args" else value
        meta_file.write_text(json.dumps(meta))
        message = (
            re.escape(f"ckpt/4 did not restore ({reason}")
            + r".*\); move it away to resume from step 2$"
        )
        for load in (
            lambda: checkpoint.load_model("resume", out),
            lambda: train.Trainer(settings(dataset, out, "--init_from=resume")),
        ):
            with pytest.raises(checkpoint.CheckpointError, match=message) as e:
                load()
            assert "\n" not in str(e.value), what
    # the scripts: a UsageError, which exit_on_bad_input prints as one line (exit 2)
    with pytest.raises(UsageError, match=message):
        sample.main([f"--out_dir={out}", "--num_samples=1", "--max_new_tokens=2"])
    with pytest.raises(UsageError, match=message):
        export.main([f"--out_dir={out}", f"--to={tmp_path / 'hf'}"])
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow
def test_a_step_is_restored_by_its_number_and_a_missing_one_names_those_there(dataset, tmp_path):
    """export.py's --step: an earlier checkpoint than the latest, its own arrays; a step not saved
    is one line."""
    run(dataset, tmp_path, "--max_iters=4", "--eval_interval=2")
    (model, meta), (latest, _) = (
        checkpoint.load_checkpoint_model(tmp_path, step=s) for s in (2, None)
    )
    assert meta["iter_num"] == 2 and not np.array_equal(
        model.wte.embedding[...], latest.wte.embedding[...]
    )
    # for inference: no dropout, fp32
    for loaded in (model, latest, checkpoint.load_model("resume", tmp_path)[0]):
        assert (loaded.config.dropout, loaded.config.dtype) == (0.0, "float32")
    assert checkpoint.load_model("resume", tmp_path, dtype="bfloat16")[0].config.dtype == "bfloat16"
    model, _, step = checkpoint.load_with_codec("resume", tmp_path, "bfloat16")  # sample.py's
    assert (model.config.dtype, step) == ("bfloat16", 4)
    with pytest.raises(
        checkpoint.CheckpointError,
        match=r"^no checkpoint of step 3 in \S+/ckpt: it has steps 2, 4$",
    ):
        checkpoint.restore(tmp_path, step=3)


@pytest.mark.slow
def test_a_train_runs_checkpoint_files_get_the_umasks_mode(dataset, tmp_path):
    """Every file and folder of the checkpoints train.py saves (orbax's arrays, our meta and
    metrics), and its log: 0666 & ~umask and 0777 & ~umask, as any program's, under a umask that is
    neither 0o022 nor 0o077. Exports: test_export.py."""
    old = os.umask(0o007)
    try:
        run(dataset, tmp_path, "--max_iters=2", "--eval_interval=2")
    finally:
        os.umask(old)
    modes = {name: os.stat(tmp_path / name).st_mode for name in ("ckpt", "log.jsonl")}
    for root, dirs, files in os.walk(tmp_path / "ckpt"):
        for name in dirs + files:
            path = os.path.join(root, name)
            modes[os.path.relpath(path, tmp_path)] = os.stat(path).st_mode
    assert {"ckpt/2/meta/metadata", "ckpt/2/metrics/metrics", "ckpt/2/params/_METADATA"} <= set(
        modes
    )
    wrong = {
        path: oct(stat.S_IMODE(mode))
        for path, mode in modes.items()
        if stat.S_IMODE(mode) != (0o770 if stat.S_ISDIR(mode) else 0o660)
    }
    assert wrong == {}


def test_rotation_keeps_the_latest_and_the_best(tmp_path):
    """keep 2: saves with a val loss and without one (checkpoint_interval, a stop); a reopened
    directory (a resumed run) still knows which is best."""
    mngr = checkpoint.manager(tmp_path, keep=2)
    params, opt_state = {"w": np.arange(3, dtype=np.float32)}, {"count": np.zeros((), np.int32)}

    def save(step, val_loss=None):
        meta = checkpoint.meta_for(tiny_config(), {}, step, math.inf, {})
        checkpoint.save(mngr, step, params, opt_state, meta, val_loss)
        checkpoint.wait_saved(mngr)
        return mngr.all_steps()

    assert save(1, 3.0) == [1]
    assert save(2) == [1, 2]
    assert save(3, 1.0) == [2, 3]  # 1 was the best; 3 is better
    assert save(4) == [3, 4]
    assert save(5) == [3, 4, 5]  # the best, and the latest 2 (one without a val loss)
    assert save(6, 9.0) == [3, 5, 6]  # 4 rotated out: no val loss, no longer among the latest
    assert save(7, 0.5) == [6, 7]  # the new best is among the latest
    assert save(8, math.nan) == [7, 8]  # NaN is never the best
    mngr.close()
    mngr = checkpoint.manager(tmp_path, keep=2)
    assert save(9) == [7, 8, 9]
    mngr.close()
    assert checkpoint.all_steps(tmp_path) == [7, 8, 9]


def test_the_best_checkpoint_outlives_blown_up_ones(dataset, tmp_path, monkeypatch, caplog):
    """The issue's run: checkpoint_interval=1, keep_checkpoints=2, the val loss blows up to 1.6e10
    (finite: the run goes on) after step 2. A step that is evaluated is saved by its eval, with its
    val loss."""
    vals = {0: 4.0, 2: 2.0, 4: 1.6e10, 6: 1.6e10, 8: 3.0e10, 10: 1.6e10}
    monkeypatch.setattr(
        train.Trainer, "estimate_loss", lambda self: {"train": 1.0, "val": vals[self.iter_num]}
    )
    args = ["--eval_interval=2", "--checkpoint_interval=1", "--keep_checkpoints=2"]
    run(dataset, tmp_path, "--max_iters=6", *args)
    assert checkpoint.all_steps(tmp_path) == [2, 5, 6]
    run(dataset, tmp_path, "--init_from=resume", "--max_iters=10", *args)
    assert checkpoint.all_steps(tmp_path) == [2, 9, 10]
    with open(tmp_path / "ckpt" / "2" / "metrics" / "metrics") as f:  # the val loss of its eval
        assert json.load(f) == {"val_loss": 2.0}
    assert "tracked_metric" not in caplog.text  # orbax's warning of a save without a val loss


@pytest.mark.slow
def test_bf16_tables_resume_in_either_embed_dtype(tmp_path):
    """embed_dtype is the run's choice (model.RUNTIME_FIELDS): a checkpoint of record 20's bf16
    tables and their Adam moments restores into float32 ones, value for value, and into bf16 bit
    for bit; on the first device (sample.py's) and on train.py's mesh."""
    from dataclasses import replace

    from archs.models import build
    from model import GPTConfig
    from run.settings import DEFAULTS

    saved = GPTConfig(
        arch="speedrun20", bias=False, n_layer=2, n_head=2, n_embd=32, block_size=128,
        vocab_size=64, embed_dtype="bfloat16",
    )  # fmt: skip
    c = dict(DEFAULTS, arch="speedrun20", optimizer="muon20", lr_schedule="cooldown")
    tx = train_step.make_optimizer(dict(c, beta1=0.8, weight_decay=0.0, muon_ns_dtype="float32"))
    params = nnx.state(build(saved, nnx.Rngs(0)), nnx.Param)
    grads = jax.tree.map(lambda p: (p * 0.5 + 0.25).astype(p.dtype), params)
    updates, opt_state = tx.update(grads, tx.init(params), params)  # moments that are not zeros
    params = optax.apply_updates(params, updates)
    mngr = checkpoint.manager(tmp_path)
    meta = checkpoint.meta_for(saved, {}, 1, 1.0, {})
    checkpoint.save(mngr, 1, params, opt_state, meta)
    mngr.wait_until_finished()
    mngr.close()
    bf16 = [x for x in jax.tree.leaves((params, opt_state)) if x.dtype == jnp.bfloat16]
    assert len(bf16) == 4 * 3  # wte and 3 value tables, each with Adam's mu and nu
    for embed_dtype in ("float32", "bfloat16"):
        for mesh in (None, sharding.make_mesh()):
            config = replace(saved, embed_dtype=embed_dtype)
            got = checkpoint.restore_state(tmp_path, None, meta, config, tx, mesh)
            assert all(x.dtype != jnp.bfloat16 for x in jax.tree.leaves(got)) == (
                embed_dtype == "float32"
            )
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves((params, opt_state))):
                np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
