"""python tools/plant_bugs.py [BUG ...]

Does the suite catch the bugs it claims to (issue 34)? Each bug below is planted alone, by an exact
text substitution, in a copy of the repository (the files git tracks and those it does not ignore;
the venv used where it is), and the tests that should catch it run there with pytest. First the same
tests run on the copy as it is: they must pass, or a failure under a bug would prove nothing. Prints
a table (bug, tests run, caught: pytest failed, by which tests, seconds) and exits 1 if any bug is
not caught. BUG: names from the table (default: all). Not a test module: pytest does not collect
it."""

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = os.path.join(REPO, ".venv", "bin", "python")

# name: (what it is, file, [(old text, new text)] applied in order, each old text found exactly
# once; tests to run)
BUGS = {
    "sampling-raw-logits": (
        "compute/generate.py samples from the raw logits (temperature, top_k, top_p ignored)",
        "compute/generate.py",
        [
            (
                "jax.random.fold_in(key, i), filter_logits(logits, temperature, top_k, top_p)",
                "jax.random.fold_in(key, i), logits",
            )
        ],
        ["tests/test_generate.py"],
    ),
    "finetune-from-random": (
        "train.py passes weights=None to init_state (a finetune starts from random weights)",
        "train.py",
        [("weights=pretrained,", "weights=None,")],
        ["tests/test_promises.py"],
    ),
    "layernorm-bf16": (
        "LayerNorm computed in bf16 (its input rounded to the compute dtype)",
        "model.py",
        [
            (
                "        dtype=jnp.float32,\n        rngs=rngs,",
                "        dtype=config.compute_dtype,\n        rngs=rngs,",
            )
        ],
        ["tests/test_numerics.py"],
    ),
    "residual-bf16": (
        "the residual stream held in bf16",
        "model.py",
        [
            (
                "x = self.embed(idx, jnp.arange(idx.shape[1]))  # (B, T, C), float32",
                "x = self.embed(idx, jnp.arange(idx.shape[1])).astype(self.config.compute_dtype)  "
                "# (B, T, C)",
            )
        ],
        ["tests/test_numerics.py"],
    ),
    "weight-map-swap": (
        "two rows of weights.WEIGHT_MAP swapped (ln_1.weight <-> ln_2.weight)",
        "dataio/weights.py",
        [
            (
                '("transformer.h.{i}.ln_1.weight", "h.{i}.ln_1.scale", False)',
                '("transformer.h.{i}.ln_1.weight", "h.{i}.ln_2.scale", False)',
            ),
            (
                '("transformer.h.{i}.ln_2.weight", "h.{i}.ln_2.scale", False)',
                '("transformer.h.{i}.ln_2.weight", "h.{i}.ln_1.scale", False)',
            ),
        ],
        [
            "tests/test_logits.py::test_logit_parity_random_checkpoints",
            "tests/test_weights.py",
            "tests/test_export.py",
        ],
    ),
}


def copy_repository(to):
    """The working tree's files that git tracks or does not ignore (uncommitted edits included),
    copied to `to`."""
    files = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=REPO,
            check=True,
            capture_output=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for f in filter(None, files):
        src = os.path.join(REPO, f)
        if os.path.lexists(src):  # a tracked file deleted in the working tree is not copied
            os.makedirs(os.path.dirname(os.path.join(to, f)), exist_ok=True)
            shutil.copy2(src, os.path.join(to, f), follow_symlinks=False)


def plant(path, substitutions):
    with open(path) as f:
        text = f.read()
    for old, new in substitutions:
        found = text.count(old)
        assert found == 1, (
            f"{os.path.basename(path)}: the text to replace is found {found} times, not once: "
            f"{old!r}"
        )
        text = text.replace(old, new)
    with open(path, "w") as f:
        f.write(text)


def pytest(copy, tests):
    """(pytest's exit code, the tests that failed, seconds) of `tests` in the copy."""
    # JAX's compilation cache shared with the repository's suite: its keys are the programs (a bug
    # compiles its own)
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": os.path.join(REPO, ".pytest_cache", "jax")}
    start = time.time()
    r = subprocess.run(
        # slow ones too: a bug's catcher may be a heavier test that make test leaves out
        [PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu_compile", *tests],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
    )
    failed = re.findall(r"^(?:FAILED|ERROR) (.+?)(?: - .*)?$", r.stdout, re.M)
    return r.returncode, failed, time.time() - start, r.stdout


def short(tests):
    """Test ids without tests/ and parameters, each once, with how many of its cases:
    'test_model.py::test_x (3)'."""
    counts = {}
    for t in tests:
        name = re.sub(r"\[.*\]$", "", t.removeprefix("tests/"))
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(name if n == 1 else f"{name} ({n})" for name, n in counts.items())


def main(names):
    unknown = [n for n in names if n not in BUGS]
    if unknown:
        print(
            f"error: unknown bug {', '.join(unknown)}: choose from {', '.join(BUGS)}",
            file=sys.stderr,
        )
        return 2
    bugs = {n: BUGS[n] for n in names or BUGS}
    rows, ok = [], True
    with tempfile.TemporaryDirectory(prefix="plant_bugs-") as copy:
        copy_repository(copy)
        tests = sorted({t for *_, ts in bugs.values() for t in ts})
        code, failed, seconds, out = pytest(copy, tests)
        rows.append(
            [
                "(none)",
                short(tests),
                "passed" if code == 0 else f"FAILED (exit {code})",
                f"{seconds:.0f}",
            ]
        )
        notes = [f"(none): the tests on the copy as it is{': ' + short(failed) if failed else ''}"]
        if code != 0:
            print(out[-3000:])
            ok = False
        for name, (what, file, substitutions, tests) in bugs.items():
            path = os.path.join(copy, file)
            with open(path) as f:
                original = f.read()
            plant(path, substitutions)
            try:
                code, failed, seconds, _ = pytest(copy, tests)
            finally:
                with open(path, "w") as f:
                    f.write(original)
            ok &= code == 1
            rows.append(
                [
                    name,
                    short(tests),
                    {0: "NO", 1: "yes"}.get(code, f"error (pytest exit {code})"),
                    f"{seconds:.0f}",
                ]
            )
            notes.append(f"{name}: {what}" + (f"; caught by {short(failed)}" if code == 1 else ""))
    headers = ["bug", "tests run", "caught", "seconds"]
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]
    for j, r in enumerate([headers, *rows]):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if j == 0:
            print("  ".join("-" * w for w in widths))
    print()
    print("\n".join(notes))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
