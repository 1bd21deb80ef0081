"""python -m pytest -q -m slow tests/test_readme_commands.py

The README's "nanoGPT user contract" runs as shown on a CPU: each command of its block, read from
README.md, in a fresh folder beside a copy of the corpus, made tiny (fewer iterations and samples,
appended as the last --key=value, which wins) and offline (OpenAI's weights and the downloads
replaced by a tiny random GPT-2 directory and local files). Their full sizes' times on a 2-core CPU:
docs/training.md#on-a-cpu. Marked slow (about two minutes: a dozen processes)."""

import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest
from helpers import HELLASWAG_FIXTURE, REPO

from parity.common import save_random_hf_model

SECTION = "## The nanoGPT user contract"

# each command (by its start) made tiny: what is appended, or {placeholder: what replaces it}
TINY = [
    (
        "python train.py config/train_shakespeare_char.py config/cpu.py --init_from=resume",
        ["--max_iters=6"],
    ),
    ("python train.py", ["--max_iters=4", "--eval_interval=2", "--eval_iters=2"]),
    ("python sample.py", ["--num_samples=1", "--max_new_tokens=8"]),
    ("python hellaswag.py", [f"--path={HELLASWAG_FIXTURE}", "--limit=2"]),
    # lm-eval's arc_easy and piqa are downloads: one of the project's local tasks instead
    ("python eval.py", ["--include_path=eval_tasks", "--tasks=shakespeare_rolling", "--limit=2"]),
]


def contract_commands():
    """The shell block under the README's contract heading: its commands, comments cut."""
    text = open(os.path.join(REPO, "README.md")).read()
    block = re.search(r"```sh\n(.*?)```", text[text.index(SECTION) :], re.S)[1]
    lines = block.replace("\\\n", " ").splitlines()
    return [shlex.split(line, comments=True) for line in lines if line.strip()]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A folder holding what a clone holds at the commands' paths: the scripts, the packages (the
    library's rooms, parity/), config/ and the corpus (a copy: prepare.py writes beside itself),
    and the tiny GPT-2 that stands for OpenAI's."""
    root = tmp_path_factory.mktemp("clone")
    for name in os.listdir(REPO):
        package = os.path.isfile(os.path.join(REPO, name, "__init__.py"))
        if name.endswith(".py") or package or name in ("config", "assets", "eval_tasks"):
            os.symlink(os.path.join(REPO, name), root / name)
    data = root / "data" / "shakespeare_char"
    data.mkdir(parents=True)
    for f in ("prepare.py", "input.txt"):
        shutil.copy(os.path.join(REPO, "data", "shakespeare_char", f), data / f)
    gpt2 = root / "gpt2-tiny"
    save_random_hf_model(gpt2, seed=0, n_layer=2, n_head=2, n_embd=64, n_positions=64)
    return root


@pytest.mark.slow
def test_the_contracts_commands_run_on_a_cpu_made_tiny(workspace):
    commands = contract_commands()
    assert len(commands) >= 10
    for argv in commands:
        assert argv[0] == "python", argv
        argv = [
            sys.executable,
            *("--init_from=./gpt2-tiny" if a == "--init_from=gpt2" else a for a in argv[1:]),
        ]
        shown = "python " + " ".join(argv[1:])
        extra = next((extra for start, extra in TINY if shown.startswith(start)), [])
        if "--help" not in argv:
            argv = [a for a in argv if not (extra and a.startswith("--tasks="))] + extra
        r = subprocess.run(argv, cwd=workspace, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, (argv, r.stdout[-2000:], r.stderr[-3000:])
