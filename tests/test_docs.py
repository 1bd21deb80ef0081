"""python -m pytest tests/test_docs.py -q

Docs that cannot rot: in README.md and docs/*.md every relative link resolves (anchors too), every
`python SCRIPT ...` and `python -m MODULE ...` in a code block or inline code names a script of this
repository, and every `--key=value` or `--flag` given to it is a setting or option that script
accepts.

Each script's options are read from its source with `ast`, not by importing it: the scripts import
jax, torch and lm-eval at the top, and this whole file has to run in a few seconds. A script either
hands a dict of defaults to `configurator.configure` (train.py: settings.DEFAULTS; sample.py,
eval.py, export.py: their `defaults`), which then takes `--key=value` for each key and config files,
or builds an argparse parser, whose options are the `add_argument("--name", ...)` calls in the
script and in the repository functions it calls (hellaswag.cli_parser, parity.common.add_step_args).
`test_the_source_reading_agrees_with_the_real_parsers` holds that reading to the real thing where
importing is cheap.
"""

import argparse
import ast
import functools
import re
import shlex
from ast import literal_eval
from pathlib import Path

import pytest

from configurator import ConfigError, configure

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# modules from elsewhere that the docs may run with `python -m`
EXTERNAL_MODULES = {"pytest", "pip", "venv", "ruff", "jupyter", "nbclient", "papermill"}
# a value that stands for the reader's own (`--init_from=DIR`, `--remat=R`,
# `--dataset=gs://$BUCKET/...`): not checked
PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*(\b.*)?|.*\$.*|.*\.\.\..*")
SHELLS = {"", "sh", "bash", "shell", "console", "zsh"}


# -- markdown
# --------------------------------------------------------------------------------------------------


def markdown_parts(text):
    """(shell code blocks, prose) of a markdown text. Fenced blocks in a shell (or no) language and
    indented blocks are code; prose is everything else, the code replaced by blank lines so that
    paragraphs stay apart."""
    blocks, prose, lines = [], [], text.split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        fence = re.match(r"\s*(`{3,}|~{3,})\s*([\w+-]*)", line)
        if fence:
            end = next(
                (
                    j
                    for j in range(i + 1, len(lines))
                    if lines[j].strip().startswith(fence.group(1))
                ),
                len(lines),
            )
            if fence.group(2).lower() in SHELLS:
                blocks.append("\n".join(lines[i + 1 : end]))
            prose += [""] * (end + 1 - i)
            i = end + 1
        elif (
            line.startswith(("    ", "\t"))
            and (i == 0 or not lines[i - 1].strip())
            and line.strip()
        ):
            end = i
            while end < len(lines) and (
                lines[end].startswith(("    ", "\t")) or not lines[end].strip()
            ):
                end += 1
            blocks.append(
                "\n".join(ln[4:] if ln.startswith("    ") else ln[1:] for ln in lines[i:end])
            )
            prose += [""] * (end - i)
            i = end
        else:
            prose.append(line)
            i += 1
    return blocks, "\n".join(prose)


def inline_code(prose):
    """The inline code spans of prose (a span may wrap onto the next line, never across a
    paragraph)."""
    spans = []
    for paragraph in re.split(r"\n\s*\n", prose):
        spans += [
            m.group(2).replace("\n", " ")
            for m in re.finditer(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", paragraph, re.S)
        ]
    return spans


def without_code(prose):
    return re.sub(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", " ", prose, flags=re.S)


def links(prose):
    """Every link target of prose: inline links and images, and reference definitions."""
    text = without_code(prose)
    inline = re.findall(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", text)
    return inline + re.findall(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", text, re.M)


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text):
    seen, out = {}, set()
    for m in re.finditer(r"^#{1,6}\s+(.*?)\s*#*\s*$", markdown_parts(text)[1], re.M):
        s = slug(m.group(1))
        # GitHub numbers repeated headings: x, x-1, x-2
        out.add(s if s not in seen else f"{s}-{seen[s]}")
        seen[s] = seen.get(s, 0) + 1
    return out


def check_links(text, where):
    """Problems with the relative links of `text`, a markdown file at `where`."""
    problems = []
    for target in links(markdown_parts(text)[1]):
        if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # https:, mailto:: not ours to check
            continue
        path, _, anchor = target.partition("#")
        file = (where.parent / path).resolve() if path else where
        if not file.exists():
            problems.append(f"{where.name}: link to {target}: {path} does not exist")
        elif anchor and file.suffix == ".md":
            names = anchors(text if file == where else file.read_text())
            if anchor not in names:
                problems.append(
                    f"{where.name}: link to {target}: no heading #{anchor} in {file.name}"
                )
    return problems


# -- shell commands
# -----------------------------------------------------------------------------------------------


def shell_lines(block):
    """The logical lines of a shell block: backslash continuations joined."""
    return block.replace("\\\n", " ").split("\n")


def without_comment(line):
    """The line up to a shell comment: a # that starts a word outside quotes (`# OpenAI's weights`
    has a quote)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def tokens_of(line):
    lex = shlex.shlex(without_comment(line), posix=True, punctuation_chars=";&|")
    lex.whitespace_split, lex.commenters = True, ""
    try:
        return list(lex)
    except ValueError:  # an unbalanced quote: an inline span that quotes half a command
        return without_comment(line).split()


def python_commands(line):
    """Each python command of a shell line, as (target, args): target a script path or '-m
    MODULE'."""
    tokens, found, segment = tokens_of(line), [], []
    for t in [*tokens, ";"]:
        # a quoted command: gcloud ... --command="cd x && python train.py ..."
        if " " in t and "python" in t:
            found += python_commands(t.split("=", 1)[-1])
        if t and set(t) <= set(";&|"):
            starts = [
                i
                for i, w in enumerate(segment)
                if re.fullmatch(r"python3?(\.\d+)?", w.rsplit("/", 1)[-1])
            ]
            rest = segment[starts[0] + 1 :] if starts else []
            if rest[:1] == ["-m"] and len(rest) > 1:
                found.append(("-m " + rest[1], rest[2:]))
            elif rest and rest[0].endswith(".py"):
                found.append((rest[0], rest[1:]))
            segment = []
        else:
            segment.append(t)
    return found


def doc_commands(text):
    blocks, prose = markdown_parts(text)
    lines = [ln for b in blocks for ln in shell_lines(b)] + inline_code(prose)
    return [c for ln in lines for c in python_commands(ln)]


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
def test_every_relative_link_resolves(doc):
    assert check_links(doc.read_text(), doc) == []


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


def test_the_checker_finds_a_broken_link_and_a_missing_anchor():
    where = ROOT / "README.md"
    md = (
        "See [the TPU page](docs/tpu.md), [nowhere](docs/no_such_page.md), [a bad "
        "anchor](docs/tpu.md#no-such-heading), [a good one](docs/tpu.md#every-generation), "
        "[here](#quick-start) and [out](https://example.com).\n\n## Quick start\n\n`[not a "
        "link](nowhere.md)` in code is not checked.\n"
    )
    problems = check_links(md, where)
    assert len(problems) == 2
    assert (
        "docs/no_such_page.md does not exist" in problems[0]
        and "no heading #no-such-heading" in problems[1]
    )


def test_the_markdown_reading():
    blocks, prose = markdown_parts(
        "a `x`\n\n    python a.py\n    --b\n\n```python\npython c.py\n```\n`d\ne`\n"
    )
    assert blocks == ["python a.py\n--b\n"] and inline_code(prose) == ["x", "d e"]
    assert (
        slug("The 124M recipe (`config/train_gpt2.py`: 64 × 1024)")
        == "the-124m-recipe-configtrain_gpt2py-64--1024"
    )
    line = 'gcloud --command="cd x && .venv/bin/python train.py --a=1" && srun python -m m.n --b 2'
    assert python_commands(line) == [("train.py", ["--a=1"]), ("-m m.n", ["--b", "2"])]


def test_the_source_reading_agrees_with_the_real_parsers(monkeypatch):
    import settings

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
