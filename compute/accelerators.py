"""
The accelerators a program is compiled for, one table per fact: every TPU generation libtpu compiles
for (topology forms, host bounds, HBM) and the NVIDIA GPUs XLA:GPU compiles for from a spec, so that
a step is sized and checked here for a machine that is not here; their compile-only devices
(topology_devices, gpu_devices), the bytes a program may use on a device (usable_bytes), the TPU
compiler's out-of-memory refusal read back (tpu_out_of_memory), and libtpu's and the CUDA plugin's
start-up kept quiet on a machine without their hardware. compute/sharding.py builds meshes of these
devices.
"""

import contextlib
import dataclasses
import importlib.util
import os
import re
import sys
import tempfile

import jax
from jax._src import hardware_utils
from jax._src.cloud_tpu_init import get_tpu_library_path
from jax._src.lib import xla_client
from jax.experimental import topologies

from configurator import UsageError, stderr_into


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
    (sharding.make_mesh(..., devices=)) takes abstract inputs only: an array or a key made on it
    fails, there being no TPU to hold it."""
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
