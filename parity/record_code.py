"""
A speedrun record's own code, run on a CPU (`python -m parity.check_speedrun --own CHECKOUT`): the
record's file read from a modded-nanogpt checkout the user gives (never copied into this
repository), changed by the few text edits in EDITS (each printed by the check, with its reason),
its definitions exec'd as they are, and the statements of its main section that build the
optimizers and make one training step (MAIN) run as they are, one step at a time, on the check's
batches. What stands in for a GPU, for torch.distributed and for FlexAttention's kernel is here
too: OneProcess, dense_flex_attention.
"""

import ast
import contextlib
import os
import warnings
from typing import NamedTuple

import torch
import torch.nn.functional as F

from configurator import UsageError
from parity.speedrun20_reference import ordered_to_dense

LOG_END = "=" * 100  # a record's log: its code, then this line, then the run's output


class Record(NamedTuple):
    path: str  # in a modded-nanogpt checkout
    log: bool  # the code is the head of a run's log (else the file is the script)


RECORDS = {
    5: Record("records/track_1_short/2024-10-14_ModernArch/train_gpt2.py", log=False),
    20: Record(
        "records/track_1_short/2025-01-16_Sub3Min/1d3bd93b-a69e-4118-aeb8-8184239d7566.txt",
        log=True,
    ),
}


class Edit(NamedTuple):
    old: str
    new: str
    count: int  # how many times the record's file has `old`: another count is another file
    why: str


_OWN_FILE = Edit(
    "open(sys.argv[0])", "open(RECORD_FILE)", 1, "it reads its own file for its log (argv[0])"
)
_COMPILE_OFF = "torch.compile off: eager on the CPU"
_NS_DTYPE = "Newton-Schulz in the gradient's dtype (the record: bf16)"
EDITS = {
    5: [
        _OWN_FILE,
        Edit("@torch.compile\n", "@torch.compiler.disable\n", 1, _COMPILE_OFF),
        Edit("X = G.bfloat16()", "X = G.clone()", 1, _NS_DTYPE),
        Edit("return x.cuda(), y.cuda()", "return x, y", 1, "the loader's batches stay on the CPU"),
    ],
    20: [
        _OWN_FILE,
        Edit(
            'torch.empty(1, device="cuda", requires_grad=True).backward()',
            "pass",
            1,
            "a CUDA warm-up",
        ),
        Edit("@torch.compile\n", "@torch.compiler.disable\n", 3, _COMPILE_OFF),
        Edit("X = G.bfloat16()", "X = G.clone()", 1, _NS_DTYPE),
        Edit(
            'dtype=torch.bfloat16, device="cuda"',
            'dtype=params[0].dtype, device="cpu"',
            1,
            "Muon's update buffer in its params' dtype (the record: its bf16 Newton-Schulz's)",
        ),
        Edit('device="cuda"', 'device="cpu"', 3, "the block masks and the batches on the CPU"),
        Edit("pin_memory=True", "pin_memory=False", 2, "no pinned memory without CUDA"),
        Edit(".cuda(non_blocking=True)", "", 1, "the window size stays on the CPU"),
    ],
}


class Statements(NamedTuple):
    first: str  # the first statement's source holds this
    last: str  # and the last one's this
    in_loop: bool = False  # in the training loop's body (else the main section's top level)


# the main section's statements that run here, as they are: the optimizers' set-up, then one step
MAIN = {
    5: {
        "setup": Statements("optimizer1 =", "schedulers ="),
        "step": Statements("model.train()", "model.zero_grad(", in_loop=True),
    },
    20: {
        "setup": Statements("hidden_matrix_params =", "def sw_num_blks"),
        "window": Statements("window_size =", "window_size =", in_loop=True),
        "step": Statements("next(train_loader)", "model.zero_grad(", in_loop=True),
    },
}

# what the namespace's names stand for, besides the edits (printed by the check)
STAND_INS = {
    5: [
        "one process holds the ranks' rows: DDP's gradient average is the loss's mean over them",
        "bf16 autocast off: fp32 (ctx = nullcontext)",
    ],
    20: [
        "flex_attention: dense attention over the pairs the GPU kernel visits "
        "(parity.record_code.dense_flex_attention)",
        "lm_head_fp8: the plain head (the FP8 head off)",
        "torch.distributed: one process standing for the ranks (all_reduce AVG divides by them)",
    ],
}


def read_code(checkout, record):
    """(path, the record's Python source) from a modded-nanogpt checkout; one line (UsageError) if
    the checkout has no such file or the log no code part."""
    if record not in RECORDS:
        raise UsageError(
            f"--own: record {record} is not ported (records {', '.join(map(str, RECORDS))})"
        )
    if not os.path.isdir(checkout):
        raise UsageError(f"--own {checkout}: no such directory (a modded-nanogpt checkout)")
    path = os.path.join(checkout, RECORDS[record].path)
    if not os.path.isfile(path):
        raise UsageError(
            f"--own {checkout}: no {RECORDS[record].path} (record {record}'s "
            f"{'log' if RECORDS[record].log else 'script'}): is it a modded-nanogpt checkout?"
        )
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if RECORDS[record].log:
        head, sep, _ = text.partition("\n" + LOG_END + "\n")
        if not sep or "class GPT" not in head:
            raise UsageError(
                f"{path}: no code part found (the record's code, then a line of 100 '=')"
            )
        text = head + "\n"
    return path, text


def apply_edits(path, text, record):
    """The text with EDITS[record] made; one line if an edit's text is not there as often as in
    the record's file."""
    for edit in EDITS[record]:
        found = text.count(edit.old)
        if found != edit.count:
            raise UsageError(
                f"{path}: {found} x {edit.old!r} where record {record}'s code has {edit.count} "
                f"({edit.why}): not the record's code as ported"
            )
        text = text.replace(edit.old, edit.new)
    return text


class RecordCode:
    """A record's code, edited and parsed: run_definitions() execs everything above its
    Hyperparameters in a fresh namespace; main(name) is MAIN's statements compiled."""

    def __init__(self, checkout, record):
        self.record = record
        self.path, text = read_code(checkout, record)
        self.text = apply_edits(self.path, text, record)
        try:
            with quiet_compiler():
                self.tree = ast.parse(self.text, self.path)
        except SyntaxError as e:
            raise UsageError(
                f"{self.path}: its code part does not parse ({e.msg}, line {e.lineno})"
            )
        names = [getattr(node, "name", None) for node in self.tree.body]
        if "Hyperparameters" not in names:
            raise UsageError(f"{self.path}: no Hyperparameters class: not a record's code")
        self.definitions = self.tree.body[: names.index("Hyperparameters")]
        loops = [
            node
            for node in self.tree.body
            if isinstance(node, ast.For) and getattr(node.target, "id", None) == "step"
        ]
        if not loops:
            raise UsageError(f"{self.path}: no `for step in ...` training loop")
        self.loop = loops[0].body

    def run_definitions(self, **names):
        """A fresh namespace with the record's definitions run in it; `names` set beside them."""
        namespace = {"__name__": f"record{self.record}", "RECORD_FILE": self.path}
        exec(self._compile(self.definitions), namespace)
        namespace.update(names)
        return namespace

    def main(self, name):
        """MAIN[record][name]'s statements, compiled to exec in a namespace."""
        want = MAIN[self.record][name]
        body = self.loop if want.in_loop else self.tree.body
        sources = [ast.get_source_segment(self.text, node) or "" for node in body]
        first = next((i for i, s in enumerate(sources) if want.first in s), None)
        last = next(
            (i for i, s in enumerate(sources) if i >= (first or 0) and want.last in s), None
        )
        if first is None or last is None:
            raise UsageError(
                f"{self.path}: no statements from {want.first!r} to {want.last!r} in its "
                f"{'training loop' if want.in_loop else 'main section'}: not the record's code as "
                "ported"
            )
        return self._compile(body[first : last + 1])

    def _compile(self, nodes):
        with quiet_compiler():
            return compile(ast.Module(body=nodes, type_ignores=[]), self.path, "exec")


@contextlib.contextmanager
def quiet_compiler():
    """Python reading the record's text, without warnings about it (record 5's docstring has an
    invalid escape, '\\s'): they are the record's, not ours."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", (SyntaxWarning, DeprecationWarning))
        yield


# ----------------------------------------------------------------------------- stand-ins
def visited_pairs(block_mask):
    """A FlexAttention BlockMask (batch and heads 1) -> (Q, KV) bool: the (query, key) pairs its
    GPU kernel attends: the first kv_num_blocks of each query block's kv_indices through mask_mod,
    the first full_kv_num_blocks of full_kv_indices whole, none for a count below zero. (The eager
    CPU path applies mask_mod to every block and skips none: not what the record computes.)"""
    q_len, kv_len = block_mask.seq_lengths
    q_block, kv_block = block_mask.BLOCK_SIZE

    def tokens(num, indices):
        assert num.shape[:2] == (1, 1), "one sequence, the heads alike (the record's)"
        blocks = ordered_to_dense(num, indices)
        return blocks.repeat_interleave(q_block, 0).repeat_interleave(kv_block, 1)[:q_len, :kv_len]

    q, kv = torch.arange(q_len)[:, None], torch.arange(kv_len)[None]
    pairs = tokens(block_mask.kv_num_blocks, block_mask.kv_indices)
    pairs = pairs & block_mask.mask_mod(0, 0, q, kv)
    if block_mask.full_kv_num_blocks is not None:
        pairs = pairs | tokens(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
    return pairs


def dense_flex_attention(query, key, value, block_mask, scale):
    """flex_attention(query, key, value, block_mask=..., scale=...) as the GPU kernel computes it:
    (B, H, T, hd) -> (B, H, T, hd), softmax over visited_pairs in float32 (float64 for float64
    inputs), the output in the inputs' dtype."""
    dtype = torch.promote_types(query.dtype, torch.float32)
    scores = (query.to(dtype) @ key.to(dtype).mT) * scale  # (B, H, T, T)
    scores = scores.masked_fill(~visited_pairs(block_mask), float("-inf"))
    return (scores.softmax(dim=-1) @ value.to(dtype)).to(query.dtype)


def plain_head(x, w):
    """lm_head_fp8's stand-in: the head the record runs in eval (CastedLinear's)."""
    return F.linear(x, w.type_as(x))


class OneProcess:
    """torch.distributed for one process that holds all `world` ranks' sequences: all_reduce's
    average divides the gradient summed over them by `world`; all_gather_into_tensor of one rank
    (the record's Muon at world_size 1) copies its update."""

    class ReduceOp:
        AVG = "avg"

    class _Done:
        def wait(self):
            pass

    def __init__(self, world):
        self.world = world

    def all_reduce(self, tensor, op=None, async_op=False):
        assert op == self.ReduceOp.AVG
        tensor.div_(self.world)

    def all_gather_into_tensor(self, output, input, async_op=False):
        assert output.size(0) == 1, "the record's Muon runs as one rank here"
        output.view(-1).copy_(input.view(-1))
        return self._Done()
