"""python -m pytest tests/test_sharding.py -q

Sharded training on the (data, fsdp, tensor) mesh: the same run on 1 device and on 8 fake CPU
devices as fsdp 8, fsdp 4 x tensor 2 and (slow) data 8 and data 2 x fsdp 2 x tensor 2 (losses, grad
norms, final params); memory that really divides under fsdp; resume across meshes; two processes
with fsdp spanning both, preempted (SIGTERM to one) and resumed. (make test holds attention's
forward and gradients under data 2 x fsdp 2 x tensor 2: test_attention.py.)"""

import json
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import (
    REPO,
    TINY,
    assert_close,
    fake_devices,
    free_port,
    popen_train,
    read_log,
    run,
    settings,
    tiny_config,
)

import train
from compute import sharding
from configurator import UsageError
from model import GPT
from run import checkpoint

WIDE = ["--n_embd=64", "--max_iters=4", "--eval_interval=4", "--always_save_checkpoint=True"]
ROWS = 8  # global micro-batch: every mesh below splits it differently
MESHES = {"fsdp8": (8, 1), "fsdp4_tp2": (4, 2)}
# make test-slow (CI runs it), a compile each: data 8 (a mesh with neither axis that splits the
# state, the batch split as fsdp 8 splits it) and all three axes at once
SLOW_MESHES = {"data8": (1, 1), "data2_fsdp2_tp2": (2, 2)}


def mesh_args(fsdp, tp, devices=8):
    shards = devices // tp
    return [
        f"--fsdp={fsdp}",
        f"--tensor_parallel={tp}",
        f"--batch_size={ROWS // shards}",
        f"--gradient_accumulation_steps={shards}",
    ]


# Runs every mesh in one process with 8 fake devices (one compile cache, one start-up), each run's
# directory copied to the names its `copies` lists once it is done; then reports what the test
# checks about memory: per-device bytes and the shard sizes of every >=2-D param and its Adam
# moments.
EIGHT_DEVICE_RUNS = r"""
import json, os, shutil, sys
import jax
import train
from compute import sharding
from configurator import configure
from run.settings import DEFAULTS
out, runs = sys.argv[1], json.loads(sys.argv[2])
report = {}
for name, args, copies in runs:
    t = train.Trainer(configure(DEFAULTS, args)).run()
    for copy in copies:
        shutil.copytree(os.path.join(out, name), os.path.join(out, copy))
    shards = {}
    for tree in (t.params, t.opt_state):
        for path, x in jax.tree_util.tree_leaves_with_path(tree):
            if x.ndim >= 2:
                shards[jax.tree_util.keystr(path)] = [x.addressable_shards[0].data.size, x.size]
    report[name] = {"state_bytes": t.state_bytes, "shards": shards}
print("REPORT " + json.dumps(report))
"""


def run_8_devices(runs, tmp_path):
    """`runs`: [(name, train.py's arguments, names to copy its out_dir to once it is done)], run in
    this order."""
    env = fake_devices(8)
    p = subprocess.run(
        [sys.executable, "-c", EIGHT_DEVICE_RUNS, str(tmp_path), json.dumps(runs)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(next(x for x in p.stdout.splitlines() if x.startswith("REPORT "))[7:])


@pytest.fixture(scope="module")
def mesh_runs(dataset, tmp_path_factory):
    """A 2-step fsdp 4 x tensor 2 run that saves at step 2 (copied twice, to resume from: here, and
    on data 8 in make test-slow), and every mesh's 4-step run; then the 1-device run and the resume
    on 1 device here. Also the 1-device run's final params: the reference, and the template to
    restore any of the checkpoints with; its state's bytes, the replicated figure."""
    tmp = tmp_path_factory.mktemp("meshes")
    common = TINY + WIDE + [f"--dataset={dataset}"]
    runs = [
        (
            "half",
            common
            + mesh_args(4, 2)
            + [f"--out_dir={tmp / 'half'}", "--max_iters=2", "--checkpoint_interval=2"],
            ["resumed_data8", "resumed_one"],
        ),
    ]
    runs += [
        (name, common + mesh_args(*m) + [f"--out_dir={tmp / name}"], [])
        for name, m in MESHES.items()
    ]
    report = run_8_devices(runs, tmp)
    one = train.Trainer(settings(dataset, tmp / "one", *WIDE, f"--batch_size={ROWS}")).run()
    report["one"] = {"state_bytes": one.state_bytes}
    train.Trainer(
        settings(dataset, tmp / "resumed_one", *WIDE, f"--batch_size={ROWS}", "--init_from=resume")
    ).run()
    return tmp, report, one.params


def test_every_mesh_trains_as_one_device(mesh_runs):
    tmp, _, template = mesh_runs
    for name in MESHES:
        assert_trains_as_one_device(tmp, name, template)


@pytest.mark.slow
def test_data_8_and_all_three_axes_train_as_one_device_and_resume(mesh_runs, dataset):
    """Also fsdp 4 x tensor 2's checkpoint at step 2 resumed on data 8: steps 2 and 3 as the
    uninterrupted run's."""
    tmp, _, template = mesh_runs
    common = TINY + WIDE + [f"--dataset={dataset}"]
    resumed = [f"--out_dir={tmp / 'resumed_data8'}", "--init_from=resume"]
    run_8_devices(
        [(n, common + mesh_args(*m) + [f"--out_dir={tmp / n}"], []) for n, m in SLOW_MESHES.items()]
        + [("resumed_data8", common + mesh_args(1, 1) + resumed, [])],
        tmp,
    )
    for name in SLOW_MESHES:
        assert_trains_as_one_device(tmp, name, template)
    assert_resumed_as_the_whole_run(tmp, "resumed_data8")


def assert_trains_as_one_device(tmp, name, template):
    """The run in tmp/name logged the 1-device run's losses and grad norms and ended at its
    params."""
    ref_params = jax.tree.leaves(checkpoint.restore(tmp / "one", params=template)["params"])
    for key in ("loss", "grad_norm"):
        assert_close(
            [v for _, v in read_log(tmp / name, key)],
            [v for _, v in read_log(tmp / "one", key)],
            rtol=1e-5,
            atol=0,
            what=f"{key} {name} vs 1 device",
        )
    params = jax.tree.leaves(checkpoint.restore(tmp / name, params=template)["params"])
    diff = np.sqrt(
        sum(np.sum((np.asarray(a) - np.asarray(b)) ** 2) for a, b in zip(params, ref_params))
    )
    norm = np.sqrt(sum(np.sum(np.asarray(b) ** 2) for b in ref_params))
    assert diff / norm < 1e-5, f"final params {name} vs 1 device: relative norm {diff / norm:.2e}"


def test_fsdp_divides_the_state(mesh_runs):
    _, report, _ = mesh_runs
    fsdp, replicated = report["fsdp8"], report["one"]
    assert fsdp["shards"], "no >=2-D state found"
    for path, (held, total) in fsdp["shards"].items():
        assert held * 8 == total, f"{path}: a device holds {held} of {total} elements under fsdp 8"
    # 1/8 of the replicated figure (1 device's: all of it), + 2% of it for what stays replicated
    # (LayerNorms, biases, Adam's count)
    assert fsdp["state_bytes"] <= replicated["state_bytes"] * (1 / 8 + 0.02), (
        fsdp["state_bytes"],
        replicated["state_bytes"],
    )


def test_resume_across_meshes(mesh_runs):
    """Saved under fsdp 4 x tensor 2 at step 2, resumed on 1 device (and on data 8, make test-slow,
    above): steps 2 and 3 as the uninterrupted fsdp 4 x tensor 2 run's."""
    tmp, _, _ = mesh_runs
    assert_resumed_as_the_whole_run(tmp, "resumed_one")


def assert_resumed_as_the_whole_run(tmp, resumed):
    whole = read_log(tmp / "fsdp4_tp2", "loss")
    log = read_log(tmp / resumed, "loss")
    assert [i for i, _ in log] == [0, 1, 2, 3]
    assert_close(
        [v for _, v in log[2:]], [v for _, v in whole[2:]], rtol=1e-5, atol=0, what=resumed
    )


@pytest.mark.slow
def test_sample_and_hellaswag_load_a_checkpoint_of_any_mesh(mesh_runs, dataset):
    """sample.py's and hellaswag.py's loader (checkpoint.load_model) reads the checkpoint saved
    under fsdp 4 x tensor 2 on 1 device: the weights train.py's resume restores from it."""
    from flax import nnx

    from dataio.weights import state_dict

    tmp, _, _ = mesh_runs
    model, config = checkpoint.load_model("resume", str(tmp / "half"))
    assert config["fsdp"] == 4 and config["tensor_parallel"] == 2
    resumed = train.Trainer(
        settings(dataset, tmp / "half", *WIDE, f"--batch_size={ROWS}", "--init_from=resume")
    )
    want = state_dict(nnx.merge(resumed.graphdef, resumed.params))
    got = state_dict(model)
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


# slow (make test-slow: CI runs it), 30 s each: make test keeps a killed process of two
# (test_multiprocess.py), a run on gs:// killed and resumed (test_gcs_run.py), and resume across
# meshes (above)
@pytest.mark.slow
@pytest.mark.parametrize("disk", ["local", "gs"])
def test_two_processes_fsdp_spanning_both_stop_at_one_step_on_sigterm_and_resume(
    mesh_runs, dataset, tmp_path, disk, request
):
    """The issue's pod: 2 processes x 4 devices with fsdp 8 across both (jax.distributed on
    loopback), SIGTERM to the second only: both stop at one step, saved (meanwhile a second run on
    the same out_dir is refused: the lock). Resumed on both, nothing lost, nothing repeated: the
    same losses as 1 process x 8 devices with fsdp 8, and as the same global batches straight
    through on this process's one device. On local disk, and on gs:// (Cloud Storage's emulator,
    tools/gcs_emulator.py: checkpoints, log and lock as a pod keeps them)."""
    tmp, _, _ = mesh_runs
    out = tmp_path / "multi" if disk == "local" else f"{request.getfixturevalue('gcs_dir')}/multi"
    args = [*TINY, "--n_embd=64", *mesh_args(8, 1), f"--dataset={dataset}", f"--out_dir={out}"]

    def start(*extra):
        port = free_port()
        return [popen_train([*args, *extra], i, port, devices=4) for i in range(2)]

    def wait(procs, timeout, read=""):
        """Each process's stdout (process 0's after what was `read` of it), once both have ended
        well."""
        outs = [p.communicate(timeout=timeout) for p in procs]
        for p, (_, err) in zip(procs, outs):
            assert p.returncode == 0, err[-3000:]
        stdouts = [read + outs[0][0], outs[1][0]]
        assert (
            "8 device(s)" in stdouts[0]
            and "on 2 process(es)" in stdouts[0]
            and "fsdp 8" in stdouts[0]
        )
        return stdouts

    procs = start("--max_iters=100000")
    try:
        deadline = time.time() + 240
        read = ""
        for line in procs[0].stdout:
            read += line
            if line.startswith("iter 5:") or time.time() > deadline:
                break
        # a third run: the lock
        with pytest.raises(UsageError, match=r"multi is in use by another run \(pid \d+"):
            train.Trainer(settings(dataset, out))
        procs[1].send_signal(signal.SIGTERM)
        outs = wait(procs, 60, read)
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()
                p.communicate()
    stopped = [
        int(line.split("iter ")[1].split(";")[0])
        for stdout in outs
        for line in stdout.splitlines()
        if line.startswith("SIGTERM: checkpoint saved at iter")
    ]
    assert len(stopped) == 2 and stopped[0] == stopped[1] == checkpoint.all_steps(out)[-1], stopped
    n = stopped[0]

    wait(start("--init_from=resume", f"--max_iters={n + 2}"), 300)
    log = read_log(out, "loss")
    assert [i for i, _ in log] == list(range(n + 2))  # nothing lost, nothing repeated
    assert_close(
        [v for _, v in log[:4]],
        [v for _, v in read_log(tmp / "fsdp8", "loss")],
        rtol=1e-5,
        atol=0,
        what="losses 2 processes vs 1",
    )
    # the same global batches straight through, in this process's one device (8 rows, as 8 devices x
    # 1)
    run(
        dataset,
        tmp_path / "straight",
        "--n_embd=64",
        f"--batch_size={ROWS}",
        f"--max_iters={n + 2}",
    )
    assert_close(
        [v for _, v in log],
        [v for _, v in read_log(tmp_path / "straight", "loss")],
        atol=1e-5,
        what="losses 2 processes vs 1 device",
    )


def test_constraints_fit_the_mesh_and_pin_the_batch_rows():
    """fit drops an entry whose axes do not divide its dimension (a tuple of axes by their product),
    and constrain_batch pins activations' rows over data x fsdp under a mesh (it once skipped that
    tuple)."""
    from jax.sharding import PartitionSpec as P

    mesh = jax.sharding.AbstractMesh(
        (2, 2, 2), sharding.AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3
    )
    assert sharding.fit(P(sharding.BATCH, None), (8, 3), mesh) == P(("data", "fsdp"), None)
    assert sharding.fit(P(sharding.BATCH, None), (6, 3), mesh) == P(None, None)
    assert sharding.fit(P("tensor", "fsdp"), (50257, 4), mesh) == P(None, "fsdp")
    with jax.sharding.use_abstract_mesh(mesh):
        jaxpr = str(jax.make_jaxpr(sharding.constrain_batch)(jnp.ones((8, 3))))
    assert "sharding_constraint" in jaxpr and "P(('data', 'fsdp'), None)" in jaxpr


def test_tensor_parallel_splits_qkv_and_fc_by_columns_and_the_projections_by_rows():
    """Megatron's split, read off the model's jaxpr under a tensor mesh of 2: c_attn's and c_fc's
    kernels (and biases) split by output columns, both c_proj kernels by input rows, so each block's
    two matmuls need one all-reduce; the embedding tables gathered whole for the lookup, the tied
    head split by vocabulary. Any other placement computes the same values, which every other test
    compares."""
    C = 64
    model = GPT(tiny_config(n_embd=C), nnx.Rngs(0))
    mesh = jax.sharding.AbstractMesh(
        (1, 1, 2), sharding.AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3
    )
    with jax.sharding.use_abstract_mesh(mesh):
        jaxpr = jax.make_jaxpr(lambda x: model(x)[0])(jnp.zeros((2, 8), jnp.int32))
    specs = {}
    for eqn in jaxpr.jaxpr.eqns:
        if eqn.primitive.name == "sharding_constraint":
            specs.setdefault(eqn.invars[0].aval.shape, set()).add(str(eqn.params["sharding"].spec))
    column, row = {"P(None, 'tensor')"}, {"P('tensor', None)"}
    assert specs[(C, 3 * C)] == specs[(C, 4 * C)] == column, specs  # c_attn, c_fc
    assert specs[(3 * C,)] == specs[(4 * C,)] == {"P('tensor',)"}, specs  # their biases
    assert specs[(C, C)] == specs[(4 * C, C)] == row, specs  # attn.c_proj, mlp.c_proj
    V, T = model.config.vocab_size, model.config.block_size
    assert specs[(T, C)] == {"P(None, None)"}, specs  # wpe: gathered whole for the lookup
    # wte: that, and the head's vocabulary split
    assert specs[(V, C)] == {"P(None, None)", "P('tensor', None)"}, specs


def test_mesh_settings_are_checked():
    devices = jax.devices()
    with pytest.raises(
        ValueError, match="fsdp=3 x tensor_parallel=1 must be positive and divide the 1 device"
    ):
        sharding.make_mesh(3, 1, devices)
    mesh = sharding.make_mesh(1, 1, devices)
    assert mesh.axis_names == ("data", "fsdp", "tensor") and mesh.devices.shape == (1, 1, 1)
    # the devices given, not every device: 3 here (the one device thrice)
    with pytest.raises(UsageError, match="divide the 3 device"):
        sharding.make_mesh(2, 1, devices * 3)


def test_batches_rows_are_split_over_data_and_fsdp():
    """(accum, B, T) micro-batches and put_rows' (B, T) arrays split by rows (B) over data x fsdp,
    not replicated: on one device both place the same, so only the specs tell."""
    from jax.sharding import PartitionSpec as P

    mesh = sharding.make_mesh(1, 1, jax.devices())
    assert sharding.batch_sharding(mesh).spec == P(None, sharding.BATCH, None)
    assert sharding.batch_sharding(mesh, ndim=2).spec == P(sharding.BATCH, None)
    (x,) = sharding.put_rows((np.arange(6).reshape(3, 2),), mesh)
    assert x.sharding.spec == P(sharding.BATCH, None) and x.tolist() == [[0, 1], [2, 3], [4, 5]]


def test_process_rows_joins_its_devices_ranges_and_refuses_a_gap():
    """A process's rows are its devices' row ranges joined, in any order; ranges with a gap
    between them are refused (on one device there is one range, so only a stand-in tells)."""

    class Rows:  # a sharding's map of devices to their indices, all process_rows reads
        def __init__(self, *ranges):
            self.ranges = ranges

        def addressable_devices_indices_map(self, shape):
            return {d: (slice(a, b), slice(None)) for d, (a, b) in enumerate(self.ranges)}

    assert sharding.process_rows(Rows((4, 8), (0, 4)), (8, 3), 0) == slice(0, 8)
    assert sharding.process_rows(Rows((None, None)), (8, 3), 0) == slice(0, 8)
    with pytest.raises(AssertionError, match="not contiguous"):
        sharding.process_rows(Rows((0, 2), (4, 8)), (8, 3), 0)


def test_the_compilation_cache_is_under_the_users_cache_directory(monkeypatch, tmp_path):
    """Without $JAX_COMPILATION_CACHE_DIR: nanogpt-jax/jax under $XDG_CACHE_HOME, else under
    ~/.cache (not a .cache in the working directory)."""
    saved = {
        k: getattr(jax.config, k)
        for k in ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    }
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    try:
        sharding.use_compilation_cache()
        home = tmp_path / ".cache" / "nanogpt-jax" / "jax"
        assert jax.config.jax_compilation_cache_dir == str(home)
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
        sharding.use_compilation_cache()
        xdg = tmp_path / "xdg" / "nanogpt-jax" / "jax"
        assert jax.config.jax_compilation_cache_dir == str(xdg)
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
    finally:
        for k, v in saved.items():
            jax.config.update(k, v)
