"""
The device mesh and every tensor's layout on it, in one place. train.py, hellaswag.py, sample.py,
the parity checks and the benchmarks take their mesh from here.

Mesh axes ('data', 'fsdp', 'tensor') over every device of every process, in process order:
- the batch is split over data x fsdp (the devices of one 'tensor' group see the same rows);
- parameters, their gradients and the optimizer state are split over fsdp (ZeRO-3: XLA gathers each
  layer's weights where they are used) and, Megatron's way, over tensor (below); 'data' holds
  replicas.
fsdp 1 and tensor 1 is plain data parallelism: each device a full replica.
"""

import contextlib
import ctypes
import dataclasses
import importlib.util
import math
import os
import platform
import re
import sys
import tempfile

import jax
import numpy as np
from jax._src import hardware_utils
from jax._src.cloud_tpu_init import get_tpu_library_path
from jax._src.lib import xla_client
from jax._src.mesh import get_concrete_mesh
from jax.experimental import topologies
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from configurator import UsageError, stderr_into

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
    """Tensor parallelism splits heads and the MLP's hidden units: both must divide evenly."""
    tp = mesh.shape["tensor"]
    if config.n_head % tp or (4 * config.n_embd) % tp:
        raise UsageError(
            f"tensor_parallel={tp} must divide n_head={config.n_head} and 4*n_embd="
            f"{4 * config.n_embd}: change --tensor_parallel"
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
    default backend's. A GPU compiled for here (gpu_devices) is the mesh's: its compute capability,
    not the host's, decides cuDNN."""
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


# TPU programs without a TPU: libtpu's ahead-of-time compiler runs on any machine
# (jax.experimental.topologies, as MaxText's train_compile.py), so a mesh of a topology's devices
# sizes and checks a TPU step here; nothing runs.
@dataclasses.dataclass(frozen=True)
class TPU:
    device_kind: str  # jax's Device.device_kind
    dims: str  # a topology's chips: "XxY" (a 2D torus) or "XxYxZ"
    host_bounds: tuple  # one host's chips (x, y, z)
    # "default": each TensorCore a device; "megacore": a chip's two TensorCores one device
    chip_config: str
    # bytes of HBM per device a program may use: the TPU compiler's "available HBM" (libtpu 0.0.42)
    hbm: int


GiB = 2**30
# Every generation libtpu compiles for. A free Colab/Kaggle TPU is a v2-8 or v3-8 (one host of 2x2
# chips, 8 cores); a v5e-8 or v6e-8 VM one host of 2x4; v4, v5p and TPU7x VMs 2x2x1. HBM per chip
# (Google Cloud's TPU pages): v2 16 GiB, v3 32, v4 32, v5e 16, v5p 95, v6e 32, TPU7x 192, shared by
# the devices it shows, less what the runtime keeps
TPUS = {
    "v2": TPU("TPU v2", "XxY", (2, 2, 1), "default", round(7.48 * GiB)),
    "v3": TPU("TPU v3", "XxY", (2, 2, 1), "default", round(15.48 * GiB)),
    "v4": TPU("TPU v4", "XxYxZ", (2, 2, 1), "megacore", round(30.75 * GiB)),
    "v5e": TPU("TPU v5 lite", "XxY", (2, 4, 1), "default", round(15.75 * GiB)),
    "v5p": TPU("TPU v5", "XxYxZ", (2, 2, 1), "megacore", round(95.74 * GiB)),
    "v6e": TPU("TPU v6 lite", "XxY", (2, 4, 1), "default", round(31.25 * GiB)),
    # Ironwood: 2 TensorCores, 2 devices
    "tpu7x": TPU("TPU7x", "XxYxZ", (2, 2, 1), "default", round(94.75 * GiB)),
}
GENERATIONS = {t.device_kind: name for name, t in TPUS.items()}  # device_kind: generation
TOPOLOGY = re.compile(r"(\w+):(\d+)x(\d+)(?:x(\d+))?")
ONE_HOST = {
    name: "x".join(map(str, t.host_bounds[: 2 if t.dims == "XxY" else 3]))
    for name, t in TPUS.items()
}
TOPOLOGY_FORMS = (
    ", ".join(f"{name}:{chips}" for name, chips in ONE_HOST.items())
    + " (one host; XxY chips for v2, v3, v5e, v6e, XxYxZ for v4, v5p, tpu7x; more chips than a "
    "host's, e.g. v3:4x4, make a multi-host slice)"
)
# what libtpu prints to stderr from C++ as it starts on a machine with no TPU (it looks for one,
# finds none)
LIBTPU_BANNER = re.compile(
    r"Failed to find host bounds for accelerator type|Logging before InitGoogle\(\)|"
    r"unexpected worker hostname|^=== Source Location Trace: ===|libtpu_init_utils\.cc:\d+"
)


def topology_devices(name):
    """The compile-only TPU devices of a topology such as 'v5e:2x4' (a v5e-8 VM: 8 chips on one
    host); one host where the topology fits on one, else as many hosts as it takes. A mesh of them
    (make_mesh(..., devices=)) takes abstract inputs only: an array or a key made on it fails, there
    being no TPU to hold it."""
    m = TOPOLOGY.fullmatch(name)
    tpu = TPUS.get(m[1]) if m else None
    if tpu is None or (m[4] is None) != (tpu.dims == "XxY"):
        raise UsageError(f"unknown TPU topology {name!r}: give one of {TOPOLOGY_FORMS}")
    chips = (*(int(d) for d in m.group(2, 3, 4) if d), 1)[:3]  # (x, y, z)
    if get_tpu_library_path() is None:
        raise UsageError(
            f"compiling for {name} needs libtpu, the tpu extras: pip install -c constraints.txt "
            "-e '.[tpu]'"
        )
    bounds = tuple(min(c, h) for c, h in zip(chips, tpu.host_bounds))
    try:
        with libtpu_quiet():
            return topologies.get_topology_desc(
                platform="tpu",
                topology_name=name,
                chip_config_name=tpu.chip_config,
                chips_per_host_bounds=bounds,
                num_slices=1,
            ).devices
    except jax.errors.JaxRuntimeError as e:  # e.g. v5e:3x3, not a whole number of hosts
        raise UsageError(f"TPU topology {name}: {str(e).splitlines()[0]}") from None


def usable_bytes(device):
    """The bytes a program may use on `device`: what a TPU or an NVIDIA GPU reports on its own
    machine (bytes_limit), else its table's (a compile-only device reports nothing: TPUS, or GPUS
    less what JAX keeps back, gpu_usable); a CPU device's share of the host's RAM; None for other
    devices."""
    if device.platform == "cpu":
        return (
            os.sysconf("SC_PAGE_SIZE")
            * os.sysconf("SC_PHYS_PAGES")
            // len(jax.local_devices(backend="cpu"))
        )
    try:
        limit = (device.memory_stats() or {}).get("bytes_limit")
    # a topology's compile-only device: "only supported for addressable" devices
    except jax.errors.JaxRuntimeError:
        limit = None
    if limit or device.device_kind in GENERATIONS:
        return limit or TPUS[GENERATIONS[device.device_kind]].hbm
    return (
        gpu_usable(GPUS[GPU_NAMES[device.device_kind]].memory)
        if device.device_kind in GPU_NAMES
        else None
    )


# GPU programs without a GPU: XLA compiles for an NVIDIA GPU from a description of it (a
# GpuTargetConfigProto, as XLA's own tools do) through JAX's CUDA plugin (the cuda extras), on any
# machine; nothing runs.
@dataclasses.dataclass(frozen=True)
class GPU:
    device_kind: str  # the name the GPU reports (jax's Device.device_kind)
    # CUDA compute capability (major, minor): what cuDNN's fused attention and XLA's kernels need
    capability: tuple
    # bytes of device memory, as the CUDA driver reports it (cudaDeviceProp.totalGlobalMem)
    memory: int
    cores: int  # streaming multiprocessors
    fpus_per_core: int  # FP32 units per SM
    clock_ghz: float  # SM boost clock
    bandwidth: int  # memory bandwidth, bytes/s
    l2: int  # L2 cache bytes
    shared_per_core: int  # shared memory per SM, bytes (a block may opt in to all but 1 KiB of it)


# The SXM parts' figures from XLA's own GPU specs (openxla/xla, Apache-2.0:
# xla/backends/gpu/target_config/specs/ a100_sxm_40, a100_sxm_80, h100_sxm, h200, b200 .txtpb),
# which agree with NVIDIA's data sheets (A100: 108 SMs, 40 MB L2, 1.56/2.04 TB/s; H100 SXM: 132 SMs,
# 3.35 TB/s; H200: 141 GB, 4.8 TB/s; B200: 148 SMs, 7.7 TB/s).
GPUS = {
    "a100-40": GPU(
        "NVIDIA A100-SXM4-40GB", (8, 0), 42331013120, 108, 64, 1.41, 1555200000000, 41943040, 167936
    ),
    "a100-80": GPU(
        "NVIDIA A100-SXM4-80GB", (8, 0), 85100068864, 108, 64, 1.41, 2039040000000, 41943040, 167936
    ),
    "h100": GPU(
        "NVIDIA H100 80GB HBM3",
        (9, 0),
        84942979072,
        132,
        128,
        1.98,
        3352320000000,
        52428800,
        233472,
    ),
    "h200": GPU(
        "NVIDIA H200 141GB HBM3e",
        (9, 0),
        151397597184,
        132,
        128,
        1.98,
        4800000000000,
        52428800,
        233472,
    ),
    "b200": GPU(
        "NVIDIA B200", (10, 0), 191514411008, 148, 128, 1.965, 7672320000000, 132644864, 233472
    ),
}
GPU_NAMES = {g.device_kind: name for name, g in GPUS.items()}  # device_kind: name
# The text form of one (the fields the pinned jaxlib parses; XLA's specs carry newer ones it does
# not). cuDNN 9.10 and CUDA 12.8 as XLA's specs say; what jax[cuda12] installs is newer (cuDNN 9.28,
# CUDA 12.9) and takes the same programs
GPU_SPEC = """gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152 threads_per_core_limit: 2048
  shared_memory_per_core: {g.shared_per_core} shared_memory_per_block_optin: {optin}
  core_count: {g.cores} fpus_per_core: {g.fpus_per_core} clock_rate_ghz: {g.clock_ghz}
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: {g.bandwidth} l2_cache_size: {g.l2} device_memory_size: {g.memory}
  cuda_compute_capability {{ major: {g.capability[0]} minor: {g.capability[1]} }}
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}}
platform_name: "CUDA" dnn_version_info {{ major: 9 minor: 10 }} runtime_version {{ major: 12 minor: 8 }}
device_description_str: "{g.device_kind}"
"""  # noqa: E501


def gpu_usable(memory):
    """Of a GPU's `memory`, the bytes JAX's allocator lets a program use:
    XLA_PYTHON_CLIENT_MEM_FRACTION of it (JAX's default 0.75), what a GPU's memory_stats() reports
    as bytes_limit and train.py checks the step against."""
    return round(memory * float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75")))


def gpu_devices(name, n=1):
    """n compile-only devices of the GPU `name` (GPUS): one node of n GPUs (8 at most), or nodes of
    8. A mesh of them takes abstract inputs only, as a TPU topology's (topology_devices)."""
    if name not in GPUS:
        raise UsageError(f"unknown GPU {name!r}: give one of {', '.join(GPUS)}")
    if n < 1 or (n > 8 and n % 8):
        raise UsageError(f"--gpus={n}: give 1 to 8 (one node), or a multiple of 8 (nodes of 8)")
    if not cuda_plugin_installed():
        raise UsageError(
            f"compiling for {name} needs JAX's CUDA plugin, the cuda extras: pip install -c "
            "constraints.txt -e '.[cuda]' (a venv of its own: make test-gpu-compile)"
        )
    cuda_quiet()
    spec = GPU_SPEC.format(g=GPUS[name], optin=GPUS[name].shared_per_core - 1024)
    try:
        # "1xHxG": H hosts of G GPUs (XLA's GPU topology: slices x hosts x devices per host)
        return topologies.get_topology_desc(
            platform="cuda", target_config=spec, topology=f"1x{max(1, n // 8)}x{min(n, 8)}"
        ).devices
    # the plugin failed its start-up check before cuda_quiet could skip it
    except NotImplementedError:
        raise UsageError(
            f"compiling for {name}: JAX's CUDA plugin did not start in this process; run it with "
            "JAX_PLATFORMS=cpu"
        ) from None


def cuda_quiet():
    """Where JAX's CUDA plugin is installed on a machine with no NVIDIA GPU, skip the plugin's
    start-up check of the CUDA libraries against the GPU's driver: with no driver it fails (cuInit
    error 303), JAX logs a traceback on every start, and the plugin stays unregistered, so nothing
    could be compiled for a GPU. Before JAX's backends start."""
    if cuda_plugin_installed() and not os.path.exists("/dev/nvidiactl"):
        os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")


def cuda_plugin_installed():
    """Whether jax[cuda12]'s plugin is installed (not imported: importing it loads the CUDA
    libraries)."""
    find = importlib.util.find_spec  # of a submodule: imports its package, so that must be there
    return find("jax_plugins") is not None and find("jax_plugins.xla_cuda12") is not None


# the TPU compiler's refusal of a program that does not fit: "... required for HLO temporaries
# (16.16G) exceeds available HBM (15.75G)" or "Used 15.82G of 15.75G hbm" (XLA's sizes: K, M, G, T
# of 1024)
TPU_OUT_OF_MEMORY = [
    re.compile(r"\(([\d.]+)([KMGT])\) exceeds available HBM \(([\d.]+)([KMGT])\)"),
    re.compile(r"Used ([\d.]+)([KMGT]) of ([\d.]+)([KMGT]) hbm"),
]


def tpu_out_of_memory(error):
    """(bytes needed, bytes available) from the TPU compiler's out-of-memory error (a
    JaxRuntimeError or its text); None for any other error."""
    message = str(error)
    if message.startswith("RESOURCE_EXHAUSTED"):
        for pattern in TPU_OUT_OF_MEMORY:
            if m := pattern.search(message):
                return tuple(float(m[i]) * 1024 ** ("KMGT".index(m[i + 1]) + 1) for i in (1, 3))
    return None


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
    (libtpu_quiet); so is the CUDA plugin's failed check where jax[cuda12] is installed without a
    GPU (cuda_quiet)."""
    cuda_quiet()
    with libtpu_quiet():
        jax.devices()


@contextlib.contextmanager
def libtpu_quiet():
    """Around the code that starts libtpu (JAX's backends, a topology): where libtpu is installed on
    a machine with no TPU, its C++ start-up lines (LIBTPU_BANNER, on fd 2) are dropped and every
    other line written to stderr meanwhile is passed on after; and several processes may load it
    (libtpu's /tmp/libtpu_lockfile guards a TPU, of which there is none: without
    ALLOW_MULTIPLE_LIBTPU_LOAD a second process's topology fails with ABORTED). On a TPU VM, or once
    libtpu has started, nothing changes."""
    started = xla_client.pjrt_plugin_loaded("tpu") and xla_client.pjrt_plugin_initialized("tpu")
    if (
        started
        or get_tpu_library_path() is None
        or hardware_utils.num_available_tpu_chips_and_device_id()[0]
    ):
        yield
        return
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    with tempfile.TemporaryFile() as f:
        try:
            with stderr_into(f):
                yield
        finally:
            f.seek(0)
            lines = f.read().decode(errors="replace").splitlines(keepends=True)
            sys.stderr.write("".join(line for line in lines if not LIBTPU_BANNER.search(line)))
            sys.stderr.flush()
