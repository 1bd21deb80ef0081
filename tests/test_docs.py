"""python -m pytest tests/test_docs.py -q

Docs that cannot rot: in README.md and docs/*.md every relative link resolves (anchors too), the
markdown read as GitHub renders it (helpers/markdown.py; the commands it finds are checked by
test_docs_commands.py); docs/files.md names every Python file.
"""

import fnmatch
import re
import subprocess

import pytest
from helpers.markdown import (
    DOCS,
    ROOT,
    check_links,
    inline_code,
    markdown_parts,
    python_commands,
    slug,
)

# -- the tests
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(doc):
    assert check_links(doc.read_text(), doc) == []


def test_the_checker_finds_a_broken_link_and_a_missing_anchor():
    where = ROOT / "README.md"
    md = (
        "See [the TPU page](docs/tpu.md), [nowhere](docs/no_such_page.md), [a bad "
        "anchor](docs/tpu.md#no-such-heading), [a good one](docs/tpu.md#every-generation), "
        "[here](#quick-start) and [out](https://example.com).\n\n## Quick start\n\n`[not a "
        "link](nowhere.md)` in code is not checked.\n"
    )
    problems = check_links(md, where)
    assert len(problems) == 2
    assert (
        "docs/no_such_page.md does not exist" in problems[0]
        and "no heading #no-such-heading" in problems[1]
    )


def test_the_markdown_reading():
    blocks, prose = markdown_parts(
        "a `x`\n\n    python a.py\n    --b\n\n```python\npython c.py\n```\n`d\ne`\n"
    )
    assert blocks == ["python a.py\n--b\n"] and inline_code(prose) == ["x", "d e"]
    assert (
        slug("The 124M recipe (`config/train_gpt2.py`: 64 × 1024)")
        == "the-124m-recipe-configtrain_gpt2py-64--1024"
    )
    line = 'gcloud --command="cd x && .venv/bin/python train.py --a=1" && srun python -m m.n --b 2'
    assert python_commands(line) == [("train.py", ["--a=1"]), ("-m m.n", ["--b", "2"])]


# how the project got here, which docs/notes/ keeps: a session's runs as they went, notes to whoever
# comes next, an audit's rows
DEVELOPMENT_LOG = re.compile(r"\b(sessions?|next time|whoever next|audit)\b", re.IGNORECASE)


def development_log(text):
    return [line for line in text.splitlines() if DEVELOPMENT_LOG.search(line)]


def test_user_pages_say_what_is_true_now():
    """README and the user pages keep the latest figure with its machine, date and command; the
    runs as they went, notes to the next engineer and audits live in docs/notes/."""
    pages = [doc for doc in DOCS if "notes" not in doc.relative_to(ROOT).parts]
    assert len(pages) > 10
    found = {doc.name: development_log(doc.read_text()) for doc in pages}
    assert {name: lines for name, lines in found.items() if lines} == {}
    assert development_log("The next GPU session should run it.\nA figure.\nnext time, less") == [
        "The next GPU session should run it.",
        "next time, less",
    ]


def names_file(name, path):
    """Does `name` (in backticks in docs/files.md) name the file at `path`: its path or a pattern of
    it, or, for a file in a folder, its name, its stem or a pattern of its name?"""
    folder, _, base = path.rpartition("/")
    return (
        fnmatch.fnmatch(path, name)
        or bool(folder)
        and (fnmatch.fnmatch(base, name) or name == base.removesuffix(".py"))
    )


def test_files_md_names_every_python_file():
    """docs/files.md is the map of the house: every Python file outside tests/ is named there."""
    named = re.findall(r"`([^`\s]+)`", (ROOT / "docs" / "files.md").read_text())
    tracked = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    unnamed = [
        path
        for path in tracked
        if not path.startswith("tests/")
        and not path.endswith("__init__.py")
        and not any(names_file(name, path) for name in named)
    ]
    assert not unnamed, f"docs/files.md does not name {unnamed}"
    assert not names_file("model", "model.py") and names_file(
        "eval_gpt2*.py", "config/eval_gpt2.py"
    )
