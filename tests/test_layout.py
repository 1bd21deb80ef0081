"""python -m pytest tests/test_layout.py -q

The shape of the house, read from the code's own imports: no test module imports another (what
several share lives in tests/helpers/ or conftest.py)."""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def imported_modules(path):
    """The top-level names of the modules a file imports, anywhere in it."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_no_test_module_imports_another():
    files = [*TESTS.glob("*.py"), *TESTS.glob("helpers/*.py")]
    assert len(files) > 50
    found = {
        path.relative_to(TESTS).as_posix(): sorted(
            n for n in imported_modules(path) if n.startswith("test_")
        )
        for path in files
    }
    assert {path: names for path, names in found.items() if names} == {}


def test_the_reading_finds_an_import_of_a_test_module(tmp_path):
    path = tmp_path / "test_x.py"
    path.write_text("def f():\n    from test_tpu import T\n    import test_docs.y\n")
    assert imported_modules(path) == {"test_tpu", "test_docs"}
