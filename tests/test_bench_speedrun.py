"""python -m pytest tests/test_bench_speedrun.py -q

bench/speedrun.py, tokens and seconds to the baseline's final val loss, at a few iterations so that
it does not rot: the baseline, record 5's and record 20's recipes through train.py, a row each (the
target the baseline's final val, tokens = iterations x each run's own tokens a step), the ratio
lines; bad input in one line."""

import re

import pytest

from bench import speedrun
from configurator import UsageError

TINY = ["--max_iters=4", "--warmdown_iters=1", "--eval_iters=1", "--log_interval=4"]


@pytest.mark.slow  # a benchmark's whole run, three train.py processes, ~30 s: make test-slow
def test_three_recipes_side_by_side(monkeypatch, capsys):
    monkeypatch.setattr(
        speedrun,
        "RECIPES",
        [(name, [*config, *TINY]) for name, config in speedrun.RECIPES],
    )
    assert speedrun.main(["--seeds=0", "--eval_interval=2"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^ +0 (\w+) +([\d.]+) +(never|\d+) +([\d,]*) +[\d.]* +([\d.]+)$", out, re.M)
    assert [r[0] for r in rows] == ["baseline", "record5", "record20"]
    assert len({r[1] for r in rows}) == 1  # one target: the baseline's final val
    assert rows[0][1] == rows[0][4]
    for name, _, it, tokens, _ in rows:
        if it != "never":
            per_iter = 4 * 256 if name == "record20" else 12 * 64
            assert int(tokens.replace(",", "")) == int(it) * per_iter
    assert "record5 / baseline" in out or "record5: never" in out
    assert "record20 / baseline" in out or "record20: never" in out


def test_bad_eval_interval():
    with pytest.raises(UsageError, match=r"^--eval_interval must divide the baseline's 2000"):
        speedrun.main(["--eval_interval=3"])
