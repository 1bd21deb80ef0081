"""
Causal self-attention's kernels, and which one a call gets (GPTConfig.attention):
- 'xla': jax.nn.dot_product_attention, XLA's attention with the (B, nh, T, T) scores materialized;
  runs anywhere;
- 'cudnn': cuDNN's fused flash attention through the same call (NVIDIA Ampere+, bf16);
- 'splash': the Pallas splash-attention kernel for TPU (flash attention that skips the masked
  tiles), run in Pallas interpret mode off a TPU so that CPU tests check the same kernel;
- 'auto': the fused kernel where it runs (cudnn on NVIDIA, splash on TPU), else xla. Every kernel:
  scale 1/sqrt(hs), causal, scores and softmax in float32 (splash: its q.k dots accumulate in
  float32). Training with dropout > 0 takes explicit_attention instead: the probabilities
  materialized, for dropout to act on.
"""

import math
import re

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_kernel as splash_kernel,
)
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask
from jax.sharding import PartitionSpec as P

from compute import sharding
from compute.layers import dropout
from configurator import UsageError

# GPTConfig.attention values; "flash" is record 20's only (window_attention.window_flash_attention)
SETTINGS = ("auto", "xla", "cudnn", "splash", "flash")
# splash tiles the sequence in blocks of a multiple of 128 (the TPU's lane width)
SPLASH_MULTIPLE = 128
# The largest head size (n_embd / n_head) splash takes: 256 compiled, fwd+bwd in fp32 and bf16 with
# 512-blocks, for TPU v4, v5e, v5p and v6e; 1024 ran out of v4's and v5p's 16 MiB of scoped VMEM.
# Interpret mode takes any.
SPLASH_MAX_HEAD_SIZE = 256
# TPUs whose kernel compiler (Mosaic) refuses splash in bfloat16 ("E2001: Unsupported matmul RHS
# type on target: vector<128x128xbf16>", libtpu 0.0.42) and takes it in float32; v4 and later take
# both
SPLASH_FLOAT32_ONLY = ("TPU v2", "TPU v3")


def cuda_capability(device):
    """(major, minor) compute capability of an NVIDIA GPU, attached or compiled for without one
    (accelerators.gpu_devices: its client says only 'PJRT C API'); None for any other device (a CPU,
    a TPU, ROCm's 'gfx90a')."""
    m = re.fullmatch(r"(\d+)\.(\d+)", getattr(device, "compute_capability", ""))
    return (int(m[1]), int(m[2])) if m and device.platform in ("gpu", "cuda") else None


def _cudnn_reason(dtype, head_size, capability):
    """Why cuDNN's fused attention (dot_product_attention's implementation='cudnn') cannot run, or
    None. Its limits, from jax/_src/cudnn/fused_attention_stablehlo.py: an NVIDIA GPU of compute
    capability >= 8.0 (Ampere), bf16 inputs, a head size that is a multiple of 8 and <= 128 (<= 256
    from 9.0, Hopper)."""
    head_limit = 256 if capability is not None and capability >= (9, 0) else 128
    if capability is None:
        return "it runs on NVIDIA GPUs only"
    if capability < (8, 0):
        major, minor = capability
        return f"it needs compute capability >= 8.0 (Ampere), this GPU has {major}.{minor}"
    if jnp.dtype(dtype) != jnp.bfloat16:
        return f"it computes in bfloat16 only, dtype is {jnp.dtype(dtype).name!r}"
    if head_size % 8 or head_size > head_limit:
        return (
            f"the head size (n_embd / n_head) must be a multiple of 8 and <= {head_limit}, "
            f"got {head_size}"
        )
    return None


def splash_dtype_reason(dtype, device_kind):
    """Why the splash kernel cannot compute in `dtype` on this device, or None."""
    if device_kind in SPLASH_FLOAT32_ONLY and jnp.dtype(dtype) != jnp.float32:
        name = jnp.dtype(dtype).name
        return f"{device_kind}'s kernel compiler takes it in float32 only, dtype is {name!r}"
    return None


def splash_reason(seq_len, head_size, length_name="the sequence length"):
    """Why the splash kernel cannot take these shapes, or None (any platform: interpret mode off a
    TPU)."""
    if seq_len % SPLASH_MULTIPLE:
        return f"{length_name} must be a multiple of {SPLASH_MULTIPLE}, got {seq_len}"
    if head_size > SPLASH_MAX_HEAD_SIZE:
        return f"the head size (n_embd / n_head) must be <= {SPLASH_MAX_HEAD_SIZE}, got {head_size}"
    return None


def cannot_run(setting, reason, fix="use attention='auto' or 'xla'"):
    return ValueError(f"attention={setting!r} cannot run here: {reason}; {fix}")


def _unknown(setting):
    return ValueError(f"attention must be one of {', '.join(map(repr, SETTINGS))}, got {setting!r}")


def check_setting(
    setting, *, platform, dtype, head_size, block_size, dropout, capability=None, device_kind=None
):
    """Up-front validation of GPTConfig.attention for a run: a one-line ValueError, naming why and
    the fix, when an explicit setting can never run. 'splash' off a TPU is allowed: interpret mode
    (tests)."""
    if setting not in SETTINGS:
        raise _unknown(setting)
    if setting == "splash" and dropout > 0:
        raise cannot_run(
            setting,
            f"the kernel has no attention dropout, dropout is {dropout}",
            "use dropout=0.0, or attention='auto' or 'xla'",
        )
    if setting == "splash" and (reason := splash_reason(block_size, head_size, "block_size")):
        raise cannot_run(setting, reason)
    choose(
        setting,
        platform=platform,
        dtype=dtype,
        seq_len=block_size,
        head_size=head_size,
        capability=capability,
        device_kind=device_kind,
    )


def check_run(config, device):
    """check_setting for a run of `config` (a GPTConfig) on `device`'s kind, as a one-line
    UsageError: before anything is written. Record 20's: window_attention.check_run."""
    try:
        check_setting(
            config.attention,
            platform=device.platform,
            dtype=config.dtype,
            head_size=config.n_embd // config.n_head,
            block_size=config.block_size,
            dropout=config.dropout,
            capability=cuda_capability(device),
            device_kind=device.device_kind,
        )
    except ValueError as e:
        raise UsageError(str(e)) from None


def choose(setting, *, platform, dtype, seq_len, head_size, capability=None, device_kind=None):
    """The kernel for one call's shapes on a device of `platform` and `device_kind` (the target's:
    the mesh being compiled for): 'xla', 'cudnn' or 'splash'. 'auto' takes splash on a TPU where the
    sequence length, head size and its kernel compiler (dtype) allow, cudnn where it runs, else xla
    (CPU, short sequences, decoding, bfloat16 on a TPU v2 or v3). An explicit 'splash' is the kernel
    wherever the call's shapes allow (check_setting holds the training shape to that) and xla for
    the others: HellaSwag's rows, a short prompt. An explicit 'cudnn', or a 'splash' in a dtype the
    TPU cannot compile it in, is a one-line ValueError."""
    splash_dtype = splash_dtype_reason(dtype, device_kind) if platform == "tpu" else None
    if setting == "splash" and splash_dtype:
        raise cannot_run(setting, splash_dtype, "use attention='auto' or 'xla', or dtype='float32'")
    if setting == "splash":
        return "xla" if splash_reason(seq_len, head_size) else "splash"
    if setting == "flash":
        raise cannot_run(
            setting,
            "it is record 20's windowed kernel (arch='speedrun20')",
            "use attention='auto', 'xla', 'cudnn' or 'splash'",
        )
    if setting == "cudnn" and (reason := _cudnn_reason(dtype, head_size, capability)):
        raise cannot_run(setting, reason)
    if setting in ("xla", "cudnn"):
        return setting
    if setting != "auto":
        raise _unknown(setting)
    if platform == "tpu" and splash_dtype is None and splash_reason(seq_len, head_size) is None:
        return "splash"
    return "cudnn" if _cudnn_reason(dtype, head_size, capability) is None else "xla"


def causal_attention(q, k, v, implementation):
    """q, k, v (B, T, nh, hs) in the compute dtype -> (B, T, nh, hs) in v's dtype, with the kernel
    that `choose` named: scale 1/sqrt(hs), causal, scores and softmax in float32."""
    if implementation == "splash":
        return _splash(q, k, v).astype(v.dtype)
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)


def explicit_attention(q, k, v, dropout_rate, key):
    """Causal attention with the probabilities materialized, so that dropout can act on them.
    q, k, v (B, T, nh, hs) -> (B, T, nh, hs); scores and softmax in float32."""
    T, hs = q.shape[1], q.shape[3]
    att = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) / math.sqrt(hs)
    att = jnp.where(jnp.tril(jnp.ones((T, T), bool)), att, -jnp.inf)
    att = dropout(jax.nn.softmax(att, axis=-1), dropout_rate, key).astype(v.dtype)  # (B, nh, T, T)
    return jnp.einsum("bhqk,bkhd->bqhd", att, v)


def attend(q, k, v, setting, dropout_rate=0.0, key=None):
    """Causal attention, q, k, v (B, T, nh, hs) -> (B, T, nh, hs): with dropout on the probabilities
    (training with a key) the explicit path, otherwise the kernel `choose` picks for `setting` on
    the devices the program is compiled for (the mesh's, not the host's: a GPU or TPU may be
    compiled for without one)."""
    if key is not None and dropout_rate > 0.0:
        return explicit_attention(q, k, v, dropout_rate, key)
    device = sharding.target_device()
    kernel = choose(
        setting,
        platform=sharding.target_platform(),
        dtype=q.dtype,
        seq_len=q.shape[1],
        head_size=q.shape[3],
        capability=cuda_capability(device),
        device_kind=device.device_kind,
    )
    return causal_attention(q, k, v, kernel)


def cached_attention(q, k, v, pos):
    """Decoding's attention: q (B*nh, T, hs) at positions pos..pos+T-1, k and v the KV cache
    (B*nh, S, hs) with those positions written in; each query attends to every cached position
    <= its own. dot_product_attention's math, spelled out: with its (B, S, nh, hs) layout XLA:CPU
    copied the whole cache every step; in this layout the cache feeds the dots as it is."""
    T, hs = q.shape[1], q.shape[2]
    att = jnp.einsum("zqd,zkd->zqk", q, k, preferred_element_type=jnp.float32) * (
        1.0 / math.sqrt(hs)
    )
    # (T, S): causal, by absolute positions
    mask = jnp.arange(k.shape[1])[None, :] <= pos + jnp.arange(T)[:, None]
    # (B*nh, T, S), float32 softmax
    att = jax.nn.softmax(jnp.where(mask, att, -jnp.inf), axis=-1).astype(v.dtype)
    return jnp.einsum("zqk,zkd->zqd", att, v)  # (B*nh, T, hs)


def splash_tile(T):
    """Splash's tile along the sequence: 512 where T allows (MaxText's default for it), else 256,
    else 128. Big tiles keep the MXU fed and amortize each grid step's overhead; the causal mask is
    skipped a tile at a time, so bigger ones compute more of the masked half (at T = 1024: 3 of 4
    tiles with 512, 36 of 64 with 128)."""
    return next(b for b in (512, 256, SPLASH_MULTIPLE) if T % b == 0)


def _kernel(T, n_head, interpret):
    """The splash kernel for (n_head, T, hs) inputs, causal. Built at each trace, not cached: it
    holds its mask tables as arrays, which under shard_map are that trace's values."""
    b = splash_tile(T)
    sizes = splash_kernel.BlockSizes(
        block_q=b,
        block_kv=b,
        block_kv_compute=b,
        block_q_dkv=b,
        block_kv_dkv=b,
        block_kv_dkv_compute=b,
        block_q_dq=b,
        block_kv_dq=b,
    )
    mask = splash_mask.MultiHeadMask([splash_mask.CausalMask((T, T))] * n_head)
    return splash_kernel.make_splash_mha(
        mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret
    )


def _splash(q, k, v):
    """Splash attention, each device on its own rows and heads under a mesh (per_device)."""
    interpret = sharding.target_platform() != "tpu"

    def local(q, k, v):  # (b, T, h, hs): this device's rows and heads
        kernel = _kernel(q.shape[1], q.shape[2], interpret)
        # the kernel does not scale the scores
        q = q * jnp.asarray(1 / math.sqrt(q.shape[-1]), q.dtype)
        # (b, h, T, hs): heads-major, as the kernel takes
        q, k, v = (a.transpose(0, 2, 1, 3) for a in (q, k, v))
        return jax.vmap(kernel)(q, k, v).transpose(0, 2, 1, 3)  # (b, T, h, hs)

    return per_device(local, q, k, v)


def per_device(local, q, k, v, docs=None, window=None):
    """local(q, k, v[, docs, window]) on each device's own rows (over data x fsdp) and heads (over
    tensor) under a mesh; q, k, v (B, T, nh, hs), docs (B, T), window a scalar."""
    extra = () if docs is None else (docs, window)
    if sharding.target_size() == 1:
        return local(q, k, v, *extra)
    # an axis that does not divide its dimension is dropped: those rows or heads are whole on every
    # device
    spec = sharding.fit(
        P(sharding.BATCH, None, "tensor", None), q.shape, jax.sharding.get_abstract_mesh()
    )
    specs = (spec,) * 3 + ((P(spec[0], None), P()) if extra else ())
    # check_vma off: the kernel's pallas_calls do not declare how their outputs vary over the mesh
    return jax.shard_map(local, in_specs=specs, out_specs=spec, check_vma=False)(q, k, v, *extra)
