"""python -m pytest tests/test_help.py -q

`--help` and `-h` on every user script: exit 0, say what the script does and what it takes, write
nothing. The scripts configured by configurator.py (train.py, sample.py, eval.py, export.py) list
every setting as `--key=default` with its meaning, read from the comments beside the dict that
defines the settings (configurator.help_text); the argparse scripts have argparse's. The
data/*/prepare.py scripts, which write beside themselves, refuse any other argument with one error
line and exit 2 before they write. Each command is a subprocess started in an empty folder (any
file it wrote would be there: out_dir's default is relative), with the scripts' own fixture data
where they need it; none compiles anything.
"""

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from configurator import HelpRequested, configure, dict_node, help_text, setting_comments

REPO = Path(__file__).resolve().parent.parent
# copies of a script import the repository's modules; no .pyc written into it either
ENV = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONDONTWRITEBYTECODE": "1"}

# the configured scripts: (the file and the name of the dict that defines their settings, a few
# settings as the help shows them: `--key=default meaning`, whitespace aside)
CONFIGURED = {
    "train.py": (
        ("run/settings.py", "DEFAULTS"),
        [
            "I/O --out_dir=out a folder, or gs://bucket/run (docs/pods.md) --eval_interval=2000",
            "--eval_only=False if True, script exits right after the first eval",
            # a meaning on two comment lines above its key
            "--batch_size=12 micro-batch size per batch shard (a device, or a group of "
            "tensor_parallel devices)",
            "--learning_rate=0.0006 max learning rate",
            "system --dtype=auto 'float32' | 'bfloat16' | 'auto'",
            "--profile='' 'START:STOP'",
        ],
    ),
    "sample.py": (
        ("sample.py", "defaults"),
        [
            "--start='\\n'",
            "--temperature=0.8 1.0 = no change",
            "--top_k=200 retain only the top_k most likely tokens",
        ],
    ),
    "eval.py": (
        ("eval.py", "defaults"),
        ["--init_from=gpt2", "--num_fewshot=None None: each task's own", "--batch_size=8 requests"],
    ),
    "chat_cli.py": (
        ("chat_cli.py", "defaults"),
        ["--prompt='' one answer to this message, then exit", "--temperature=0.6 0: greedy"],
    ),
    "chat_web.py": (
        ("chat_web.py", "defaults"),
        ["--host=127.0.0.1 the address to serve on", "--port=8000"],
    ),
    "chat_eval.py": (
        ("chat_eval.py", "defaults"),
        ["--tasks_dir=data/chat", "--batch_size=8 problems a forward (the categorical tasks)"],
    ),
    "export.py": (
        ("export.py", "defaults"),
        ["--step=-1 the saved step to export; -1: the latest", "--format=hf 'hf' | 'nanogpt'"],
    ),
}
# the argparse scripts: a few of their options
ARGPARSE = {
    "fineweb.py": ["--shard_size"],
    "hellaswag.py": ["--init_from", "--split"],
    "plot.py": ["--baseline", "out_dir"],
    **{f"-m parity.{p.stem}": ["-h, --help"] for p in sorted(REPO.glob("parity/check_*.py"))},
}
PREPARE = sorted(p.parent.name for p in REPO.glob("data/*/prepare.py"))


def run(script, *args, cwd):
    """`python SCRIPT ARGS` (SCRIPT: a file, the repository's where relative, or -m MODULE) in the
    folder `cwd`."""
    script = str(script)
    target = script.split() if script.startswith("-m ") else [str(REPO / script)]
    return subprocess.run(
        [sys.executable, *target, *args], cwd=cwd, env=ENV, capture_output=True, text=True
    )


def flat(text):
    return " ".join(text.split())


def purpose(path):
    """The first line of a script's docstring: what its help says first."""
    return flat(ast.get_docstring(ast.parse(path.read_text())).split("\n")[0])


def files(folder):
    """Every file under `folder`: its bytes and its modification time."""
    return {
        p.relative_to(folder).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in folder.rglob("*")
        if p.is_file()
    }


# a process per script, with one of the two flags: the configured scripts -h (train.py took it for
# a config file), the others --help; both reach the same code (configure's test below, argparse's).
# make test runs train.py's and sample.py's, make test-slow (CI runs it) every other script's
FLAGS = [
    pytest.param(s, f, marks=() if s in ("train.py", "sample.py") else pytest.mark.slow)
    for s, f in [*((s, "-h") for s in CONFIGURED), *((s, "--help") for s in ARGPARSE)]
]


@pytest.mark.parametrize("script, flag", FLAGS)
def test_help_says_what_the_script_does_and_takes_and_writes_nothing(script, flag, tmp_path):
    r = run(script, flag, cwd=tmp_path)
    assert (r.returncode, r.stderr) == (0, ""), r.stderr
    out = flat(r.stdout)
    path = REPO / (script[3:].replace(".", "/") + ".py" if script.startswith("-m ") else script)
    assert purpose(path) in out
    if script in CONFIGURED:
        (source, name), shown = CONFIGURED[script]
        for key in (k.arg for k in dict_node((REPO / source).read_text(), name).keywords):
            assert f"--{key}=" in out, key
    else:
        shown = ARGPARSE[script]
    for text in shown:
        assert flat(text) in out, text
    assert list(tmp_path.iterdir()) == []


def prepare_copy(tmp_path, name):
    """data/<name>/prepare.py copied to tmp_path/data/<name>/, beside a small input.txt and the
    train.bin and val.bin of an earlier run: what it would write is there, not in the repository."""
    folder = tmp_path / "data" / name
    folder.mkdir(parents=True)
    shutil.copy(REPO / "data" / name / "prepare.py", folder)
    (folder / "input.txt").write_text("First Citizen:\nBefore we proceed any further, hear me.\n")
    for split in ("train", "val"):
        (folder / f"{split}.bin").write_bytes(b"an earlier run's " + split.encode())
    return folder / "prepare.py"


@pytest.mark.parametrize("name", PREPARE)
def test_a_prepare_scripts_help_writes_nothing(name, tmp_path):
    script = prepare_copy(tmp_path, name)
    before = files(tmp_path)
    r = run(script, "--help", cwd=tmp_path)
    assert (r.returncode, r.stderr) == (0, ""), r.stderr
    assert purpose(script) in flat(r.stdout)
    assert files(tmp_path) == before


@pytest.mark.parametrize("name", PREPARE)
def test_a_prepare_script_refuses_an_unknown_argument_before_it_writes(name, tmp_path):
    script = prepare_copy(tmp_path, name)
    before = files(tmp_path)
    r = run(script, "--no_such_option=1", cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "--no_such_option=1" in errors[0], r.stderr
    assert files(tmp_path) == before


# a settings dict written as the scripts write theirs, which help_text reads back from this file
EXAMPLE = dict(
    # I/O
    out_dir="out",  # where the run goes
    # a meaning on the comment lines right above its key, wrapped at 100 columns, where the
    # formatter wraps them
    eval_interval=2000,
    seed=1337,
    # wandb logging
    # the key's own comment, after its section's
    wandb_log=False,
    tag="a # in a string",
    start="\n",
    profile="",
    top_k=None,
)


def test_the_comments_beside_each_setting_are_its_meaning_and_headings():
    assert setting_comments(Path(__file__).read_text(), "EXAMPLE") == {
        "out_dir": (["I/O"], "where the run goes"),
        "eval_interval": (
            [],
            "a meaning on the comment lines right above its key, wrapped at 100 columns, where the "
            "formatter wraps them",
        ),
        "seed": ([], ""),
        "wandb_log": (["wandb logging"], "the key's own comment, after its section's"),
        "tag": ([], ""),
        "start": ([], ""),
        "profile": ([], ""),
        "top_k": ([], ""),
    }
    lines = help_text(EXAMPLE).splitlines()
    assert lines[lines.index("I/O") + 1].split() == ["--out_dir=out", *"where the run goes".split()]
    assert "  --seed=1337" in lines  # no comment: listed with its default
    # each default as one types it: a word bare, anything else as literal_eval reads it
    assert {"  --tag='a # in a string'", "  --start='\\n'", "  --profile=''"} <= set(lines)
    assert "  --top_k=None" in lines


def test_help_is_asked_by_h_or_help_anywhere_in_argv_before_any_file_is_read():
    for argv in (["--help"], ["-h"], ["no_such_config.py", "--no_such_key=1", "-h"]):
        with pytest.raises(HelpRequested) as e:
            configure(EXAMPLE, argv)
        assert e.value.defaults is EXAMPLE
    # a value that reads --help is a value
    assert configure(EXAMPLE, ["--out_dir=--help"])["out_dir"] == "--help"
