"""
Definitions from a nanochat checkout's scripts/chat_sft.py, taken from its source and run in a
namespace holding the globals they read: the script itself loads a model and trains at import, so
its loader and schedule functions cannot be imported. Used by the finetuning checks and their tests
to run nanochat's own code.
"""

import ast
import os

from configurator import UsageError


def definitions(checkout, names, **scope):
    """{name: the function chat_sft.py defines} for `names`, defined in `scope` (the globals they
    read: args, tokenizer, the datasets, ...), which they also update (its loader's progress
    globals): returned as the namespace itself."""
    path = os.path.join(checkout, "scripts", "chat_sft.py")
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
    except OSError:
        raise UsageError(
            f"{checkout}: no scripts/chat_sft.py there (a nanochat checkout?)"
        ) from None
    found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    missing = set(names) - {n.name for n in found}
    if missing:
        raise UsageError(f"{path} defines no {', '.join(sorted(missing))}: another chat_sft.py")
    exec(compile(ast.Module(body=found, type_ignores=[]), path, "exec"), scope)
    return scope
