"""python -m pytest tests/test_plot.py -q

plot.py on synthetic out_dir/log.jsonl files: a PNG comes out, baselines are chosen as documented,
errors are clear.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import plot

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_log(out_dir, hellaswag=True, dataset=None, tail=""):
    """A synthetic run: a training line every iter, eval every 10, HellaSwag every 20; resumed once
    at iter 40 (iters 40..49 logged twice, the second time lower)."""
    os.makedirs(out_dir, exist_ok=True)
    lines = [{"config": {"dataset": dataset}}] if dataset else []
    iters = list(range(50)) + list(range(40, 100))
    for n, it in enumerate(iters):
        loss = 3.0 + 8.0 * np.exp(-it / 15) - (0.5 if n >= 50 else 0.0)
        lines.append({"iter": it, "loss": loss, "lr": 6e-4, "ms": 120.0})
        if it % 10 == 0:
            lines.append({"iter": it, "train_loss": loss, "val_loss": loss + 0.05})
        if hellaswag and it % 20 == 0:
            lines.append(
                {
                    "iter": it,
                    "hellaswag_acc_norm": 0.25 + it / 1000,
                    "hellaswag_acc": 0.25 + it / 2000,
                }
            )
    with open(os.path.join(out_dir, "log.jsonl"), "w") as f:
        f.write("\n".join(json.dumps(r) for r in lines) + "\n" + tail)


def test_writes_png(tmp_path, capsys):
    write_log(tmp_path, tail='{"iter": 100, "lo')  # a line being written while we read
    assert plot.main([str(tmp_path)]) == 0
    with open(tmp_path / "loss.png", "rb") as f:
        assert f.read(8) == PNG_MAGIC
    out = capsys.readouterr().out
    assert "baseline: fineweb" in out and "best HellaSwag acc_norm 0.3300 at iter 80" in out
    # without HellaSwag, one panel, to a chosen path
    write_log(tmp_path / "b", hellaswag=False)
    assert plot.main([str(tmp_path / "b"), "--out", str(tmp_path / "b.png"), "--ymax", "4"]) == 0
    with open(tmp_path / "b.png", "rb") as f:
        assert f.read(8) == PNG_MAGIC


def test_log_reading_and_baseline_choice(tmp_path):
    write_log(tmp_path / "fw")
    series, dataset = plot.read_log(tmp_path / "fw" / "log.jsonl")
    assert list(series["loss"]) == list(range(100))  # deduplicated, in iter order
    # the resumed run's value wins
    assert series["loss"][45] == pytest.approx(3.0 + 8.0 * np.exp(-3) - 0.5)
    assert len(series["val_loss"]) == 10 and len(series["hellaswag_acc_norm"]) == 5
    assert plot.choose_baseline(series, dataset) == "fineweb"
    for ds, want in (
        ("shakespeare_char", "none"),
        ("openwebtext", "owt"),
        ("edu_fineweb10B", "fineweb"),
    ):
        write_log(tmp_path / ds, hellaswag=False, dataset=ds)
        assert plot.choose_baseline(*plot.read_log(tmp_path / ds / "log.jsonl")) == want


def test_bad_logs(tmp_path):
    with pytest.raises(FileNotFoundError, match="no training log at"):
        plot.main([str(tmp_path)])
    (tmp_path / "log.jsonl").write_text(
        '{"iter": 0, "loss": 11.0}\nnot json\n{"iter": 1, "loss": 10.0}\n'
    )
    with pytest.raises(ValueError, match=r"log.jsonl:2: not JSON"):
        plot.main([str(tmp_path)])
    (tmp_path / "log.jsonl").write_text('{"config": {"dataset": "openwebtext"}}\n')
    with pytest.raises(ValueError, match="no training or eval lines"):
        plot.main([str(tmp_path)])


def test_missing_log_cli(tmp_path):
    r = subprocess.run(
        [sys.executable, "plot.py", str(tmp_path / "no_such_run")],
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"error: no training log at {tmp_path / 'no_such_run' / 'log.jsonl'} "
        "(train.py writes out_dir/log.jsonl)"
    ]
