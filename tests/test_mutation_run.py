"""python -m pytest tests/test_mutation_run.py -q

tools/mutation_run.py, the by-hand mutation runner (docs/notes/mutation.md): a mutant whose tests
fail is killed, one they pass survives, one whose tests cannot run is an error, each in its own
fork, with its pytest output kept. And tools/plant_bugs.py's bugs still plant in the code as it
is."""

import os
import subprocess
import sys

from helpers import REPO

from tools.plant_bugs import BUGS


def test_each_mutant_runs_its_tests_in_its_own_process(tmp_path):
    (tmp_path / "m.py").write_text(
        "import os\n\n\ndef f():\n"
        "    return 2 if os.environ['MUTANT_UNDER_TEST'] == 'm.x_f__mutmut_1' else 1\n"
    )
    (tmp_path / "test_m.py").write_text(
        "import os\n\nfrom m import f\n\n"
        "if os.environ['MUTANT_UNDER_TEST'] == 'm.x_g__mutmut_1':\n"
        "    import no_such_module\n\n\ndef test_f():\n    assert f() == 1\n"
    )
    (tmp_path / "names").write_text("m.x_f__mutmut_1\nm.x_nothing\nm.x_g__mutmut_1\n")
    out = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "tools", "mutation_run.py"),
            str(tmp_path / "names"),
            "--jobs",
            "2",
            "--root",
            str(tmp_path),
            "--logs",
            str(tmp_path / "logs"),
            "--preload",
            "numpy",
            "--",
            "test_m.py",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert sorted(line.split()[:2] for line in out.splitlines()) == [
        ["ERROR", "m.x_g__mutmut_1"],
        ["SURVIVED", "m.x_nothing"],
        ["killed", "m.x_f__mutmut_1"],
    ]
    assert "(pytest exit 2: see its log)" in out  # a test module that does not import is no kill
    assert "1 failed" in (tmp_path / "logs" / "m.x_f__mutmut_1.log").read_text()
    assert "1 passed" in (tmp_path / "logs" / "m.x_nothing.log").read_text()


def test_each_planted_bugs_text_is_in_its_file_once():
    """plant_bugs.py plants by exact text: code that moved on makes it refuse the bug, not test
    it."""
    for name, (_, file, substitutions, tests) in BUGS.items():
        with open(os.path.join(REPO, file)) as f:
            text = f.read()
        for old, _ in substitutions:
            assert text.count(old) == 1, (name, old)
        assert all(os.path.exists(os.path.join(REPO, t.split("::")[0])) for t in tests), name
