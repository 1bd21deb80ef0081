"""
Memory of the model's training step by XLA's compiled memory analysis: value_and_grad of GPT.loss (the loss
train.py's step differentiates), compiled from abstract inputs only, so nothing is materialized and any machine
can size any model: argument + output + temporaries - aliased bytes, for each remat setting, with and without
the chunked loss. One compilation at a time.

    python bench_memory_model.py                                  # 124M (gpt2), bf16, T 1024, batch 8 16 32 64
    python bench_memory_model.py --batch_sizes 64 --remat block --loss_chunks 128
    python bench_memory_model.py --n_layer 2 --n_embd 64 --n_head 2 --block_size 64 --batch_sizes 4

On a CPU the attention is XLA's (cuDNN's fused kernel needs an NVIDIA GPU and would need less).
"""

import argparse
import time

GIB = 2**30


def step_memory(config, batch_size):
    """{argument, output, temp, alias, peak} bytes of jit(value_and_grad(GPT.loss)) on (batch_size, block_size)
    tokens: XLA's analysis of the compiled step, from ShapeDtypeStructs (float32 params, the config's dtype)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import sharding
    from model import GPT

    graphdef, params = nnx.split(nnx.eval_shape(lambda: GPT(config, nnx.Rngs(0))))  # params: ShapeDtypeStructs
    tokens = jax.ShapeDtypeStruct((batch_size, config.block_size), jnp.int32)

    def loss(params, x, y):
        return nnx.merge(graphdef, params).loss(x, y)

    compiled = jax.jit(jax.value_and_grad(loss)).lower(params, tokens, tokens).compile()
    m = compiled.memory_analysis()
    return {"argument": m.argument_size_in_bytes, "output": m.output_size_in_bytes, "temp": m.temp_size_in_bytes,
            "alias": m.alias_size_in_bytes, "peak": sharding.step_peak_bytes(compiled)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    p.add_argument("--n_layer", type=int, default=12)
    p.add_argument("--n_head", type=int, default=12)
    p.add_argument("--n_embd", type=int, default=768)
    p.add_argument("--vocab_size", type=int, default=50304)
    p.add_argument("--block_size", type=int, default=1024)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--batch_sizes", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--remat", nargs="+", default=["none", "block", "dots"])
    p.add_argument("--loss_chunks", type=int, nargs="+", default=[0, 128], help="positions per chunk; 0 = whole")
    args = p.parse_args(argv)

    from model import GPTConfig

    print(f"{args.n_layer} layers, {args.n_head} heads, n_embd {args.n_embd}, vocab {args.vocab_size}, "
          f"T {args.block_size}, {args.dtype}; GiB by XLA's memory analysis of value_and_grad(loss)")
    print(f"{'batch':>5} {'remat':>6} {'loss_chunk':>10} {'argument':>9} {'output':>8} {'temp':>8} {'peak':>8} "
          f"{'compile s':>9}")
    for batch_size in args.batch_sizes:
        for remat in args.remat:
            for loss_chunk in args.loss_chunks:
                config = GPTConfig(block_size=args.block_size, vocab_size=args.vocab_size, n_layer=args.n_layer,
                                   n_head=args.n_head, n_embd=args.n_embd, dtype=args.dtype, remat=remat,
                                   loss_chunk=loss_chunk)
                t0 = time.time()
                m = step_memory(config, batch_size)
                print(f"{batch_size:>5} {remat:>6} {loss_chunk:>10} {m['argument'] / GIB:>9.2f} "
                      f"{m['output'] / GIB:>8.2f} {m['temp'] / GIB:>8.2f} {m['peak'] / GIB:>8.2f} "
                      f"{time.time() - t0:>9.1f}", flush=True)


if __name__ == "__main__":
    main()
