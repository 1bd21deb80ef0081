"""python -m pytest tests/test_docs_commands.py -q

Docs that cannot rot, their commands: every `python SCRIPT ...` and `python -m MODULE ...` in a code
block or inline code of README.md and docs/*.md (as helpers/markdown.py reads them) names a script
of this repository, and every `--key=value` or `--flag` given to it is a setting or option that
script accepts.

Each script's options are read from its source with `ast`, not by importing it: the scripts import
jax, torch and lm-eval at the top, and this whole file has to run in a few seconds. A script either
hands a dict of defaults to `configurator.configure` (train.py: settings.DEFAULTS; sample.py,
eval.py, export.py: their `defaults`), which then takes `--key=value` for each key and config files,
or builds an argparse parser, whose options are the `add_argument("--name", ...)` calls in the
script and in the repository functions it calls (hellaswag.cli_parser, parity.common.add_step_args).
`test_the_source_reading_agrees_with_the_real_parsers` holds that reading to the real thing where
importing is cheap."""

import argparse
import ast
import functools
import re
from ast import literal_eval

import pytest
from helpers.markdown import DOCS, ROOT, doc_commands

from configurator import ConfigError, configure

# modules from elsewhere that the docs may run with `python -m`
EXTERNAL_MODULES = {"pytest", "pip", "venv", "ruff", "jupyter", "nbclient", "papermill"}
# a value that stands for the reader's own (`--init_from=DIR`, `--remat=R`,
# `--dataset=gs://$BUCKET/...`): not checked
PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*(\b.*)?|.*\$.*|.*\.\.\..*")


# -- each script's options, from its source
# -----------------------------------------------------------------------


def module_file(name):
    base = ROOT / name.replace(".", "/")
    for f in (base.with_suffix(".py"), base / "__main__.py"):
        if f.is_file():
            return f
    return None


@functools.cache
def parse(path):
    return ast.parse(path.read_text(), str(path))


def repo_imports(tree):
    """name in the script -> (repo file it comes from, the name there or None for a module)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if module_file(a.name):
                    names[(a.asname or a.name).split(".")[0]] = (module_file(a.name), None)
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                # a module of a package: from bench import train
                if module_file(f"{node.module}.{a.name}"):
                    names[a.asname or a.name] = (module_file(f"{node.module}.{a.name}"), None)
                elif module_file(node.module):
                    names[a.asname or a.name] = (module_file(node.module), a.name)
    return names


def call_name(call):
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def top_level(tree, name):
    """The value assigned to `name` at the top of `tree`, and the tree it is in (following an
    import)."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            return node.value, tree
    source = repo_imports(tree).get(name)
    return top_level(parse(source[0]), source[1]) if source and source[1] else (None, tree)


def names_in(tree, node):
    """The strings a `choices=` expression allows (`["a", "b"]`, `list(REMAT)`,
    `attention.SETTINGS`, a dict's keys, `["auto", *BASELINES]`), or None where the source does not
    say them plainly."""
    if (
        isinstance(node, ast.Call)
        and call_name(node) in ("list", "tuple", "sorted")
        and len(node.args) == 1
    ):
        return names_in(tree, node.args[0])
    if isinstance(node, ast.Name):
        value, where = top_level(tree, node.id)
        return names_in(where, value)
    if (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id in repo_imports(tree)
    ):
        value, where = top_level(parse(repo_imports(tree)[node.value.id][0]), node.attr)
        return names_in(where, value)
    if isinstance(node, ast.Dict):
        parts = [names_in(tree, v) if k is None else k for k, v in zip(node.keys, node.values)]
    elif isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        parts = [names_in(tree, e.value) if isinstance(e, ast.Starred) else e for e in node.elts]
    else:
        return None
    out = []
    for part in parts:
        if isinstance(part, ast.Constant):
            out.append(str(part.value))
        elif isinstance(part, list):
            out += part
        else:  # a name or an expression: not plain
            return None
    return out


def argparse_options(tree, called_from=None, seen=None):
    """{'--name': (takes a value?, choices or None, type name or None)} of the add_argument calls in
    `tree` (in the function named `called_from` only, when given) and in the repository functions
    those call."""
    seen = set() if seen is None else seen
    scope = (
        tree
        if called_from is None
        else next(
            (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == called_from),
            None,
        )
    )
    options = {}
    if scope is None:
        return options
    imports = repo_imports(tree)
    for call in (n for n in ast.walk(scope) if isinstance(n, ast.Call)):
        name = call_name(call)
        if name == "add_argument":
            kw = {k.arg: k.value for k in call.keywords}
            action = kw["action"].value if isinstance(kw.get("action"), ast.Constant) else None
            choices = names_in(tree, kw["choices"]) if "choices" in kw else None
            kind = kw["type"].id if isinstance(kw.get("type"), ast.Name) else None
            for a in call.args:
                if isinstance(a, ast.Constant) and str(a.value).startswith("--"):
                    options[a.value] = (action not in ("store_true", "store_false"), choices, kind)
        elif (
            isinstance(call.func, ast.Attribute)
            and isinstance(call.func.value, ast.Name)
            and call.func.value.id in imports
            and (imports[call.func.value.id][0], name) not in seen
        ):
            # module.function(...): hellaswag.cli_parser
            seen.add((imports[call.func.value.id][0], name))
            options |= argparse_options(parse(imports[call.func.value.id][0]), name, seen)
        elif name in imports and imports[name][1] and (imports[name][0], name) not in seen:
            seen.add((imports[name][0], name))  # an imported function: add_step_args(p)
            options |= argparse_options(parse(imports[name][0]), imports[name][1], seen)
    return options


def dict_of(tree, name):
    """The dict assigned to `name` at the top of `tree` or of the module it comes from (`dict(k=v,
    ...)` or `{...}`): {key: default}; a default that is not a literal (`5 * 8`) is None, which the
    configurator lets any value pass."""
    v, _ = top_level(tree, name)
    if isinstance(v, ast.Call) and call_name(v) == "dict" and not v.args:
        pairs = [(k.arg, k.value) for k in v.keywords]
    elif isinstance(v, ast.Dict):
        pairs = [(k if k is None else literal_eval(k), val) for k, val in zip(v.keys, v.values)]
    else:
        raise AssertionError(f"no dict {name} at the top of the file")
    assert all(k is not None for k, _ in pairs), (
        f"{name}: a ** in the defaults, which this test cannot read"
    )
    out = {}
    for k, val in pairs:
        try:
            out[k] = literal_eval(val)
        except ValueError:
            out[k] = None
    return out


class Script:
    """What a script accepts: argparse options, or the configurator's settings (and bare flags it
    maps)."""

    def __init__(self, path):
        tree = parse(path)
        self.path, self.options, self.settings, self.bare, self.nullable = (
            path,
            argparse_options(tree),
            None,
            set(),
            (),
        )
        if self.options:
            return
        for call in (
            n for n in ast.walk(tree) if isinstance(n, ast.Call) and call_name(n) == "configure"
        ):
            if (
                isinstance(call.args[0], ast.Name)
                and len(call.args) > 1
                and not isinstance(call.args[1], ast.List)
            ):
                self.settings = dict_of(tree, call.args[0].id)
                nullable = next((k.value for k in call.keywords if k.arg == "nullable"), None)
                self.nullable = literal_eval(nullable) if nullable else ()
        # flags the script maps before configuring: sample.py's `"--stream=True" if a == "--stream"`
        self.bare = {
            c.comparators[0].value
            for c in ast.walk(tree)
            if isinstance(c, ast.Compare)
            and isinstance(c.comparators[0], ast.Constant)
            and str(c.comparators[0].value).startswith("--")
        }

    def problems(self, args):
        args = [a.strip("[]") for a in args]
        out = []
        for i, a in enumerate(args):
            if a == "--help":  # every script's (test_help.py)
                continue
            if not a.startswith("--") or a == "--":
                if self.settings is not None and a.endswith(".py") and not (ROOT / a).is_file():
                    out.append(f"config file {a} does not exist")
                continue
            key, eq, value = a.partition("=")
            if self.settings is not None:
                out += self.setting_problems(a, key, eq, value)
            elif key not in self.options:
                out.append(f"{key} is not an option")
            else:
                takes_value, choices, kind = self.options[key]
                if eq and not takes_value:
                    out.append(f"{key} is a flag: it takes no value")
                nxt = args[i + 1] if i + 1 < len(args) else ""
                value = value if eq else nxt if takes_value and not nxt.startswith("-") else ""
                if value and not PLACEHOLDER.fullmatch(value):
                    if choices and value not in map(str, choices):
                        out.append(f"{key}={value}: not one of {choices}")
                    elif kind in ("int", "float") and not re.fullmatch(r"-?[\d.e+-]+", value):
                        out.append(f"{key}={value}: not an {kind}")
        return out

    def setting_problems(self, arg, key, eq, value):
        if not eq:
            return [] if arg in self.bare else [f"{arg}: the configurator takes --key=value"]
        if key[2:] not in self.settings:
            return [f"{key} is not a setting"]
        if PLACEHOLDER.fullmatch(value):
            return []
        try:  # the configurator's own parsing and type check
            configure(self.settings, [arg], nullable=self.nullable)
        except ConfigError as e:
            return [str(e)]
        return []


def script_for(target):
    """(Script, None) for a command's target, or (None, why not). A placeholder (`python SCRIPT`)
    names nothing to check; a pattern (`python -m parity.check_*`) must match a script, and its
    options are not checked."""
    name = target[3:] if target.startswith("-m ") else target
    if PLACEHOLDER.fullmatch(name):
        return None, None
    if "*" in name:
        pattern = name.replace(".", "/") + ".py" if target.startswith("-m ") else name
        return None, None if list(
            ROOT.glob(pattern)
        ) else f"python {target}: matches no script in the repository"
    if target.startswith("-m "):
        if name.split(".")[0] in EXTERNAL_MODULES:
            return None, None
        path = module_file(name)
        return (
            (Script(path), None)
            if path
            else (None, f"python -m {name}: no such module in the repository")
        )
    path = (ROOT / target).resolve()
    ours = (
        path.is_file() and path.is_relative_to(ROOT) and ".venv" not in path.relative_to(ROOT).parts
    )
    return (
        (Script(path), None)
        if ours
        else (None, f"python {target}: no such script in the repository")
    )


def check_commands(text, where):
    problems, scripts = [], {}
    for target, args in doc_commands(text):
        if target not in scripts:
            scripts[target] = script_for(target)
        script, missing = scripts[target]
        if missing:
            problems.append(f"{where.name}: {missing}")
        elif script:
            problems += [
                f"{where.name}: python {target} {' '.join(args)}: {p}"
                for p in script.problems(args)
            ]
    return problems


# -- the tests
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_command_names_a_script_and_options_it_accepts(doc):
    text = doc.read_text()
    assert check_commands(text, doc) == []
    if doc.name == "README.md":
        assert len(doc_commands(text)) >= 5  # the user contract's commands are there to be checked


def test_the_checker_finds_a_made_up_flag_a_missing_script_and_a_bad_value():
    where = ROOT / "README.md"
    md = (
        "Train:\n\n```sh\npython train.py config/train_shakespeare_char.py --batch_size=32 "
        "--made_up=1\npython -m parity.check_logits --random-init --made-up-flag\npython "
        "nowhere.py\n```\n\nand `python sample.py --max_new_tokens=ten`, `python hellaswag.py "
        "--dtype=float16`, `python train.py config/no_such_config.py`, `python -m "
        "parity.check_logits --random-init=1`.\n"
    )
    problems = "\n".join(check_commands(md, where))
    for expected in [
        "--made_up is not a setting",
        "--made-up-flag is not an option",
        "nowhere.py: no such script",
        "max_new_tokens must be int",
        "--dtype=float16: not one of",
        "config/no_such_config.py does not",
        "--random-init is a flag",
    ]:
        assert expected in problems
    assert len(check_commands(md, where)) == 7
    good = "```sh\npython train.py config/train_gpt2.py --fsdp=K --remat=dots  # --unchecked\n```\n"
    assert check_commands(good, where) == []


def test_the_source_reading_agrees_with_the_real_parsers(monkeypatch):
    from run import settings

    assert set(Script(ROOT / "train.py").settings) == set(settings.DEFAULTS)
    import parity.check_train

    class Parser(Exception):
        pass

    def catch(self, *args, **kwargs):
        raise Parser(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    with pytest.raises(Parser) as got:
        parity.check_train.parse_args([])
    real = {
        s for s in got.value.args[0]._option_string_actions if s.startswith("--") and s != "--help"
    }
    assert set(Script(ROOT / "parity/check_train.py").options) == real
