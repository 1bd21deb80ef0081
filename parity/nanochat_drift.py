"""
bf16's drift from float32 on each side of nanochat's training check (parity/check_nanochat_train.py
--drift --own CHECKOUT): the check's steps from the same weights on the same batches four ways,
ours in float32 and in bf16 (train.py's dtype='bfloat16': compute in bf16, params float32, Polar
Express in bf16) and nanochat's own code in float32 and in bf16 (NANOCHAT_DTYPE=bfloat16: its
Linears cast their weights to the activations' bf16, its embedding tables and rotary tables are
stored in bf16, Polar Express runs in bf16). nanochat fixes its dtype when it is imported, so its
bf16 run is a child process (the check run again with --bf16-child) that reads the start and
writes its losses and weights here. The reference (parity/nanochat_reference.py) has no bf16
path: nanochat's casts are spread over its forward, its init and its optimizer, and a copy of
them would be a second thing to prove; the drift is measured on ours and on nanochat's own code.
Not a module to run: check_nanochat_train runs it.
"""

import os
import subprocess
import sys

import numpy as np

from parity.common import print_table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
START, TRAINED = "start.npz", "trained.npz"


def trained(side, batches):
    """[(loss, state dict {nanochat's name: float32 numpy})] after each step of `side` (Ours or
    TorchSide, holding the start) on `batches`."""
    return [(side.step(x, y), side.state_dict()) for x, y in batches]


def save_trained(steps, folder):
    """The child's end: its steps (trained's list) written to folder/TRAINED."""
    arrays = {"loss": np.array([loss for loss, _ in steps], np.float64)}
    for it, (_, state) in enumerate(steps):
        arrays.update({f"{it}/{k}": v for k, v in state.items()})
    np.savez(os.path.join(folder, TRAINED), **arrays)


def load_start(folder):
    with np.load(os.path.join(folder, START)) as f:
        return dict(f)


def own_bf16(checkout, steps, seed, start, folder):
    """nanochat's own code in bf16 from `start` over the check's batches (steps, seed): the check
    run again in a child (--bf16-child: NANOCHAT_DTYPE=bfloat16 before nanochat is imported) ->
    trained's list."""
    np.savez(os.path.join(folder, START), **start)
    argv = ["--own", checkout, f"--steps={steps}", f"--seed={seed}", "--bf16-child", folder]
    cmd = [sys.executable, "-m", "parity.check_nanochat_train", *argv]
    subprocess.run(cmd, cwd=ROOT, check=True)
    with np.load(os.path.join(folder, TRAINED)) as f:
        losses, saved = f["loss"], dict(f)
    return [(float(loss), {k: saved[f"{it}/{k}"] for k in start}) for it, loss in enumerate(losses)]


# What each table compares: (the run, the run it is measured from)
PAIRS = (
    ("ours bf16", "ours float32"),
    ("torch bf16", "torch float32"),
    ("ours bf16", "torch bf16"),
)


def drifts(runs, compare):
    """{pair: [the check's Step per step]} for each of PAIRS over runs ({name: trained's list});
    compare: the check's, (loss, other loss, state, other state) -> Step."""
    return {
        pair: [compare(a[0], b[0], a[1], b[1]) for a, b in zip(runs[pair[0]], runs[pair[1]])]
        for pair in PAIRS
    }


def print_drifts(found):
    """One row a step: each pair's |dloss| and the check's three param measures."""
    rows = []
    for it in range(len(found[PAIRS[0]])):
        cells = [str(it)]
        for pair in PAIRS:
            s = found[pair][it]
            cells += [abs(s.loss - s.their_loss), s.max_rel[0], s.matrix[0], s.scalar[0]]
        rows.append(cells)
    headers = ["step"]
    for a, b in PAIRS:
        headers += [f"{a} vs {b}: |dloss|", "max|dp|/max|p|", "matrices", "scalars"]
    print_table(rows, headers)
    for pair in PAIRS:
        worst = {m: max(found[pair], key=lambda s: s[m][0])[m] for m in (2, 3, 4)}
        names = ", ".join(f"{d:.3g} {name}" for d, name in worst.values())
        print(f"{pair[0]} vs {pair[1]}, the worst param of each measure: {names}")
    print(
        "bf16: reported, no pass or fail: step by step the two sides' drifts cross each other by"
        " 4x and more either way (independent draws of rounding; docs/nanochat.md, bf16)"
    )
