"""python tools/mutation_run.py NAMES_FILE [--jobs 2] [--root mutants] [--logs DIR] \\
    [--preload M,...] -- PYTEST_ARGS

Runs each mutant named in NAMES_FILE (mutmut's names, one per line) as `MUTANT_UNDER_TEST=NAME
pytest -x PYTEST_ARGS` in mutmut's copy of the repository (mutants/, made by any `make mutants`
run), and prints `killed NAME`, `SURVIVED NAME`, `timeout NAME` or `ERROR NAME` (the tests could not
run: see its log) with its seconds. For the functions every test reaches, where `make mutants` runs
each survivor through all the tests that reach it: you choose the tests, the fastest killers first.
Each mutant's tests run in a fork of a process that has imported the libraries (not our modules:
their import-time calls must see the mutant), which saves the 5 s of imports a new process pays per
mutant; --jobs runs that many such processes."""

import argparse
import importlib
import os
import signal
import sys
import time

PRELOAD = "numpy,jax,jax.numpy,flax.nnx,optax,torch,transformers"


def run(names, root, logs, preload, pytest_args, out):
    os.chdir(root)
    sys.path.insert(0, root)
    for module in preload:
        try:
            importlib.import_module(module)
        except ImportError:
            pass
    import pytest

    for name in names:
        t0 = time.time()
        pid = os.fork()
        if pid == 0:
            os.environ["MUTANT_UNDER_TEST"] = name
            fd = os.open(os.path.join(logs, name + ".log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            signal.alarm(900)  # a hung test kills the mutant, as mutmut's timeout does
            code = pytest.main(
                ["-q", "-x", "-p", "no:xdist", "-p", "no:cacheprovider", *pytest_args]
            )
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(int(code))
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        # mutmut's reading of pytest's exit codes: 1 (a test failed) and 3 (pytest's internal error)
        # kill. 2 (a test module that does not import) or 5 (no tests) say nothing of the mutant: a
        # copy missing a module, a typo
        verdict = {0: "SURVIVED", 1: "killed", 3: "killed", -signal.SIGALRM: "timeout"}.get(
            code, "ERROR"
        )
        detail = f" (pytest exit {code}: see its log)" if verdict == "ERROR" else ""
        # one write: the jobs share the output
        out.write(f"{verdict} {name} {time.time() - t0:.0f}s{detail}\n")
        out.flush()


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ours, pytest_args = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    p.add_argument("names_file")
    p.add_argument("--jobs", type=int, default=1, help="processes, each taking every jobs-th name")
    p.add_argument("--root", default="mutants", help="mutmut's copy of the repository")
    p.add_argument("--logs", default="mutant-logs", help="each mutant's pytest output, NAME.log")
    p.add_argument(
        "--preload",
        default=PRELOAD,
        help="the libraries imported before the forks, comma-separated",
    )
    args = p.parse_args(ours)
    names = open(args.names_file).read().split()
    root, logs = os.path.abspath(args.root), os.path.abspath(args.logs)
    os.makedirs(logs, exist_ok=True)
    children = []
    for job in range(args.jobs):
        pid = os.fork()
        if pid == 0:
            run(
                names[job :: args.jobs],
                root,
                logs,
                args.preload.split(","),
                pytest_args,
                sys.stdout,
            )
            os._exit(0)
        children.append(pid)
    for pid in children:
        os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
