"""python -m pytest tests/test_nanochat_mesh.py -q

nanochat's GPT (arch='nanochat', optimizer='muonadamw', the depth dial) trained by train.py on the
(data, fsdp, tensor) mesh as on one device: a 1-device run's checkpoint resumed on 8 fake CPU
devices as fsdp 4 x tensor 2 (and, make test-slow, fsdp 8) logs the 1-device run's losses and grad
norms and ends at its params, with grouped key/value heads split over tensor and a short window
that masks; its state really split (compute/sharding.py's PARAM_SPECS); a tensor_parallel that does
not divide n_kv_head refused in one line. (GPT-2's meshes: tests/test_sharding.py.)"""

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace

import jax
import numpy as np
import pytest
from helpers import REPO, assert_close, fake_devices, read_log
from helpers.nanochat_data import shakespeare_folder

import train
from compute import sharding
from configurator import UsageError, command_line_keys, configure
from model import GPTConfig
from run.settings import DEFAULTS

# make test-slow (CI runs it): nanochat's GPT on a mesh (make test: GPT-2's, test_sharding.py)
pytestmark = pytest.mark.slow
VOCAB = 320
T = 160  # the short window, a quarter of T rounded up to 128 tokens, masks past 128
ROWS = 8  # global micro-batch: each mesh splits it over its batch shards
TOKENS = 2 * ROWS * T  # a step's tokens: 2 micro-batches on every mesh
MESHES = {"fsdp4_tp2": (4, 2)}
# make test-slow (CI runs it): the same claim on a second mesh, its compile and steps
SLOW_MESHES = {"fsdp8": (8, 1)}
WARM, STEPS = 2, 2  # steps on 1 device before the meshes take over, and theirs
# the 1-device run: WARM + STEPS steps, saved after WARM
STEPS_ARGS = [f"--max_iters={WARM + STEPS}", f"--checkpoint_interval={WARM}"]


@pytest.fixture(scope="module")
def nanochat_data(tmp_path_factory):
    """Shakespeare's paragraphs as three shards, as data/nanochat/prepare.py leaves them, and a
    tokenizer of VOCAB ids."""
    return shakespeare_folder(tmp_path_factory.mktemp("nanochat"), VOCAB)


def argv(data, out_dir, fsdp=1, tp=1, *extra):
    """config/nanochat_cpu.py at depth 3 (n_embd 21 x 3 rounded up to 64: 4 heads of 16) over 2
    key/value heads, windows S L L over T tokens; ROWS rows a micro-batch however the mesh splits
    them, 2 micro-batches a step. Depth 3, not 2: at depth 2 the layer backed out is the last, so
    backout_lambda only scales what the final norm unscales, and its gradient is float32 rounding
    (parity/check_nanochat_train.py)."""
    shards = 8 // tp if fsdp * tp > 1 else 1
    return [
        os.path.join(REPO, "config", "nanochat_cpu.py"),
        f"--dataset={data}",
        f"--out_dir={out_dir}",
        "--depth=3",
        "--aspect_ratio=21",
        "--head_dim=16",
        "--n_kv_head=2",
        f"--block_size={T}",
        "--window_pattern=SL",
        f"--batch_size={ROWS // shards}",
        f"--total_batch_size={TOKENS}",
        f"--fsdp={fsdp}",
        f"--tensor_parallel={tp}",
        "--warmup_iters=1",
        f"--eval_interval={WARM + STEPS}",
        f"--val_tokens={ROWS * T}",
        "--eval_iters=1",
        "--log_interval=1",
        "--always_save_checkpoint=False",
        *extra,
    ]


def trainer(args):
    return train.Trainer(configure(DEFAULTS, args), typed=command_line_keys(args))


def flat(tree):
    """{path: numpy array} of a params tree."""
    return {
        jax.tree_util.keystr(p, simple=True, separator="."): np.asarray(x)
        for p, x in jax.tree_util.tree_leaves_with_path(tree)
    }


# Runs each mesh in one python with 8 fake devices (one start-up), saving each run's final params
# beside its log; then reports, for every >=2-D param and optimizer state, the elements one device
# holds and the whole's.
EIGHT_DEVICE_RUNS = r"""
import json, os, sys
import jax
import numpy as np
import train
from configurator import command_line_keys, configure
from run.settings import DEFAULTS
from configurator import UsageError
report = {}
for name, args in json.loads(sys.argv[1]):
    if name == "refused":  # train.py's own check, before anything is written
        try:
            train.Trainer(configure(DEFAULTS, args), typed=command_line_keys(args))
        except UsageError as e:
            report[name] = str(e)
        continue
    t = train.Trainer(configure(DEFAULTS, args), typed=command_line_keys(args)).run()
    params = {
        jax.tree_util.keystr(p, simple=True, separator="."): np.asarray(x)
        for p, x in jax.tree_util.tree_leaves_with_path(t.params)
    }
    np.savez(os.path.join(t.c["out_dir"], "params.npz"), **params)
    shards = {}
    for tree in (t.params, t.opt_state):
        for path, x in jax.tree_util.tree_leaves_with_path(tree):
            if x.ndim >= 2:
                key = jax.tree_util.keystr(path, simple=True, separator=".")
                shards[key] = [x.addressable_shards[0].data.size, x.size]
    specs = {
        jax.tree_util.keystr(p, simple=True, separator="."): str(x.sharding.spec)
        for p, x in jax.tree_util.tree_leaves_with_path(t.params)
    }
    report[name] = {"shards": shards, "specs": specs, "devices": t.mesh.size}
print("REPORT " + json.dumps(report))
"""


def run_8_devices(runs):
    """EIGHT_DEVICE_RUNS of `runs` ([(name, train.py's arguments)]) -> its report."""
    p = subprocess.run(
        [sys.executable, "-c", EIGHT_DEVICE_RUNS, json.dumps(runs)],
        cwd=REPO,
        env=fake_devices(8),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(next(x for x in p.stdout.splitlines() if x.startswith("REPORT "))[7:])


def resumed_on(meshes, nanochat_data, tmp):
    """[(name, arguments)]: each mesh resuming the 1-device run's checkpoint at WARM for STEPS
    steps."""
    runs = []
    for name, mesh in meshes.items():
        shutil.copytree(tmp / "one" / "ckpt" / str(WARM), tmp / name / "ckpt" / str(WARM))
        runs.append(
            (name, argv(nanochat_data, tmp / name, *mesh, *STEPS_ARGS, "--init_from=resume"))
        )
    return runs


@pytest.fixture(scope="module")
def mesh_runs(nanochat_data, tmp_path_factory):
    """WARM + STEPS steps on 1 device, the reference, saved after WARM; then from that checkpoint
    STEPS more on every mesh (one subprocess). Not from the init: nanochat's zero projections
    make the stream a multiple of the embedding there, which the final norm's scale cancels, so
    the lambdas' first gradients are float32 rounding, which Adam (eps 1e-10) turns into full
    steps of either sign, on one device as on a mesh, each summing in its own order
    (parity/check_nanochat_train.py starts from a moved init for the same reason). A resume
    continues a run bit for bit (tests/test_nanochat_train.py)."""
    tmp = tmp_path_factory.mktemp("meshes")
    one = trainer(argv(nanochat_data, tmp / "one", 1, 1, *STEPS_ARGS))
    assert one.mesh.size == 1
    one.run()
    runs = resumed_on(MESHES, nanochat_data, tmp)
    runs.append(("refused", argv(nanochat_data, tmp / "refused", 4, 2, "--n_kv_head=1")))
    return tmp, run_8_devices(runs), one


@pytest.mark.slow
def test_every_mesh_trains_as_one_device(mesh_runs):
    """Losses and grad norms within rtol 1e-5 and the final params within 1e-5 of their norm, as
    tests/test_sharding.py holds GPT-2's: a sum split over devices (fsdp's reduce-scatter of the
    gradients, tensor's all-reduce after each row-parallel projection, the logits' softmax over a
    vocabulary split in two) adds the same float32 terms in another order, a few ulps (~1e-7) a
    sum, which two steps of Muon and Adam carry to ~1e-6 at most (seen: losses within 1e-6);
    a head, a window or a gather misplaced changes the values, not their rounding."""
    tmp, report, one = mesh_runs
    for name in MESHES:
        assert_trains_as_one_device(tmp, report, name, one)


def assert_trains_as_one_device(tmp, report, name, one):
    """The run in tmp/name logged the 1-device run's losses and grad norms from WARM on and ended
    at its params."""
    ref = flat(one.params)
    assert report[name]["devices"] == 8
    for key in ("loss", "grad_norm"):
        got, want = read_log(tmp / name, key), read_log(tmp / "one", key)[WARM:]
        assert [i for i, _ in got] == [i for i, _ in want] == [2, 3], key
        assert_close(
            [v for _, v in got],
            [v for _, v in want],
            rtol=1e-5,
            atol=0,
            what=f"{key} {name} vs 1 device",
        )
    with np.load(tmp / name / "params.npz") as f:
        params = {k: f[k] for k in f.files}
    assert params.keys() == ref.keys()
    diff = np.sqrt(sum(np.sum((params[k] - ref[k]) ** 2.0) for k in ref))
    norm = np.sqrt(sum(np.sum(ref[k] ** 2.0) for k in ref))
    assert diff / norm < 1e-5, f"final params {name} vs 1 device: relative {diff / norm:.2e}"
    # and each param on its own, not a sum that hides a small one gone wrong: its norm's 1e-5
    # too. An element where Muon's cautious mask flips (update x param ~0) moves by lr wd p
    # alone, far below that (parity/check_nanochat_train.py: at most 8.5e-6 against torch).
    for k in ref:
        rel = np.linalg.norm(params[k] - ref[k]) / np.linalg.norm(ref[k])
        assert rel < 1e-5, f"{k} {name} vs 1 device: relative {rel:.2e}"


def test_the_state_is_split_over_the_mesh(mesh_runs):
    """Under fsdp 4 x tensor 2 a device holds 1/8 of each of q's, k's and v's kernels (by fsdp
    over C, by tensor over the output columns: the heads), of the value embeddings (by
    vocabulary over tensor, by width over fsdp) and of their optimizer state; the gates stay
    whole."""
    _, report, _ = mesh_runs
    shards = report["fsdp4_tp2"]["shards"]
    params = [f"h.{i}.attn.{a}.kernel.value" for i in range(3) for a in ("c_q", "c_k", "c_v")]
    params += ["value_embeds.0.embedding.value", "value_embeds.2.embedding.value"]
    assert set(params) <= shards.keys(), sorted(shards)
    assert shards["h.0.attn.c_q.kernel.value"] == [64 * 64 // 8, 64 * 64]
    # q, k and v column parallel (their heads over tensor), the tables split by vocabulary
    specs = report["fsdp4_tp2"]["specs"]
    for p in params:
        want = "P('tensor', 'fsdp')" if "value_embeds" in p else "P('fsdp', 'tensor')"
        assert specs[p] == want, (p, specs[p])
    # each param's and its optimizer state's (Muon's momentum, Adam's moments: the same path)
    # (NorMuon's second moment, a row or a column, splits only where its length does)
    split = [k for k in shards for p in params if k.endswith(p) and shards[k][1] == shards[p][1]]
    assert len(split) > len(params), sorted(shards)
    for k in split:
        held, total = shards[k]
        assert held * 8 == total, f"{k}: a device holds {held} of {total} under fsdp 4 x tensor 2"
    for k, (held, total) in shards.items():
        if "ve_gate" in k or "smear_gate" in k:
            assert held == total, k


@pytest.mark.slow
def test_fsdp_8_trains_as_one_device_and_splits_every_matrix(mesh_runs, nanochat_data):
    """The 1-device run's checkpoint resumed under fsdp 8 too: as one device (the tolerances
    above); 1/8 of every matrix and its state on a device but the gates' and the untied head's
    (replicated: its path is record 20's too, compute/sharding.py)."""
    tmp, _, one = mesh_runs
    report = run_8_devices(resumed_on(SLOW_MESHES, nanochat_data, tmp))
    for name in SLOW_MESHES:
        assert_trains_as_one_device(tmp, report, name, one)
    fsdp = report["fsdp8"]["shards"]
    for p in (k for k in fsdp if k.startswith(("h.", "wte.", "value_embeds.", "lm_head."))):
        whole = any(n in p for n in ("ve_gate", "smear_gate", "lm_head"))
        for k in (k for k in fsdp if k.endswith(p) and fsdp[k][1] == fsdp[p][1]):
            held, total = fsdp[k]
            assert held * (1 if whole else 8) == total, f"{k}: {held} of {total} under fsdp 8"


def test_train_py_refuses_a_tensor_parallel_that_splits_a_key_value_head(mesh_runs):
    """fsdp 4 x tensor 2 over 4 query heads but 1 key/value head: one line, nothing written."""
    tmp, report, _ = mesh_runs
    assert report["refused"] == (
        "tensor_parallel=2 must divide n_kv_head=1 (the key/value heads, split over 'tensor' "
        "with their query heads): change --tensor_parallel or --n_kv_head"
    )
    assert not os.path.exists(tmp / "refused" / "ckpt")


def test_tensor_parallel_must_divide_the_key_value_heads():
    """GQA's key/value heads are split over tensor with their query heads: tensor 2 over 4 query
    heads but 1 key/value head is refused in one line; 2 key/value heads pass (0: one per query
    head, GPT-2's and the records' setting)."""
    mesh = jax.sharding.AbstractMesh(
        (1, 1, 2), sharding.AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3
    )
    config = GPTConfig(arch="nanochat", n_layer=2, n_head=4, n_embd=64, n_kv_head=1, bias=False)
    with pytest.raises(UsageError, match=r"^tensor_parallel=2 must divide n_kv_head=1 \(the "):
        sharding.check_model_fits_mesh(config, mesh)
    sharding.check_model_fits_mesh(replace(config, n_kv_head=2), mesh)
    sharding.check_model_fits_mesh(replace(config, n_kv_head=0), mesh)
