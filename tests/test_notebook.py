"""python -m pytest tests/test_notebook.py -q

notebooks/gpt2_tpu.ipynb, run top to bottom on the CPU with no Jupyter: its code cells in order as
one Python script in a fresh process, less its `!pip install` lines (this venv has everything) and
the cells tagged `network`. On a CPU the notebook picks its tiny Shakespeare run, so the script
trains, samples and plots in seconds. The TPU and GPU branches, which cannot run here, are checked
through train.py's own settings checks.
"""

import json
import os
import subprocess
import sys

import pytest
from helpers import REPO, read_log

from compute import accelerators
from configurator import configure
from run import checkpoint
from run.settings import DEFAULTS, accumulation_steps, validate
from sample import SEPARATOR

NOTEBOOK = os.path.join(REPO, "notebooks", "gpt2_tpu.ipynb")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SKIPPED_TAG = "network"  # cells that need the network: none here


def cells():
    with open(NOTEBOOK, encoding="utf-8") as f:
        nb = json.load(f)
    assert nb["nbformat"] == 4
    for cell in nb["cells"]:
        assert cell["cell_type"] in ("code", "markdown") and isinstance(cell["metadata"], dict)
        assert isinstance(cell["source"], list)
        if cell["cell_type"] == "code":  # stored without outputs
            assert cell["outputs"] == [] and cell["execution_count"] is None
    return nb["cells"]


def code_cells(tag=None):
    return [
        ("".join(c["source"]), c["metadata"].get("tags", []))
        for c in cells()
        if c["cell_type"] == "code" and (tag is None or tag in c["metadata"].get("tags", []))
    ]


def as_script():
    """The code cells as one script. A shell line (`!`, `%`) is dropped, and only `!pip install` may
    be one: every step the test must cover is plain Python."""
    parts = []
    for source, tags in code_cells():
        if SKIPPED_TAG in tags:
            continue
        lines = []
        for line in source.splitlines():
            if line.lstrip().startswith(("!", "%")):
                assert line.startswith("!pip install "), f"a shell line the test cannot run: {line}"
                continue
            lines.append(line)
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"


@pytest.mark.slow  # a kernel started and the whole notebook run: 11 s
def test_notebook_trains_samples_and_plots_on_cpu(tmp_path):
    script = tmp_path / "notebook.py"
    script.write_text(as_script())
    out_dir = tmp_path / "out"
    # from notebooks/, as Jupyter starts a notebook opened in a clone; the environment is the
    # suite's (conftest: CPU, the shared compilation cache)
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=os.path.dirname(NOTEBOOK),
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NOTEBOOK_OUT_DIR": str(out_dir)},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "1 cpu device(s)" in result.stdout
    val = read_log(out_dir, "val_loss")
    assert [it for it, _ in val] == [0, 100] and val[-1][1] < val[0][1] - 0.5, val  # it learned
    assert checkpoint.all_steps(str(out_dir)) == [100]
    samples = result.stdout.split(SEPARATOR)
    # two samples printed
    assert len(samples) == 3 and all(s.strip() for s in samples[:2]), result.stdout[-2000:]
    with open(out_dir / "loss.png", "rb") as f:
        assert f.read(8) == PNG_MAGIC


def first_cell(repo_url=None):
    """The first code cell, its REPO_URL form field set to `repo_url` (None: as shipped, empty)."""
    source = code_cells()[0][0]
    field = 'REPO_URL = ""  # @param {type:"string"}'  # a Colab form field
    assert field in source
    return source if repo_url is None else source.replace('""', repr(repo_url), 1)


@pytest.mark.parametrize(
    "repo_url",
    [None, "https://github.com/OWNER/nanogpt-jax", "https://github.com/<account>/nanogpt-jax"],
)
def test_opened_alone_with_no_repository_set_the_first_cell_stops_in_one_line(
    repo_url, tmp_path, monkeypatch
):
    """Outside a clone, REPO_URL empty or a placeholder: the one line a notebook shows (IPython
    renders the exception by its _render_traceback_) names what to set, and no git runs."""
    source, elsewhere = first_cell(repo_url), first_cell(str(tmp_path / "nowhere"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(Exception) as e:
        exec(source, {})
    assert e.value._render_traceback_() == [
        "SetUpError: set REPO_URL in the first code cell to this repository's git URL (e.g. "
        "https://github.com/<account>/nanogpt-jax), then run the cells again"
    ]
    assert os.listdir(tmp_path) == []  # nothing cloned
    # a URL git cannot clone: one line too, after git's own
    with pytest.raises(Exception) as e:
        exec(elsewhere, {})
    assert e.value._render_traceback_() == [
        f"SetUpError: git clone {tmp_path / 'nowhere'} failed (git says why above): check "
        "REPO_URL in the first code cell"
    ]


# one host's devices of each generation (docs/tpu.md, "Every generation"); 1 too: a single-chip
# runtime (v5e-1)
HOST_DEVICES = {"v2": 8, "v3": 8, "v4": 4, "v5e": 8, "v5p": 4, "v6e": 8, "tpu7x": 8}


@pytest.mark.parametrize(
    "platform, generation", [("tpu", g) for g in accelerators.TPUS] + [("gpu", None)]
)
def test_the_runs_the_cpu_does_not_take_are_valid_settings(
    platform, generation, tmp_path, monkeypatch
):
    """The parameters cell on a TPU of each generation and on a GPU: train.py's settings checks pass
    (every key a setting, of its type, in range), and the batch per device divides the recipe's
    tokens per step on one host."""
    monkeypatch.chdir(REPO)  # the config files' paths are the repository's
    ((source, _),) = code_cells("parameters")
    namespace = {"os": os, "PLATFORM": platform, "GENERATION": generation}
    exec(source, namespace)
    if platform == "tpu":
        assert set(namespace["BATCH_PER_DEVICE"]) == set(accelerators.TPUS), (
            "a batch for every generation"
        )
    c = configure(DEFAULTS, [*namespace["TRAIN"], f"--out_dir={tmp_path}"])
    validate(c)
    for devices in {1, HOST_DEVICES[generation]} if platform == "tpu" else {1}:
        accumulation_steps(c, devices)
    if platform == "tpu":
        assert (
            c["total_batch_size"] == 524288
            and c["max_iters"] == c["lr_decay_iters"] > c["warmup_iters"]
        )
