"""python -m pytest tests/test_install.py -q

The install (pyproject.toml, constraints.txt, docs/install.md): every declared dependency has a pin
that satisfies it, every package of this venv is pinned at its version, the core job (train, then
sample) runs with every optional group's modules gone, and a script without its group says in one
line which to install."""

import importlib.metadata
import os
import re
import subprocess
import sys
import tomllib

import pytest
from helpers import REPO, TINY, one_line_error
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from configurator import EXTRAS

# packages of every venv that no group declares; the project itself is installed editable
NOT_PINNED = {"pip", "setuptools", "wheel", "nanogpt-jax"}
OPTIONAL = sorted({m for modules in EXTRAS.values() for m in modules})


def pins():
    """{name: version} of constraints.txt, whose every line (but comments) is name==version, each
    name once."""
    found = {}
    with open(os.path.join(REPO, "constraints.txt")) as f:
        for line in f.read().splitlines():
            if line.startswith("#"):
                continue
            m = re.fullmatch(r"([A-Za-z0-9._-]+)==([0-9][A-Za-z0-9.!+_-]*)", line)
            assert m, f"constraints.txt: {line!r} is not name==version"
            name = canonicalize_name(m[1])
            assert name not in found, f"constraints.txt pins {name} twice"
            found[name] = m[2]
    return found


def declared():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    groups = {"core": project["dependencies"], **project["optional-dependencies"]}
    return {group: [Requirement(r) for r in reqs] for group, reqs in groups.items()}


def test_every_declared_dependency_has_a_pin_that_satisfies_it():
    pinned, groups = pins(), declared()
    assert set(groups) == {"core", *EXTRAS, "tpu", "cuda", "test", "gpu-compile", "mutants"}
    for group, reqs in groups.items():
        for req in reqs:
            name = canonicalize_name(req.name)
            if name == "nanogpt-jax":  # a group of groups
                assert req.extras <= set(groups), (
                    f"{group}: {req} names a group pyproject.toml lacks"
                )
                continue
            assert name in pinned, f"{group}: {req} has no pin in constraints.txt (make lock)"
            assert req.specifier.contains(Version(pinned[name]), prereleases=True), (
                f"{group}: {req} is not satisfied by constraints.txt's {name}=={pinned[name]} "
                "(make lock)"
            )
    # the suite's venv has every group but cuda; the GPU's has what jax[cuda12] installs, less some
    # libraries
    assert {e for r in groups["test"] for e in r.extras} == set(groups) - {
        "core",
        "cuda",
        "test",
        "gpu-compile",
        "mutants",
    }


def test_every_installed_package_is_pinned_at_its_version():
    """What make test installed (this venv) is constraints.txt's, to the version: nothing resolved
    on the day."""
    pinned = pins()
    for dist in importlib.metadata.distributions():
        name = canonicalize_name(dist.metadata["Name"])
        if name in NOT_PINNED:
            continue
        assert name in pinned, (
            f"{name} {dist.version} is installed but not pinned in constraints.txt (make lock)"
        )
        assert Version(dist.version).public == Version(pinned[name]).public, (
            f"{name} {dist.version} is installed, constraints.txt pins {pinned[name]}"
        )


def without(modules, script, args, env=None, **kw):
    """`script` (a file, or -m MODULE) run as a command in a python where `modules` are not
    installed."""
    runner = (
        f"import runpy, sys\nfor name in {modules!r}:\n    sys.modules[name] = None  # import "
        f"fails as for a missing package\nsys.argv = [{script!r}, *{args!r}]\n"
    )
    if script.endswith(".py"):
        runner += f"runpy.run_path({script!r}, run_name='__main__')\n"
    else:
        runner += f"runpy.run_module({script!r}, run_name='__main__', alter_sys=True)\n"
    return subprocess.run(
        [sys.executable, "-c", runner],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
        **kw,
    )


@pytest.mark.slow
def test_the_core_job_needs_no_optional_group(dataset, tmp_path):
    """make shakespeare's job, train then sample, with torch, transformers, lm_eval, datasets,
    matplotlib and gcsfs gone."""
    out = str(tmp_path / "out")
    r = without(OPTIONAL, "train.py", [*TINY, f"--dataset={dataset}", f"--out_dir={out}"])
    assert r.returncode == 0, r.stderr[-3000:]
    r = without(
        OPTIONAL,
        "sample.py",
        [f"--out_dir={out}", "--start=A", "--num_samples=1", "--max_new_tokens=20"],
    )
    assert r.returncode == 0 and "---------------" in r.stdout, r.stderr[-3000:]


# make test-slow (CI runs it): the scripts whose refusal comes after seconds of imports
SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "script, args, modules, group",
    [
        pytest.param("parity.check_logits", [], ["torch"], "parity", marks=SLOW),
        ("parity.check_train", [], ["transformers"], "parity"),
        pytest.param("parity.check_generate", [], ["torch"], "parity", marks=SLOW),
        pytest.param("parity.check_hellaswag", [], ["torch"], "parity", marks=SLOW),
        pytest.param("parity.check_speedrun", [], ["torch"], "parity", marks=SLOW),
        ("parity.check_eval", [], ["lm_eval"], "eval"),
        pytest.param("eval.py", ["--tasks=hellaswag"], ["lm_eval"], "eval", marks=SLOW),
        ("fineweb.py", [], ["datasets"], "data"),
        pytest.param("plot.py", ["out"], ["matplotlib"], "plot", marks=SLOW),
        ("train.py", ["--out_dir=gs://bucket/run"], ["gcsfs"], "gcs"),
        # a nanoGPT ckpt.pt: torch reads it
        pytest.param("sample.py", ["--init_from={tmp}/ckpt.pt"], ["torch"], "parity", marks=SLOW),
    ],
)
def test_a_script_without_its_group_says_which_to_install(script, args, modules, group, tmp_path):
    (tmp_path / "ckpt.pt").write_bytes(b"")
    r = without(modules, script, [a.format(tmp=tmp_path) for a in args])
    err = one_line_error(r, 2)
    name = os.path.basename(script if script.endswith(".py") else script.replace(".", "/") + ".py")
    assert err == (
        f"error: {name} needs the {group} extras (no module named {modules[0]!r}): "
        f"pip install -c constraints.txt -e '.[{group}]'"
    )
