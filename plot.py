"""
Plot a run's losses (and HellaSwag accuracy, once logged) from out_dir/log.jsonl, with GPT-2 (124M)
reference lines.

    python plot.py out-gpt2                          # -> out-gpt2/loss.png
    python plot.py out-shakespeare-char --out shakespeare.png --ymax 3
    python plot.py out-owt --baseline owt

log.jsonl, one JSON object per line (train.py writes it):
    training   {"iter", "loss", "lr", "ms", ...}
    eval       {"iter", "train_loss", "val_loss"}
    HellaSwag  {"iter", "hellaswag_acc_norm", "hellaswag_acc"}
A "dataset" value on any line (or in a "config" object) picks the reference lines when --baseline is
auto. An iter logged twice (a run resumed from an earlier checkpoint) keeps its latest value.
"""

import argparse
import json
import os

from configurator import InputNotFound, UsageError, exit_on_bad_input, require_extras
from dataio import storage

# Reference lines, OpenAI's GPT-2 (124M) checkpoint evaluated on the same data as the run:
BASELINES = {
    # build-nanogpt: FineWeb-Edu val loss and HellaSwag acc_norm
    "fineweb": {"val_loss": 3.2924, "hellaswag_acc_norm": 0.2945},
    # nanoGPT's README: train / val loss on OpenWebText
    "owt": {"train_loss": 3.11, "val_loss": 3.12},
    "none": {},
}


def read_log(path):
    """Series {key: {iter: value}} for loss, train_loss, val_loss, hellaswag_acc_norm; plus the
    dataset if given."""
    if not storage.isfile(path):
        raise InputNotFound(f"no training log at {path} (train.py writes out_dir/log.jsonl)")
    series = {k: {} for k in ("loss", "train_loss", "val_loss", "hellaswag_acc_norm")}
    dataset = None
    lines = storage.read_bytes(path).decode().splitlines()
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if lineno == len(lines):  # the line train.py is writing right now
                continue
            raise UsageError(f"{path}:{lineno}: not JSON") from None
        if not isinstance(rec, dict):
            raise UsageError(f"{path}:{lineno}: not a JSON object")
        config = rec.get("config") if isinstance(rec.get("config"), dict) else {}
        dataset = rec.get("dataset", config.get("dataset", dataset))
        if "iter" not in rec:
            continue
        for key, points in series.items():
            if rec.get(key) is not None:
                points[int(rec["iter"])] = float(rec[key])
    if not (series["loss"] or series["val_loss"] or series["train_loss"]):
        raise UsageError(
            f"{path} has no training or eval lines (iter with loss, train_loss or val_loss)"
        )
    return {k: dict(sorted(v.items())) for k, v in series.items()}, dataset


def choose_baseline(series, dataset):
    """auto: fineweb if HellaSwag was logged or the dataset is FineWeb, owt for OpenWebText, else
    none."""
    name = str(dataset or "").lower()
    if series["hellaswag_acc_norm"] or "fineweb" in name:
        return "fineweb"
    return "owt" if "openwebtext" in name else "none"


def plot(series, baseline, out, title, ymax=None):
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    ref = BASELINES[baseline]
    hella = series["hellaswag_acc_norm"]
    fig, axes = plt.subplots(1, 2 if hella else 1, figsize=(14 if hella else 8, 5), squeeze=False)
    ax = axes[0, 0]
    if series["loss"]:
        ax.plot(
            list(series["loss"]),
            list(series["loss"].values()),
            lw=0.8,
            alpha=0.5,
            label="train loss",
        )
    if series["train_loss"]:
        ax.plot(
            list(series["train_loss"]),
            list(series["train_loss"].values()),
            "o-",
            ms=3,
            label="train loss (eval)",
        )
    if series["val_loss"]:
        ax.plot(
            list(series["val_loss"]),
            list(series["val_loss"].values()),
            "o-",
            ms=3,
            label="val loss",
        )
    for key, color in (("train_loss", "tab:gray"), ("val_loss", "tab:red")):
        if key in ref:
            ax.axhline(
                ref[key],
                color=color,
                ls="--",
                lw=1,
                label=f"OpenAI GPT-2 (124M) {key.split('_')[0]} {ref[key]}",
            )
    ax.set(xlabel="iter", ylabel="loss", title=f"{title}: loss")
    if ymax is not None:
        ax.set_ylim(top=ymax)
    ax.grid(alpha=0.3)
    ax.legend()
    if hella:
        ax = axes[0, 1]
        ax.plot(list(hella), list(hella.values()), "o-", ms=3, color="tab:green", label="acc_norm")
        if "hellaswag_acc_norm" in ref:
            ax.axhline(
                ref["hellaswag_acc_norm"],
                color="tab:red",
                ls="--",
                lw=1,
                label=f"OpenAI GPT-2 (124M) {ref['hellaswag_acc_norm']}",
            )
        ax.set(xlabel="iter", ylabel="accuracy", title=f"{title}: HellaSwag")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv=None):
    title, usage = __doc__.strip().split("\n\n", 1)
    p = argparse.ArgumentParser(
        description=title, epilog=usage, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("out_dir", help="the run's out_dir, holding log.jsonl")
    p.add_argument(
        "--baseline",
        default="auto",
        choices=["auto", *BASELINES],
        help="reference lines: fineweb (FineWeb-Edu val, HellaSwag), owt (OpenWebText), none",
    )
    p.add_argument(
        "--out",
        default=None,
        help="PNG path (default: out_dir/loss.png; ./loss.png for a gs:// out_dir)",
    )
    p.add_argument(
        "--ymax", type=float, default=None, help="top of the loss axis (default: fit the data)"
    )
    args = p.parse_args(argv)
    require_extras("plot")

    series, dataset = read_log(storage.join(args.out_dir, "log.jsonl"))
    baseline = choose_baseline(series, dataset) if args.baseline == "auto" else args.baseline
    # a run on gs:// is plotted here, in the current directory
    out = args.out or (
        "loss.png" if storage.is_url(args.out_dir) else os.path.join(args.out_dir, "loss.png")
    )
    plot(series, baseline, out, os.path.basename(os.path.normpath(args.out_dir)), args.ymax)
    summary = [f"{len(series['loss'])} train points"]
    if series["val_loss"]:
        it, v = min(series["val_loss"].items(), key=lambda kv: kv[1])
        summary.append(f"best val loss {v:.4f} at iter {it}")
    if series["hellaswag_acc_norm"]:
        it, v = max(series["hellaswag_acc_norm"].items(), key=lambda kv: kv[1])
        summary.append(f"best HellaSwag acc_norm {v:.4f} at iter {it}")
    print(f"wrote {out} ({', '.join(summary)}; baseline: {baseline})")
    return 0


if __name__ == "__main__":
    exit_on_bad_input(main)
