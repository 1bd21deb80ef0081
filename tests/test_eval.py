"""python -m pytest tests/test_eval.py -q

eval.py: lm-evaluation-harness on our model, equal to lm-eval's own hf model; offline, on
eval_tasks/'s tasks. On a saved HF directory and train.py's checkpoint: requests cut and batched,
progress bars, parity with lm-eval's hf model on each output type (and a bug in our loader caught),
the results of a checkpoint and of its exports, bad input in one line, an 8-device mesh (the
scoring and generation on models made in memory: test_eval_scoring.py)."""

import json
import os
import pickle
import re
import subprocess
import sys

import numpy as np
import pytest
from helpers import REPO, TASKS, fake_devices, run, transpose_c_proj_on_restore
from lm_eval.api.instance import Instance

import eval as lm_eval_py
import export
import hellaswag
from archs.models import load_pretrained
from compute import sharding
from configurator import UsageError, exit_on_bad_input
from dataio.tokenizer import get_encoding
from parity import check_eval
from parity import nanogpt_reference as nanogpt
from parity.common import save_random_hf_model
from run import eval_lm, runlog

TINY_HF = dict(n_layer=2, n_head=2, n_embd=32, n_positions=64)


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    return save_random_hf_model(str(tmp_path_factory.mktemp("hf")), seed=1, **TINY_HF)


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory):
    """train.py's checkpoint of a tiny GPT-2-vocabulary model (2 steps on Shakespeare's BPE
    tokens)."""
    data = tmp_path_factory.mktemp("bpe")
    with open(os.path.join(REPO, "data", "shakespeare_char", "input.txt")) as f:
        ids = np.array(get_encoding().encode_ordinary(f.read()[:60000]), np.uint16)
    ids[:-2000].tofile(data / "train.bin")
    ids[-2000:].tofile(data / "val.bin")
    out = str(tmp_path_factory.mktemp("run"))
    # exact: nanoGPT's, for its export
    run(str(data), out, "--max_iters=2", "--block_size=64", "--gelu=exact")
    return out


def test_a_request_one_token_too_long_is_cut_by_one_from_the_left(tiny_hf, capsys):
    """block_size + 1 tokens fit (the last is only a target); one more and the context's first token
    goes, as lm-eval's hf model cuts it, and the cut is said."""
    lm = eval_lm.JaxLM(
        load_pretrained(tiny_hf)[0], sharding.make_mesh(), batch_size=3, progress=False
    )
    context, continuation = list(range(100, 161)), [7, 8, 9, 10, 11]  # 61 + 5 = block_size 64 + 2
    scores = lm._loglikelihood_tokens(
        [
            (None, context[1:], continuation),
            (None, context, continuation),
            (None, context[2:], continuation),
        ]
    )
    assert scores[1] == scores[0] != scores[2]
    assert re.search(
        r"(^|\n)1 of 3 requests longer than block_size 64: context cut from the left, as lm-eval's "
        r"hf model cuts it\n",
        capsys.readouterr().err,
    )
    for n in (0, 65):
        with pytest.raises(
            UsageError, match=rf"^a continuation of {n} tokens: it must be 1 to block_size 64$"
        ):
            lm._loglikelihood_tokens([(None, [1, 2], list(range(n)))])
    # batched by length: the short rows in a short batch (unsorted, each batch would hold a long
    # row)
    lm._loglikelihood_tokens(
        [(None, context[55 if i % 2 else 1 :], continuation) for i in range(6)]
    )
    assert (
        "6 requests in 2 batches of 3 rows, padded to 2 lengths [16, 64]" in capsys.readouterr().err
    )


@pytest.mark.slow
def test_scoring_shows_a_progress_bar_of_its_requests_unless_off(tiny_hf, capsys):
    """loglikelihood and loglikelihood_rolling (which scores a document's windows as requests) count
    what they score on a bar, unless progress is off or lm-eval disables it."""
    lm = eval_lm.JaxLM(
        load_pretrained(tiny_hf)[0], sharding.make_mesh(), batch_size=2, progress=True
    )
    pairs = [Instance("loglikelihood", {}, ("To be, or not", " to be"), 0)] * 3
    documents = [
        Instance(
            "loglikelihood_rolling", {}, ("To be, or not to be: that is the question. " * 12,), 0
        )
    ]
    quiet = eval_lm.JaxLM(lm.model, sharding.make_mesh(), batch_size=2, progress=False)
    for score, requests in [("loglikelihood", pairs), ("loglikelihood_rolling", documents)]:
        first = getattr(lm, score)(requests)
        # the document: 157 tokens, 3 windows
        assert re.search(r"loglikelihood: 100%.* 3/3 .*req/s", capsys.readouterr().err), score
        for scorer, disable_tqdm in [(quiet, False), (lm, True)]:
            assert getattr(scorer, score)(requests, disable_tqdm) == first
            assert not re.search(r"loglikelihood: +\d+%", capsys.readouterr().err), (
                score,
                disable_tqdm,
            )


def test_parity_with_lm_eval_hf_model_on_each_output_type(tiny_hf, capsys):
    """multiple choice, rolling loglikelihood and generate_until: every request as lm-eval's hf
    model (fp32)."""
    assert check_eval.main([f"--init_from={tiny_hf}", "--limit=4"]) == 0
    out = capsys.readouterr().out
    assert "fp32 parity (loglikelihoods, is_greedy, rolling, texts, accuracies): OK" in out
    assert re.search(r"4/4 texts equal, [1-4] non-empty", out), out


@pytest.mark.slow
def test_eval_on_a_train_py_checkpoint_and_its_exports(bpe_run, tmp_path, capsys):
    out = tmp_path / "results.json"
    assert (
        lm_eval_py.main(
            [
                f"--out_dir={bpe_run}",
                "--init_from=resume",
                "--tasks=hellaswag_local",
                f"--include_path={TASKS}",
                "--limit=3",
                "--num_fewshot=1",
                "--log_samples=True",
                "--bootstrap_iters=0",
                "--batch_size=4",
                f"--output={out}",
                "--seed=7",
            ]
        )
        == 0
    )
    printed = capsys.readouterr()
    assert f"\nwrote {out}\n" in printed.err and "wrote" not in printed.out
    lines = out.read_text().splitlines()
    assert lines[0] == "{" and re.match(r'^  "\w', lines[1]), lines[:2]  # indented by 2
    # 3 examples x 4 endings
    assert "loglikelihood: 12 requests in 3 batches of 4 rows" in printed.err
    assert re.search(r"loglikelihood: 100%.* 12/12 ", printed.err), printed.err  # a progress bar
    assert "hellaswag_local" in printed.out and "acc_norm" in printed.out  # lm-eval's table
    results = json.loads(out.read_text())
    assert (
        results["config"]["model_args"]["step"] == 2 and results["config"]["bootstrap_iters"] == 0
    )
    assert results["config"]["model"] == "nanogpt-jax"
    assert [
        results["config"][f"{name}_seed"] for name in ("random", "numpy", "torch", "fewshot")
    ] == [7] * 4
    assert results["config"]["model_args"]["model_config"]["n_embd"] == 32
    assert (
        results["n-shot"]["hellaswag_local"] == 1
        and results["n-samples"]["hellaswag_local"]["effective"] == 3
    )
    sample = results["samples"]["hellaswag_local"][0]
    assert len(sample["arguments"]) == 4  # four choices
    context = sample["arguments"][0][0]
    assert context.count("\n\n") == 1  # one example before the question
    assert printed.err.count("cut from the left") <= 1  # said once per call, if at all
    # what was loaded and how long it took: the model's size in millions, the mesh, then the
    # evaluation's time
    n_params = lm_eval_py.load_with_codec("resume", bpe_run, "float32")[0].num_params()
    assert f"(step 2): {n_params / 1e6:.2f}M params, block_size 64, loaded in " in printed.err, (
        printed.err
    )
    assert "mesh {'data': 1, 'fsdp': 1, 'tensor': 1}" in printed.err
    assert "compiled shapes so far: " in printed.err
    times = re.search(
        r"loaded in (\d+\.\d)s; .*\nevaluated in (\d+\.\d)s, [1-9]\d* compiled shapes\n",
        printed.err,
        re.S,
    )
    assert times and all(0 <= float(t) < 600 for t in times.groups()), printed.err

    export.main([f"--out_dir={bpe_run}", "--format=nanogpt", f"--to={tmp_path / 'nano'}"])
    export.main([f"--out_dir={bpe_run}", f"--to={tmp_path / 'hf'}"])
    # the HF directory's evaluated as a group of the one task: lm-eval's table of groups is printed
    # too eval_tasks/'s files (linked: local_data.py finds its data beside its own path)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    for name in os.listdir(TASKS):
        os.symlink(os.path.join(TASKS, name), tasks / name)
    (tasks / "local_group.yaml").write_text(
        "group: local_group\ntask: [hellaswag_local]\naggregate_metric_list:\n"
        "  - {metric: acc, aggregation: mean, weight_by_size: true}\n"
    )
    for exported, task in (
        (tmp_path / "nano" / "ckpt.pt", "hellaswag_local"),
        (tmp_path / "hf", "local_group"),
    ):
        assert (
            lm_eval_py.main(
                [
                    f"--init_from={exported}",
                    f"--tasks={task}",
                    f"--include_path={tasks}",
                    "--limit=3",
                    "--num_fewshot=1",
                    "--bootstrap_iters=0",
                    f"--output={out}",
                    "--dtype=auto",
                    "--seed=7",
                ]
            )
            == 0
        )
        again = json.loads(out.read_text())
        assert again["results"]["hellaswag_local"] == results["results"]["hellaswag_local"], (
            exported
        )
        assert "samples" not in again  # log_samples off: lm-eval's default is on
    printed = capsys.readouterr()
    # dtype auto: float32 on a CPU
    assert printed.err.count("; jax float32 on 1 cpu device(s), mesh") == 2
    # no step: an HF directory
    assert f"model {tmp_path / 'hf'}: {n_params / 1e6:.2f}M params" in printed.err
    assert len(re.findall(r"^\|\s*Groups\s*\|", printed.out, re.M)) == 1, printed.out


# make test-slow (CI runs it): make test evaluates our checkpoint (the test above)
@pytest.mark.slow
def test_parity_reads_our_checkpoint_by_its_own_path(bpe_run, monkeypatch, capsys):
    """check_eval on train.py's checkpoint: lm-eval's hf model gets the weights through
    parity/torch_side.py (orbax's own reader), so a matrix that our loader transposes (layer 0's
    square attn.c_proj) is a mismatch."""
    argv = [
        "--init_from=resume",
        f"--out_dir={bpe_run}",
        "--tasks=hellaswag_local",
        f"--include_path={TASKS}",
        "--limit=1",
    ]
    assert check_eval.main(argv) == 0
    transpose_c_proj_on_restore(monkeypatch)
    capsys.readouterr()
    assert check_eval.main(argv) == 1
    assert (
        "fp32 parity (loglikelihoods, is_greedy, rolling, texts, accuracies): NOT OK"
        in capsys.readouterr().out
    )


def fails(match, *argv):
    with pytest.raises(UsageError, match=match):
        lm_eval_py.main(list(argv))


# make test-slow (CI runs it): the lookups read lm-eval's index of its ~15k tasks (6 s on 2 cores);
# make test holds every other bad setting (below)
@pytest.mark.slow
def test_an_unknown_task_is_one_line_naming_the_closest(tiny_hf, monkeypatch):
    from lm_eval import tasks

    # the index built once for the two lines
    indexes, index = {}, tasks.TaskManager

    def cached(**kw):
        key = repr(sorted(kw.items()))
        if key not in indexes:
            indexes[key] = index(**kw)
        return indexes[key]

    monkeypatch.setattr(tasks, "TaskManager", cached)
    fails(
        r"^unknown task 'hellaswag_locall' \(did you mean hellaswag_local(, [\w.-]+)*\?\) "
        r"\(lm-eval's tasks",
        f"--init_from={tiny_hf}",
        "--tasks=hellaswag_local,hellaswag_locall",
        f"--include_path={TASKS}",
    )  # each task of the list looked up
    fails(
        r"^unknown task 'qqqzzz' \(lm-eval's tasks: python -m lm_eval ls tasks; local YAMLs: "
        r"--include_path=DIR\)$",
        f"--init_from={tiny_hf}",  # a hub name would be fetched first (tests/test_eval_checks.py)
        "--tasks=qqqzzz",
        f"--include_path={TASKS}",
    )  # nothing close: no guess


def test_bad_input_is_one_line(tiny_hf, tmp_path, capsys, monkeypatch):
    fails("batch_size must be an integer >= 1", "--tasks=hellaswag_local", "--batch_size=0")
    fails(
        r"^--tasks is required: lm-eval task names, comma-separated \(e\.g\. "
        r"--tasks=hellaswag,arc_easy\)$",
        f"--init_from={tiny_hf}",
    )
    fails("limit", "--tasks=x", "--limit=0")
    # a float is a fraction: 1.0 is none
    fails(r"fraction in \(0, 1\), got 1\.0$", "--tasks=x", "--limit=1.0")
    fails(
        r"^--limit must be an integer >= 1 \(documents\) or a fraction in \(0, 1\), got 0\.0$",
        "--tasks=x",
        "--limit=0.0",
    )
    fails(r"^--num_fewshot must be an integer >= 0, got -1$", "--tasks=x", "--num_fewshot=-1")
    # zero-shot: taken
    lm_eval_py.check_settings({**lm_eval_py.defaults, "tasks": "x", "num_fewshot": 0})
    # as `python eval.py ...` runs
    monkeypatch.setattr(sys, "argv", ["eval.py", "--batch_size=0", "--tasks=x"])
    with pytest.raises(UsageError, match=r"^--batch_size must be an integer >= 1, got 0$"):
        lm_eval_py.main()
    for limit in (0.5, 1):  # half of each task, its first document: taken
        lm_eval_py.check_settings({**lm_eval_py.defaults, "tasks": "x", "limit": limit})
    fails(
        rf"^--include_path {re.escape(str(tmp_path / 'none'))} is not a directory of task YAMLs$",
        "--tasks=x",
        f"--include_path={tmp_path / 'none'}",
    )
    # more ways than this process's one device, each setting named as given
    fails(
        r"^fsdp=1 x tensor_parallel=2 must be positive and divide the 1 device",
        f"--init_from={tiny_hf}",
        "--tasks=hellaswag_local",
        f"--include_path={TASKS}",
        "--tensor_parallel=2",
    )
    # a results file that could not be written is refused before anything is loaded or evaluated
    # (issue 33)
    fails(
        r"^--output=.*/no/such/r\.json: its directory .*/no/such does not exist: create it, or "
        r"give another path$",
        f"--init_from={tiny_hf}",
        "--tasks=hellaswag_local",
        f"--include_path={TASKS}",
        f"--output={tmp_path / 'no' / 'such' / 'r.json'}",
    )
    fails(r"^--output=.* is a directory", "--tasks=x", f"--output={tmp_path}")
    # and written whole: a write that fails all the same is one line, after the results were printed
    runlog.write_results(str(tmp_path / "r.json"), "{}", "--output")
    assert os.listdir(tmp_path) == ["r.json"]
    with pytest.raises(
        UsageError, match=r"could not be written \(No such file or directory\); the results are "
    ):
        runlog.write_results(str(tmp_path / "gone" / "r.json"), "{}", "--output")
    fails(
        "no checkpoint|not found",
        "--init_from=resume",
        f"--out_dir={tmp_path / 'none'}",
        "--tasks=hellaswag_local",
        f"--include_path={TASKS}",
    )
    # a nanoGPT ckpt.pt of shakespeare_char: its meta.pkl beside it
    with open(tmp_path / "meta.pkl", "wb") as f:
        pickle.dump(
            {
                "vocab_size": 64,
                "itos": {i: chr(32 + i) for i in range(64)},
                "stoi": {chr(32 + i): i for i in range(64)},
            },
            f,
        )
    config = nanogpt.GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=32)
    nanogpt.save_ckpt(nanogpt.GPT(config), tmp_path / "ckpt.pt", config={"dataset": str(tmp_path)})
    fails(
        r"ckpt\.pt is a character-level model \(a vocabulary of 64 characters\): lm-eval's tasks "
        r"are text in GPT-2's BPE, give a GPT-2 model$",
        f"--init_from={tmp_path / 'ckpt.pt'}",
        "--tasks=hellaswag_local",
        f"--include_path={TASKS}",
    )
    with pytest.raises(
        UsageError,
        match=r"ckpt\.pt is a character-level model \(a vocabulary of 64 characters\): "
        # hellaswag.py's reason
        r"HellaSwag is scored in GPT-2's BPE, give a GPT-2 model$",
    ):
        hellaswag.load_model(str(tmp_path / "ckpt.pt"), "out")
    # the command: one line, exit 2 (exit_on_bad_input, as `python eval.py` runs main)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        exit_on_bad_input(lambda: lm_eval_py.main(["--tasks=hellaswag_local", "--batch_size=0"]))
    err = capsys.readouterr().err
    assert (
        e.value.code == 2
        and err.startswith("error: ")
        and "batch_size" in err
        and err.count("\n") == 1
    ), err


MESH_SCRIPT = """
import json, sys
import jax, numpy as np
from lm_eval.api.instance import Instance
from run import eval_lm
from compute import sharding
from archs.models import load_pretrained
model, _ = load_pretrained(sys.argv[1])
text = open("data/shakespeare_char/input.txt").read()
ll = [Instance("loglikelihood", {}, (text[i: i + 5 + i % 40], text[i + 400: i + 420]), 0) for i in range(0, 5000, 250)]
roll = [Instance("loglikelihood_rolling", {}, (text[i: i + 600],), 0) for i in (0, 3000)]
gen = [Instance("generate_until", {}, (text[i: i + 60 + i % 40], {"until": ["\\n"], "max_gen_toks": 8}), 0)
       for i in range(0, 1200, 400)]
out = {}
for name, mesh in [("one", sharding.make_mesh(devices=jax.devices()[:1])), ("fsdp2", sharding.make_mesh(fsdp=2))]:
    lm = eval_lm.JaxLM(model, mesh, batch_size=2, progress=False)
    out[name] = [lm.loglikelihood(ll, True), lm.loglikelihood_rolling(roll, True), lm.generate_until(gen, True),
                 dict(mesh.shape)]
print(json.dumps(out))
"""  # noqa: E501


@pytest.mark.slow  # a mesh computes what one device does: make test checks it (test_sharding.py)
def test_an_8_device_mesh_with_fsdp_gives_one_devices_numbers(tiny_hf):
    env = fake_devices(8)
    result = subprocess.run(
        [sys.executable, "-c", MESH_SCRIPT, tiny_hf],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    (ll1, roll1, gen1, _), (ll8, roll8, gen8, shape) = out["one"], out["fsdp2"]
    assert shape == {"data": 4, "fsdp": 2, "tensor": 1}
    np.testing.assert_allclose([x[0] for x in ll8], [x[0] for x in ll1], rtol=1e-5)
    assert [x[1] for x in ll8] == [x[1] for x in ll1]
    np.testing.assert_allclose(roll8, roll1, rtol=1e-5)
    assert gen8 == gen1 and any(gen1)
