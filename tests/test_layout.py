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


# -- the rooms: the library in folders by job, each importing only the rooms below it
# --------------------------------------------------------------------------------------------------

ROOT = TESTS.parent
# the user's files at the root (nanoGPT's, and the other scripts a user types), at most 12
SCRIPTS = {
    "train", "sample", "eval", "export", "hellaswag", "fineweb", "plot", "chat_eval", "chat_cli",
    "chat_web",
}  # fmt: skip
# from the ground up: a module may import its own room and the rooms below it, never one above
FLOORS = [
    {"configurator"},
    {"compute"},
    {"dataio"},
    {"model"},
    {"archs"},
    {"run"},
    SCRIPTS,
    {"parity", "bench", "tools", "data", "eval_tasks", "config", "notebooks"},
]
FLOOR = {room: level for level, rooms in enumerate(FLOORS) for room in rooms}
FOLDERS = ("compute", "dataio", "archs", "run")  # the library's rooms


def python_files():
    """Every Python file of the project but the tests (and mutmut's copy), relative to the root."""
    paths = (p.relative_to(ROOT) for p in ROOT.rglob("*.py"))
    return sorted(
        p
        for p in paths
        if p.parts[0] not in ("tests", "mutants") and not any(s.startswith(".") for s in p.parts)
    )


def module_of(path):
    return ".".join(path.with_suffix("").parts).removesuffix(".__init__")


def our_imports(path, modules):
    """The project's modules a file imports, anywhere in it (a function's imports too), by their
    dotted names."""
    found = set()
    for node in ast.walk(ast.parse((ROOT / path).read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {n for n in names if n in modules}
    return found


def import_graph():
    modules = {module_of(p): p for p in python_files()}
    return {m: our_imports(p, modules) - {m} for m, p in modules.items()}


def circles(graph):
    """The sets of modules that import each other in a loop (Tarjan's strongly connected
    components of more than one module)."""
    index, low, stack, found = {}, {}, [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def upward(graph):
    """[(importer, imported)] where a module imports a room on a floor above its own."""
    floor = lambda m: FLOOR[m.split(".")[0]]  # noqa: E731
    return sorted((a, b) for a, bs in graph.items() for b in bs if floor(b) > floor(a))


def test_the_root_keeps_what_a_user_runs_and_the_library_lives_in_rooms():
    root = {p.stem for p in ROOT.glob("*.py")}
    assert root == SCRIPTS | {"model", "configurator"} and len(root) <= 12
    for folder in FOLDERS:
        doc = ast.get_docstring(ast.parse((ROOT / folder / "__init__.py").read_text()))
        assert doc and "May import:" in doc, folder
    # every room of the project is on a floor
    assert {module_of(p).split(".")[0] for p in python_files()} <= set(FLOOR)


def test_each_room_imports_only_the_rooms_its_docstring_names():
    """A folder's __init__.py says what it may import ("May import: a, b, and its own modules"):
    the code holds to it."""
    graph = import_graph()
    for folder in FOLDERS:
        doc = ast.get_docstring(ast.parse((ROOT / folder / "__init__.py").read_text()))
        allowed = set(doc.split("May import:")[1].replace("and its own modules", "").split(","))
        allowed = {name.strip(" .\n") for name in allowed} - {""} | {folder}
        taken = {b.split(".")[0] for a, bs in graph.items() if a.startswith(folder) for b in bs}
        assert taken <= allowed, (folder, taken - allowed)


def test_no_import_circles_and_none_upward():
    graph = import_graph()
    assert len(graph) > 80 and graph["train"] >= {"run.train_step", "archs.models"}
    assert circles(graph) == []
    assert upward(graph) == []


def test_the_reading_finds_a_circle_and_an_upward_import():
    graph = {"compute.layers": {"run.train_step"}, "run.train_step": {"compute.layers"}}
    assert circles(graph) == [["compute.layers", "run.train_step"]]
    assert upward(graph) == [("compute.layers", "run.train_step")]


# -- an architecture answers its own questions: the generic rooms do not compare arch names
# --------------------------------------------------------------------------------------------------


def arch_comparisons(source, name):
    """The comparisons in a file's `source` that involve an architecture's name (x.arch, arch,
    c["arch"]), each as `name:line: code`."""

    def mentions(node):
        return any(
            isinstance(n, ast.Attribute)
            and n.attr == "arch"
            or isinstance(n, ast.Name)
            and n.id == "arch"
            or isinstance(n, ast.Subscript)
            and isinstance(n.slice, ast.Constant)
            and n.slice.value == "arch"
            for n in ast.walk(node)
        )

    return [
        f"{name}:{node.lineno}: {ast.unparse(node)}"
        for node in ast.walk(ast.parse(source, name))
        if isinstance(node, ast.Compare) and any(map(mentions, [node.left, *node.comparators]))
    ]


def test_at_most_four_arch_comparisons_outside_the_architectures_home():
    """Validating a name is fine; asking which architecture a run holds is the architecture's to
    answer (archs/arch.py)."""
    found = {
        str(path): arch_comparisons((ROOT / path).read_text(), str(path))
        for path in python_files()
        if path.parts[0] != "archs"
    }
    assert found["run/train_step.py"] == []
    assert len(sum(found.values(), [])) <= 4, sum(found.values(), [])


def test_the_reading_finds_each_way_of_asking_for_an_arch():
    source = (
        "if c['arch'] == 'speedrun20':\n    pass\n"
        "x = model.config.arch != 'gpt2'\n"
        "y = 'speedrun' in (arch, 1)\n"
        "z = c['arch'] + 'x'\n"
    )
    assert [line.split(": ")[0] for line in arch_comparisons(source, "f.py")] == [
        "f.py:1",
        "f.py:3",
        "f.py:4",
    ]
