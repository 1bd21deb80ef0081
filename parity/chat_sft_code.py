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


def loader(checkout, tokenizer, dataset, args, rank=0, world=1):
    """(chat_sft's sft_data_generator_bos_bestfit('train') over `dataset`, the namespace whose
    last_step and approx_progress it updates); args: device_batch_size, max_seq_len,
    num_iterations."""
    import torch

    scope = definitions(
        checkout,
        ["sft_data_generator_bos_bestfit"],
        torch=torch,
        args=args,
        tokenizer=tokenizer,
        train_dataset=dataset,
        val_dataset=dataset,
        ddp_rank=rank,
        ddp_world_size=world,
        device_type="cpu",
        device="cpu",
        last_step=False,
        approx_progress=0.0,
        current_epoch=1,
    )
    return scope["sft_data_generator_bos_bestfit"]("train"), scope
