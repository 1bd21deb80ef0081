"""python tools/mutation_report.py [--survivors] [--sample K MODULE]

After mutmut's run (make mutants).

The mutation score of each mutated module, from mutmut's records (mutants/<module>.py.meta): how
many of its mutants the tests killed (a test failed, or hung past mutmut's timeout), how many
survived (every test passed) and how many no test reached. Score: killed (timeouts included) over
the mutants checked. --survivors lists the survivors by name (`mutmut show NAME` prints the change).
--sample K MODULE prints the names of K of MODULE's mutants not checked yet, drawn at random with a
fixed seed, for `make mutants MUTANTS=...`: where every mutant would take hours, the score of a
random sample estimates the module's."""

import argparse
import glob
import json
import os
import random
import sys
from collections import Counter

from mutmut.stats import status_by_exit_code

KILLED = ("killed", "timeout", "caught by type check")


def statuses(meta_file):
    with open(meta_file) as f:
        return {
            name: status_by_exit_code[code]
            for name, code in json.load(f)["exit_code_by_key"].items()
        }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    p.add_argument("--survivors", action="store_true", help="list the survivors by name")
    p.add_argument(
        "--sample",
        nargs=2,
        metavar=("K", "MODULE"),
        help="print K names drawn at random from MODULE's mutants not checked yet "
        "(e.g. 50 model.py)",
    )
    p.add_argument("--seed", type=int, default=34, help="the draw's seed (default 34)")
    args = p.parse_args(argv)
    if args.sample and not args.sample[0].isdigit():
        p.error(
            "--sample K MODULE: K is how many mutants to draw, a whole number, got "
            f"{args.sample[0]!r}"
        )
    files = sorted(glob.glob(os.path.join("mutants", "**", "*.py.meta"), recursive=True))
    if not files:
        print("no mutmut records in mutants/: run make mutants first", file=sys.stderr)
        return 2
    if args.sample:
        return print_sample(int(args.sample[0]), args.sample[1], args.seed)
    print("| module | mutants | killed | timeout | survived | no test | not run | score |")
    print("|---|---|---|---|---|---|---|---|")
    survivors = []
    for meta in files:
        status = statuses(meta)
        n = Counter(status.values())
        checked = sum(v for k, v in n.items() if k != "not checked")
        killed = sum(n[k] for k in KILLED)
        score = f"{100 * killed / checked:.1f}%" if checked else "-"
        module = os.path.relpath(meta, "mutants").removesuffix(".meta")
        print(
            f"| {module} | {len(status)} | {n['killed']} | {n['timeout']} | {n['survived']} | "
            f"{n['no tests']} | {n['not checked']} | {score} |"
        )
        survivors += [name for name, s in status.items() if s == "survived"]
    if args.survivors:
        print("\n".join(["", "survived:", *survivors]))
    return 0


def print_sample(k, module, seed):
    meta = os.path.join("mutants", module + ".meta")
    if not os.path.exists(meta):
        print(
            f"no mutmut records for {module} in mutants/ (a module of [tool.mutmut], e.g. "
            "model.py)",
            file=sys.stderr,
        )
        return 2
    unchecked = sorted(name for name, s in statuses(meta).items() if s == "not checked")
    print(" ".join(random.Random(seed).sample(unchecked, min(k, len(unchecked)))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
