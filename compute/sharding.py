"""
The device mesh and every tensor's layout on it, in one place. train.py, hellaswag.py, sample.py,
the parity checks and the benchmarks take their mesh from here.

Mesh axes ('data', 'fsdp', 'tensor') over every device of every process, in process order:
- the batch is split over data x fsdp (the devices of one 'tensor' group see the same rows);
- parameters, their gradients and the optimizer state are split over fsdp (ZeRO-3: XLA gathers each
  layer's weights where they are used) and, Megatron's way, over tensor (below); 'data' holds
  replicas.
fsdp 1 and tensor 1 is plain data parallelism: each device a full replica.

The devices themselves (a TPU topology's or a GPU spec's, compiled for here) and their memory are
compute/accelerators.py's.
"""

import ctypes
import math
import os
import platform
import re

import jax
import numpy as np
from jax._src.mesh import get_concrete_mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from compute import accelerators
from configurator import UsageError

AXES = ("data", "fsdp", "tensor")
BATCH = ("data", "fsdp")  # the axes the batch's rows are split over

# Every parameter's PartitionSpec, by path (a regex on the dotted path of a param, or of the same
# param inside the optimizer state: Adam's moments take their param's layout). First match wins; no
# match is replicated. Megatron's pairing: c_attn and c_fc split by output columns over 'tensor'
# (column parallel), attn.c_proj and mlp.c_proj by input rows (row parallel): one all-reduce at the
# end of each branch. 'fsdp' takes the other dimension of every matrix. LayerNorms and the
# row-parallel biases are replicated.
PARAM_SPECS = [
    (r"wte\.embedding", P("tensor", "fsdp")),  # (vocab, C): the tied head's logits split by vocab
    (r"wpe\.embedding", P(None, "fsdp")),  # (block_size, C)
    (r"attn\.c_attn\.kernel", P("fsdp", "tensor")),  # (C, 3C) column parallel
    (r"attn\.c_attn\.bias", P("tensor")),  # (3C,)
    (r"attn\.c_proj\.kernel", P("tensor", "fsdp")),  # (C, C) row parallel
    (r"mlp\.c_fc\.kernel", P("fsdp", "tensor")),  # (C, 4C) column parallel
    (r"mlp\.c_fc\.bias", P("tensor")),  # (4C,)
    (r"mlp\.c_proj\.kernel", P("tensor", "fsdp")),  # (4C, C) row parallel
    # nanochat's (arch='nanochat'; its c_proj, c_fc and wte take the rows above): q, k and v as
    # three Linears, each split by its heads; the value embeddings, keyed by layer, split as wte is.
    # Its gates (ve_gate (12, n_kv_head), smear_gate (24, 1)) and scalars stay replicated. Its
    # untied lm_head has no row: the path is record 20's too, whose head stays replicated.
    (r"attn\.c_[qkv]\.kernel", P("fsdp", "tensor")),  # (C, heads x hs) column parallel
    (r"value_embeds\.\d+\.embedding", P("tensor", "fsdp")),  # (vocab, n_kv_head x hs)
]


def make_mesh(fsdp=1, tensor_parallel=1, devices=None):
    """Mesh (data, fsdp, tensor) over `devices` (default: every device of every process), data =
    devices / (fsdp x tensor_parallel). Devices in process order, so each process's rows of the
    batch are one contiguous range (see process_rows). Auto axes: XLA propagates shardings and
    inserts the collectives."""
    devices = jax.devices() if devices is None else list(devices)
    n = len(devices)
    if fsdp < 1 or tensor_parallel < 1 or n % (fsdp * tensor_parallel):
        raise UsageError(
            f"fsdp={fsdp} x tensor_parallel={tensor_parallel} must be positive and divide the "
            f"{n} device(s): change --fsdp or --tensor_parallel"
        )
    devices = sorted(devices, key=lambda d: (d.process_index, d.id))
    grid = np.array(devices, dtype=object).reshape(
        n // (fsdp * tensor_parallel), fsdp, tensor_parallel
    )
    return jax.sharding.Mesh(grid, AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3)


def batch_shards(mesh):
    """How many ways the batch's rows are split: data x fsdp."""
    return mesh.shape["data"] * mesh.shape["fsdp"]


def check_model_fits_mesh(config, mesh):
    """Tensor parallelism splits heads and the MLP's hidden units: both must divide evenly, and so
    must the key/value heads where fewer than the query heads (n_kv_head: nanochat's GQA)."""
    tp = mesh.shape["tensor"]
    if config.n_head % tp or (4 * config.n_embd) % tp:
        raise UsageError(
            f"tensor_parallel={tp} must divide n_head={config.n_head} and 4*n_embd="
            f"{4 * config.n_embd}: change --tensor_parallel"
        )
    if config.n_kv_head % tp:
        raise UsageError(
            f"tensor_parallel={tp} must divide n_kv_head={config.n_kv_head} (the key/value heads, "
            "split over 'tensor' with their query heads): change --tensor_parallel or --n_kv_head"
        )


def _path(key_path):
    return jax.tree_util.keystr(key_path, simple=True, separator=".").removesuffix(".value")


def _names(entry):
    """The mesh axes of one PartitionSpec entry: None, an axis, or a tuple of axes (BATCH)."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def fit(spec, shape, mesh):
    """`spec` with every entry whose axes do not divide its dimension dropped (e.g. GPT-2's
    vocabulary of 50257 over tensor 2: that dimension stays whole, the other is still split)."""
    return P(
        *(
            entry if dim % math.prod(mesh.shape[a] for a in _names(entry)) == 0 else None
            for entry, dim in zip(spec, shape)
        )
    )


# a param of the stacked blocks (model.GPTConfig.scan_layers): h.attn.c_attn.kernel, not
# h.3.attn.c_attn.kernel
STACKED = re.compile(r"(^|\.)h\.(?!\d)")


def spec_for(path, shape, mesh):
    """The table's spec for one array, fitted to its shape (fit). The stacked blocks' params have a
    leading layer axis, never split: each device holds its shard of every layer."""
    spec = next((s for pattern, s in PARAM_SPECS if re.search(pattern, path)), P())
    if STACKED.search(path) and len(shape):
        spec = P(None, *spec) if len(spec) else P()
    if len(spec) != len(shape):  # a scalar (Adam's count) or anything the table does not describe
        return P()
    return fit(spec, shape, mesh)


def shardings_for(tree, mesh):
    """NamedShardings for every leaf of a params or optimizer-state tree (arrays or
    ShapeDtypeStructs)."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: NamedSharding(mesh, spec_for(_path(p), x.shape, mesh)), tree
    )


def abstract(tree, shardings):
    """ShapeDtypeStructs of a tree with the sharding to place it with: one for every leaf, or a tree
    of them."""
    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings), tree
        )
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


def batch_sharding(mesh, ndim=3):
    """(accum, B, T) micro-batches, or (B, T) with ndim=2: rows split over data x fsdp."""
    return NamedSharding(
        mesh, P(None, BATCH, None) if ndim == 3 else P(BATCH, *([None] * (ndim - 1)))
    )


def put_rows(arrays, mesh):
    """Host arrays (rows first) on the mesh, rows split over data x fsdp. Every process holds all
    the rows and hands over those of its own devices (so this works across hosts too): evaluation's
    batches."""
    rows = batch_sharding(mesh, ndim=2)
    return tuple(
        jax.make_array_from_callback(a.shape, rows, lambda index, a=a: a[index]) for a in arrays
    )


def replicated(mesh):
    return NamedSharding(mesh, P())


def process_rows(sharding, global_shape, row_axis):
    """The rows (along row_axis) of a global batch that live on this process's devices, as a slice.
    They must be one contiguous range: make_mesh orders devices by process so that they are;
    asserted, not assumed."""
    index = sharding.addressable_devices_indices_map(global_shape).values()
    ranges = sorted(
        {(i[row_axis].start or 0, i[row_axis].stop or global_shape[row_axis]) for i in index}
    )
    lo, hi = ranges[0][0], ranges[-1][1]
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), (
        f"this process's rows are not contiguous: {ranges}"
    )
    return slice(lo, hi)


def bytes_per_device(tree):
    """Bytes one device holds of a tree of arrays, or of ShapeDtypeStructs with shardings."""
    return sum(
        math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree)
    )


def step_peak_bytes(compiled, platform="cpu"):
    """XLA's memory analysis of a compiled step. On a TPU, the compiler's own peak (its heap
    simulation, what it refuses a program by); elsewhere arguments + outputs + temporaries - donated
    (aliased), an upper bound: for the 124M step under scan_layers on a v5e it said 16.11 GiB where
    the TPU peak is 11.85."""
    m = compiled.memory_analysis()
    if platform == "tpu" and m.peak_memory_in_bytes:
        return m.peak_memory_in_bytes
    return (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )


def target_platform():
    """The platform the program being traced is for: that of the mesh in context (jax.set_mesh),
    else the default backend's. A step compiled on a CPU for a TPU topology (bench/train.py
    --topology) is then the program a TPU VM would run: its attention kernel, remat and workarounds
    are the TPU's, not the host's."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    return device.platform if device is not None else jax.default_backend()


def target_device():
    """The first device of the program being traced: the mesh in context's (jax.set_mesh), else the
    default backend's. A GPU compiled for here (accelerators.gpu_devices) is the mesh's: its compute
    capability, not the host's, decides cuDNN."""
    mesh = get_concrete_mesh()  # jax.sharding.get_mesh refuses to be called while tracing
    return jax.devices()[0] if mesh.empty else mesh.devices.flat[0]


def platform_of(mesh):
    """'cpu', 'gpu' or 'tpu': the platform of a mesh's devices."""
    return mesh.abstract_mesh.abstract_device.platform


def target_size():
    """Devices the program being traced runs on: the mesh in context's, else 1 (a single-device
    jit)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else mesh.size


# Where the model computes under a mesh (jax.set_mesh around tracing; a no-op without one):
# activations keep their rows over data x fsdp, and each weight is gathered over fsdp where it is
# used, still split over tensor. Left to itself, XLA's partitioner resharded activations to match
# the fsdp-split weights instead (an "involuntary full rematerialization" of the batch), which is
# neither ZeRO-3 nor cheap.
COLUMN = (P(None, "tensor"), P("tensor"))  # c_attn, c_fc: (kernel, bias) split by output columns
ROW = (P("tensor", None), P())  # attn.c_proj, mlp.c_proj: split by input rows, bias whole
VOCAB = P("tensor", None)  # wte as the tied head: logits split by vocabulary


def constrain(x, spec):
    """x pinned to `spec` on the mesh in context, any axis that does not divide its dimension
    dropped."""
    mesh = jax.sharding.get_abstract_mesh()
    # one device: nothing to place, and the annotation would only stand between XLA:CPU's fusions
    if (
        mesh.empty
        or mesh.size == 1
        or not {a for entry in spec for a in _names(entry)} <= set(mesh.axis_names)
    ):
        return x
    return jax.lax.with_sharding_constraint(x, fit(spec, x.shape, mesh))


def constrain_batch(x):
    """Activations (B, ...): rows over data x fsdp, whole along every other axis."""
    return constrain(x, P(BATCH, *([None] * (x.ndim - 1))))


def keep_freed_memory():
    """On a CPU, keep the memory XLA frees in the process. glibc hands a freed block of over 32 MB,
    and the top of its heap, back to the OS, so the step's scratch buffer came back as fresh pages
    every step, each faulted in and zeroed by the kernel (docs/benchmarks.md). Linux/glibc only;
    elsewhere, and on GPU/TPU, nothing changes."""
    if jax.default_backend() == "cpu" and platform.libc_ver()[0] == "glibc":
        libc = ctypes.CDLL(None)
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: trim the heap's top only past 1 GiB free
        # M_MMAP_MAX: no block gets an mmap of its own (they are unmapped when freed)
        libc.mallopt(-4, 0)


def use_compilation_cache():
    """JAX's persistent compilation cache, on by default, so that a second run of a command compiles
    nothing: in $JAX_COMPILATION_CACHE_DIR (JAX's own setting: set it to move the cache, set it
    empty to turn it off), else in nanogpt-jax/jax under the user's cache directory ($XDG_CACHE_HOME
    or ~/.cache). Call it before anything is compiled."""
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        jax.config.update("jax_compilation_cache_dir", os.path.join(cache, "nanogpt-jax", "jax"))
    # every compilation, not only those over 1 s (JAX's default): start-up is many small ones
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def start_backend():
    """Start JAX's backends: scripts call it at the top of main (after jax.distributed.initialize).
    On a machine with libtpu installed but no TPU, libtpu's start-up banner is kept off the terminal
    (accelerators.libtpu_quiet); so is the CUDA plugin's failed check where jax[cuda12] is installed
    without a GPU (accelerators.cuda_quiet)."""
    accelerators.cuda_quiet()
    with accelerators.libtpu_quiet():
        jax.devices()
