"""Programs compiled for an accelerator this machine does not have (libtpu's compiler for a TPU
topology, XLA:GPU's for a GPU spec), for test_tpu.py, test_tpu_commands.py and test_gpu.py: the
train step and sample.py's generation over abstract params placed by the sharding table."""

import math

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax._src import config as jax_config

from compute import generate, sharding
from model import GPT
from run import train_step
from run.settings import DEFAULTS

TOPOLOGY = "v5e:2x2"
T = 128  # splash attention's blocks are 128 positions


@pytest.fixture(autouse=True)
def no_cache_entries():
    """JAX's persistent compilation cache (tests/conftest.py) would store these TPU executables but
    cannot load them back (a compile-only client): keep them out of it."""
    with jax_config.persistent_cache_min_compile_time_secs(math.inf):
        yield


def abstract_model(config, mesh):
    """(graphdef, params): ShapeDtypeStructs placed by the table's shardings, as
    bench.train_workers.bench_memory's."""
    graphdef, params = nnx.split(nnx.eval_shape(lambda: GPT(config, nnx.Rngs(0))))
    return graphdef, sharding.abstract(params, sharding.shardings_for(params, mesh))


def compile_train_step(config, mesh, settings=DEFAULTS):
    """(compiled step, state bytes per device, params, opt_state, batch, step peak bytes) of
    train.py's step, 2 rows per batch shard, with the optimizer of train.py's `settings`."""
    graphdef, params = abstract_model(config, mesh)
    tx = train_step.make_optimizer(dict(settings))
    opt_state = jax.eval_shape(tx.init, params)
    opt_state = sharding.abstract(opt_state, sharding.shardings_for(opt_state, mesh))
    batch = jax.ShapeDtypeStruct(
        (1, 2 * sharding.batch_shards(mesh), T), jnp.int32, sharding=sharding.batch_sharding(mesh)
    )
    step = train_step.make_train_step(graphdef, tx, grad_clip=1.0)
    compiled, state, peak = train_step.compile_step(
        step, params, opt_state, batch.shape, batch.sharding
    )
    return compiled, state, params, opt_state, batch, peak


def compile_generate(config, mesh):
    """sample.py's generation (generate.generate_in_jit: the prompt prefilled into the KV cache,
    then sampled token by token, top_k) for 2 prompts, compiled; its weights split as the train
    step's."""
    graphdef, params = abstract_model(config, mesh)
    replicated = sharding.replicated(mesh)
    # 2 prompts, then their samples
    buf = jax.ShapeDtypeStruct((2, T), jnp.int32, sharding=replicated)
    prompt_len = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=replicated)
    with jax.set_mesh(mesh):
        lowered = generate.generate_in_jit.lower(
            nnx.merge(graphdef, params),
            buf,
            prompt_len,
            key,
            sampling=(0.8, 10, None, None),
            use_cache=True,
            on_token=None,
            return_logits=False,
        )
    return lowered.compile().compiled  # nnx's Compiled wraps jax's
