"""python -m pytest tests/test_checkpoint.py -q

Checkpoints that verify themselves, and a rotation that keeps the best: a flipped bit in any array file never loads
(orbax's error or our checksum's, one line naming the step to fall back on); an array's checksum is the same on any
mesh, and is the sums it says it is; a meta no model can be made from is one line in train, sample and export; the
checkpoint of the best val loss outlives rotation, across a resume; a full disk during a save is one line on stderr."""

import errno
import json
import logging
import math
import os
import pickle
import random
import re
import shlex
import shutil
import subprocess
import sys
import time

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import checkpoint
import export
import sample
import storage
import train
import train_step
from configurator import RunStopped, UsageError
from helpers import REPO, TINY, fake_devices, one_line_error, run, settings, tiny_config, train_cli
from model import GPT


def flip_bit(path, offset, bit):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))


def array_files(out_dir, step, item):
    """The files holding an item's arrays (tensorstore's OCDBT data files: chunks and the tree that finds them)."""
    root = os.path.join(out_dir, "ckpt", str(step), item)
    return sorted(os.path.join(r, f) for r, _, fs in os.walk(root) for f in fs if os.path.basename(r) == "d")


def test_a_flipped_bit_in_any_array_file_never_loads(dataset, tmp_path):
    """Bits flipped at random in params and opt_state files, one at a time: each restore either fails in one line
    (orbax cannot read it, or the checksum of an array differs) or returns exactly the saved arrays (the bit was one
    nothing reads). Orbax alone loads some of them as other numbers; ours catches them in both items."""
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
                assert "\n" not in message and re.search(r"ckpt/4 did not restore \(.*\); move it away to resume from "
                                                         r"step 2$", message), message
                checksum = re.search(r"\((\S+) differs from the checksum saved with it: the checkpoint is corrupt\)",
                                     message)
                if checksum:
                    assert checksum[1].startswith(f"{item}/"), message
                    caught[item] += 1
            else:
                for a, b in zip(jax.tree.leaves(restored), saved):
                    np.testing.assert_array_equal(np.asarray(a), b, err_msg=f"{path} +{offset} bit {bit} loaded")
            finally:
                flip_bit(path, offset, bit)
    assert caught["params"] and caught["opt_state"], caught


# The digests of the same values (pickled by the test) placed on meshes of 8 fake devices, printed as JSON.
DIGESTS_ON_MESHES = r"""
import json, pickle, sys
import jax, ml_dtypes  # ml_dtypes: the pickled bfloat16 array's dtype
from jax.sharding import NamedSharding, PartitionSpec as P
import checkpoint, sharding
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
    out[f"fsdp {fsdp} x tensor {tp}"] = checkpoint.digests(placed)
print("DIGESTS " + json.dumps(out))
"""


def gpt_params():
    return nnx.state(GPT(tiny_config(n_layer=2, n_embd=64, n_head=4, vocab_size=96, scan_layers=True), nnx.Rngs(0)))


def mixed_arrays():
    rng = np.random.default_rng(0)
    return {"f32": rng.standard_normal((64, 40), np.float32),
            "bf16": rng.standard_normal((7, 9)).astype(ml_dtypes.bfloat16),
            "int8": rng.integers(-128, 128, (16, 24), np.int8), "uint16": rng.integers(0, 2**16, (8, 3), np.uint16),
            "bool": rng.random(8) > 0.5, "scalar": np.int32(7), "long": rng.standard_normal(3000, np.float32)}


def reference_digest(x):
    """The definition, in numpy, over the flattened array: two sums mod 2^32 of its bits as uint32."""
    x = np.asarray(x)
    x = x.astype(np.uint8) if x.dtype == bool else x
    bits = x.reshape(-1).view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.itemsize]).astype(np.uint64)
    i = np.arange(bits.size, dtype=np.uint64)
    m = np.uint64(2**32 - 1)
    h = bits ^ ((i * np.uint64(0x9E3779B9)) & m)
    h ^= h >> np.uint64(16)
    h = (h * np.uint64(0x85EBCA6B)) & m
    h ^= h >> np.uint64(13)
    h = (h * np.uint64(0xC2B2AE35)) & m
    h ^= h >> np.uint64(16)
    return f"{int(((bits * (2 * i + 1)) & m).sum()) % 2**32:08x}{int(h.sum()) % 2**32:08x}"


def test_an_arrays_checksum_is_the_same_on_any_mesh_and_is_its_definition(tmp_path):
    params = {jax.tree_util.keystr(p, simple=True, separator=".").removesuffix(".value"): np.asarray(x)
              for p, x in jax.tree_util.tree_leaves_with_path(gpt_params())}  # the blocks stacked (scan_layers)
    values = {"params": params, "mixed": mixed_arrays()}
    with open(tmp_path / "values.pkl", "wb") as f:
        pickle.dump(values, f)
    env = fake_devices(8)
    p = subprocess.run([sys.executable, "-c", DIGESTS_ON_MESHES, str(tmp_path / "values.pkl")], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    meshes = json.loads(next(l for l in p.stdout.splitlines() if l.startswith("DIGESTS "))[8:])
    here = checkpoint.digests(values)  # this process's one device
    for mesh, digests in meshes.items():
        assert digests == here, mesh
    for item, arrays in values.items():
        for key, x in arrays.items():
            assert here[f"{item}/{key}"] == reference_digest(x), key
    assert "params/h/attn/c_attn/kernel" in checkpoint.digests({"params": gpt_params()})  # the path, without /value
    # one flipped bit anywhere changes it: the weighted sum alone sees every one
    x = mixed_arrays()["long"]
    for i, bit in ((0, 0), (1234, 31), (2999, 17)):
        y = x.copy()
        y.view(np.uint32)[i] ^= np.uint32(1 << bit)
        assert checkpoint.digests({"x": y})["x"][:8] != here["mixed/long"][:8]


BAD_META = {  # (what is changed, the one line's reason)
    "an unknown model_args key": ({"model_args": {"n_layers": 2}},
                                  "its model_args has 'n_layers', which is not a model.GPTConfig field"),
    "a str for an int": ({"model_args": {"n_layer": "2"}}, "its model_args n_layer='2' is not int"),
    "an int for a bool": ({"model_args": {"bias": 1}}, "its model_args bias=1 is not bool"),
    "scan_layers not a bool": ({"model_args": {"scan_layers": "yes"}}, "its model_args scan_layers='yes' is not bool"),
    "a float for an int": ({"model_args": {"n_embd": 32.0}}, "its model_args n_embd=32.0 is not int"),
    "no model": ({"model_args": {"n_head": 3}}, "its model_args are no model: n_embd=32 must be divisible by n_head=3"),
    "iter_num not an int": ({"iter_num": "2"}, "its meta's iter_num is '2', not an integer >= 0"),
    "best_val_loss not a number": ({"best_val_loss": None}, "its meta's best_val_loss is None, not a number"),
    "config not an object": ({"config": [1]}, "its meta's config is list, not a JSON object"),
    "digests not strings": ({"digests": {"params/wte/embedding": 5}}, "its meta's digests are not a JSON object of"),
}


def test_a_bad_meta_is_one_line_in_train_sample_and_export(dataset, tmp_path, capsys):
    out = tmp_path / "out"
    run(dataset, out, "--max_iters=4", "--eval_interval=2")
    meta_file = out / "ckpt" / "4" / "meta" / "metadata"
    good = json.loads(meta_file.read_text())
    assert checkpoint.load_model("resume", out, dropout=0.1)[0].config.dropout == 0.1  # the caller's, not the run's

    # a checkpoint saved before the checksums: it loads, and one line says it is unverified
    meta_file.write_text(json.dumps({k: v for k, v in good.items() if k != "digests"}))
    capsys.readouterr()
    checkpoint.load_model("resume", out)
    err = capsys.readouterr().err.strip()
    assert re.fullmatch(r"checkpoint \S+/ckpt/4 carries no checksums \(saved before they were kept\): its arrays "
                        r"load unverified", err), err

    for what, (change, reason) in BAD_META.items():
        meta = json.loads(json.dumps(good))
        for key, value in change.items():
            meta[key] = {**meta[key], **value} if key == "model_args" else value
        meta_file.write_text(json.dumps(meta))
        message = re.escape(f"ckpt/4 did not restore ({reason}") + r".*\); move it away to resume from step 2$"
        for load in (lambda: checkpoint.load_model("resume", out),
                     lambda: train.Trainer(settings(dataset, out, "--init_from=resume"))):
            with pytest.raises(checkpoint.CheckpointError, match=message) as e:
                load()
            assert "\n" not in str(e.value), what
    # the scripts: a UsageError, which exit_on_bad_input prints as one line (exit 2)
    with pytest.raises(UsageError, match=message):
        sample.main([f"--out_dir={out}", "--num_samples=1", "--max_new_tokens=2"])
    with pytest.raises(UsageError, match=message):
        export.main([f"--out_dir={out}", f"--to={tmp_path / 'hf'}"])
    assert not (tmp_path / "hf").exists()


def test_rotation_keeps_the_latest_and_the_best(tmp_path):
    """keep 2: saves with a val loss and without one (checkpoint_interval, a stop); a reopened directory (a resumed
    run) still knows which is best."""
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
    """The issue's run: checkpoint_interval=1, keep_checkpoints=2, the val loss blows up to 1.6e10 (finite: the
    run goes on) after step 2. A step that is evaluated is saved by its eval, with its val loss."""
    vals = {0: 4.0, 2: 2.0, 4: 1.6e10, 6: 1.6e10, 8: 3.0e10, 10: 1.6e10}
    monkeypatch.setattr(train.Trainer, "estimate_loss", lambda self: {"train": 1.0, "val": vals[self.iter_num]})
    args = ["--eval_interval=2", "--checkpoint_interval=1", "--keep_checkpoints=2"]
    run(dataset, tmp_path, "--max_iters=6", *args)
    assert checkpoint.all_steps(tmp_path) == [2, 5, 6]
    run(dataset, tmp_path, "--init_from=resume", "--max_iters=10", *args)
    assert checkpoint.all_steps(tmp_path) == [2, 9, 10]
    with open(tmp_path / "ckpt" / "2" / "metrics" / "metrics") as f:  # the val loss of its eval
        assert json.load(f) == {"val_loss": 2.0}
    assert "tracked_metric" not in caplog.text  # orbax's warning of a save without a val loss


def test_a_full_disk_during_a_save_is_one_line_on_stderr(dataset, tmp_path):
    """A disk that fills while tensorstore writes the array files: each write still in flight fails after orbax has
    closed its event loop, which was dozens of tracebacks before the one line. A tmpfs of 600 kB (where mount is
    permitted: root) fills during the first save."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("mount -t tmpfs is not permitted here (not root)")
    try:
        r = train_cli([*TINY, f"--dataset={dataset}", f"--out_dir={disk / 'out'}", "--max_iters=200",
                       "--checkpoint_interval=1", "--keep_checkpoints=100"])
    finally:
        subprocess.run(["umount", str(disk)], check=True)
    err = one_line_error(r, 1)
    assert "No space left on device" in err or "RESOURCE_EXHAUSTED" in err, err


# train.py, whose checkpoint files may grow to 4 kB only (RLIMIT_FSIZE, set as the first save starts, when every
# compilation, and its cache file, is done): a write past it fails in tensorstore's threads, as on a full disk
FILE_SIZE_LIMIT = r"""if True:
    import resource, signal, sys
    import jax
    import orbax.checkpoint as ocp
    import train
    import train_step
    from configurator import exit_on_bad_input
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails (EFBIG) instead of ending the process
    save = ocp.CheckpointManager.save
    def limited_save(self, *args, **kwargs):
        jax.config.update("jax_enable_compilation_cache", False)  # a cache file written from now on could be cut
        resource.setrlimit(resource.RLIMIT_FSIZE, (4000, resource.RLIM_INFINITY))
        return save(self, *args, **kwargs)
    ocp.CheckpointManager.save = limited_save
    exit_on_bad_input(lambda: train.main(sys.argv[1:]))
"""


def test_writes_failing_during_a_save_are_one_line_on_stderr(dataset, tmp_path):
    """The same without root: the files of a checkpoint may not grow past 4 kB."""
    r = subprocess.run([sys.executable, "-c", FILE_SIZE_LIMIT, *TINY, f"--dataset={dataset}",
                        f"--out_dir={tmp_path}", "--max_iters=20", "--checkpoint_interval=2"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    err = one_line_error(r, 1)
    assert "saving a checkpoint to" in err and "No checkpoint is left there" in err, err


def test_a_read_only_checkpoint_folder_stops_the_run_in_one_line_and_it_exits(dataset, tmp_path):
    """OUT/ckpt read-only under a resumed run (a read-only bind mount, in a private mount namespace: root): the
    failed save is one line with the advice for a permission error, and the process exits; it waited forever for
    orbax's writer threads (issue 33). The timeout fails this test, not the suite."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a read-only bind mount needs root and unshare")
    out = tmp_path / "out"
    run(dataset, out, "--checkpoint_interval=2")
    ckpt = out / "ckpt"
    resume = shlex.join([sys.executable, "train.py", *TINY, f"--dataset={dataset}", f"--out_dir={out}",
                         "--init_from=resume", "--max_iters=8", "--checkpoint_interval=2"])
    script = f"mount --bind {ckpt} {ckpt} && mount -o remount,bind,ro {ckpt} && exec {resume}"
    r = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    if r.returncode and "mount" in r.stderr and "error:" not in r.stderr:
        pytest.skip(f"a private read-only mount is not permitted here: {r.stderr.strip()[:200]}")
    err = one_line_error(r, 1)
    assert "Read-only file system" in err and f"Checkpoint 4 is intact: make {ckpt} writable and resume" in err, err
    assert checkpoint.all_steps(out)[-1] == 4


def test_a_failed_save_names_as_intact_only_a_checkpoint_still_there(tmp_path):
    """out_dir's target deleted under a run: the line of the failed save claims no checkpoint that is gone."""
    mngr = checkpoint.manager(tmp_path)
    for step in (2, 4):
        checkpoint.save(mngr, step, {"w": jax.numpy.ones(3)}, {"m": jax.numpy.zeros(3)}, {"iter_num": step})
        checkpoint.wait_saved(mngr)

    def failed_save():
        with pytest.raises(RunStopped) as e, checkpoint._save_errors(mngr):
            raise OSError(errno.EACCES, "Permission denied", str(tmp_path))
        return str(e.value)

    assert failed_save().endswith(f"Checkpoint 4 is intact: make {tmp_path / 'ckpt'} writable and resume from it")
    shutil.rmtree(tmp_path / "ckpt" / "4")
    assert "Checkpoint 2 is intact" in failed_save()
    shutil.rmtree(tmp_path / "ckpt")
    assert failed_save().endswith("the run stopped. No checkpoint is left there")
    mngr.close()


def test_a_failed_save_names_the_checkpoints_that_completed_while_the_next_ones_were_saved(tmp_path):
    """Saves back to back, as on a slow store where one is always in flight when the run checks: each save waits for
    the one before, which is then whole. A failure names the last of those, not 'no checkpoint', nor the last save,
    which the run has not seen complete (its folder there or not)."""
    mngr = checkpoint.manager(tmp_path)
    for step in (2, 4, 6):
        checkpoint.save(mngr, step, {"w": jax.numpy.ones(3)}, {"m": jax.numpy.zeros(3)}, {"iter_num": step})
    deadline = time.time() + 60
    while not (tmp_path / "ckpt" / "6").is_dir() and time.time() < deadline:
        time.sleep(0.01)
    with pytest.raises(RunStopped) as e, checkpoint._save_errors(mngr):
        raise OSError(errno.EACCES, "Permission denied", str(tmp_path))
    assert "Checkpoint 4 is intact" in str(e.value), e.value  # 6: still in flight, not seen to complete
    mngr.close()


def test_a_save_that_fails_as_it_starts_is_one_line(tmp_path, monkeypatch):
    mngr = checkpoint.manager(tmp_path)
    checkpoint.save(mngr, 2, {"w": jax.numpy.ones(3)}, {"m": jax.numpy.zeros(3)}, {"iter_num": 2})

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(mngr, "save", disk_full)
    with pytest.raises(RunStopped, match=r"failed \(\[Errno 28\] No space left on device\); the run stopped. "
                                         "Checkpoint 2 is intact: free space and resume from it$"):
        checkpoint.save(mngr, 4, {"w": jax.numpy.ones(3)}, {"m": jax.numpy.zeros(3)}, {"iter_num": 4})
    mngr.close()


def test_orbax_warnings_of_normal_saves_stay_off_stderr(tmp_path, monkeypatch, caplog):
    """A save without a val loss, and one that waited for the one before (a slow store; orbax warns past 1 s, here
    past -1 s): no warning on stderr, where a failed run's one line is all there is."""
    from orbax.checkpoint import checkpoint_manager

    monkeypatch.setattr(checkpoint_manager, "_WAIT_FOR_PREV_SAVE_WARNING_THRESHOLD_SECS", -1.0)
    mngr = checkpoint.manager(tmp_path)
    with caplog.at_level(logging.WARNING):
        for step in (2, 4):
            checkpoint.save(mngr, step, {"w": jax.numpy.ones(3)}, {"m": jax.numpy.zeros(3)}, {"iter_num": step})
        checkpoint.wait_saved(mngr)
    mngr.close()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_a_failed_saves_fix_is_named_by_the_first_cause_that_says(gcs):
    """The cause named is the first in the chain that says what to do; where none does, the error raised (a URL's
    bucket, listed on the emulator, answering)."""
    def raised(cause):  # orbax's error, raised from the storage's
        try:
            raise RuntimeError("save failed") from cause
        except RuntimeError as e:
            return e

    for cause, where, fix in [(OSError(errno.ENOSPC, "No space left"), "out/ckpt", "free space"),
                              (OSError(errno.EROFS, "Read-only file system"), "out/ckpt", "make out/ckpt writable"),
                              (PermissionError("403 Forbidden"), "gs://b/run/ckpt", "fix the bucket's access"),
                              (ConnectionError("reset by peer"), "gs://b/run/ckpt", "check the network"),
                              (ConnectionError("reset by peer"), "out/ckpt", None),
                              (ValueError("not a storage failure"), "gs://b/run/ckpt", None)]:
        error = raised(cause)
        expected = (cause, fix) if fix else (error, "fix the cause above")
        assert storage.write_failure(where, error) == expected, (cause, where)
