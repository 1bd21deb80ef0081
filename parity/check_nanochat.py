"""
nanochat's GPT: ours (archs/nanochat.py, arch='nanochat') against a torch side from the same
weights, float32 on both sides: the logits, the loss, and greedy generation through each side's KV
cache.
The weights are drawn twice, by the torch side's init and by ours, each then moved by noise so no
tensor stays zero or constant (nanochat's zero projections would hide the blocks), and go across as
nanochat's state dict. The tiny config has grouped key/value heads and short windows (128 tokens)
that bite on its 200-token sequences; the prompt runs past the short window too.

    python -m parity.check_nanochat                    # the torch reference written by reading
    python -m parity.check_nanochat --own ../nanochat  # nanochat's own gpt.py and Engine

Exit code: 0 parity holds, 1 a tolerance is exceeded, 2 bad input.
"""

import argparse
import os
import sys

import numpy as np

from configurator import UsageError, exit_on_bad_input, require_extras
from parity.common import max_abs, pin_numerics, print_table, verdict

TINY = dict(
    sequence_len=256,
    vocab_size=200,
    n_layer=3,
    n_head=4,
    n_kv_head=2,
    n_embd=64,
    window_pattern="SSL",
)
SEQ = 200  # past the short window (128): the short layers' mask bites
PROMPT, NEW_TOKENS = 150, 40
# float32 on both sides: logits of scale ~5 after three layers differ by rounding (~1e-6 seen);
# 2e-5 is ~100 float32 ulps at that scale, far below any real difference (a wrong window, gate or
# sign moves logits by 1e-2 or more)
LOGIT_TOL = 2e-5
LOSS_TOL = 1e-5
NOISE = {"lm_head.weight": 0.5}  # the head's std: logits reach the soft cap's curve
NOISE_STD = 0.1  # every other tensor's


def perturbed(state, seed):
    """nanochat's state dict {name: float32 numpy} with N(0, std) noise added to every tensor."""
    rng = np.random.default_rng(seed)
    return {
        k: (v + NOISE.get(k, NOISE_STD) * rng.standard_normal(v.shape)).astype(np.float32)
        for k, v in state.items()
    }


class OwnCode:
    """nanochat's own gpt.py and engine.py from a checkout (CPU, float32)."""

    def __init__(self, checkout):
        if not os.path.isfile(os.path.join(checkout, "nanochat", "gpt.py")):
            raise UsageError(f"--own {checkout}: no nanochat/gpt.py there (a nanochat checkout?)")
        os.environ["NANOCHAT_DTYPE"] = "float32"  # its import fixes its dtype: this check's
        sys.path.insert(0, os.path.abspath(checkout))
        from nanochat import engine, gpt

        self.gpt, self.engine = gpt, engine

    def model(self, config, state=None):
        torch_model = self.gpt.GPT(self.gpt.GPTConfig(**config))
        torch_model.init_weights()
        if state is not None:
            torch_model.load_state_dict(torch_state(state), strict=True)
        return torch_model.eval()

    def greedy(self, model, prompt, steps):
        """nanochat's Engine.generate at temperature 0 (argmax), one row."""
        tokens = list(map(int, prompt[0]))
        run = self.engine.Engine(model, NoTools()).generate(tokens, max_tokens=steps, temperature=0)
        return np.array([tokens + [column[0] for column, _ in run]])


class NoTools:
    """The tokenizer Engine asks for its special tokens: none of them is ever generated."""

    def encode_special(self, name):
        return -1

    def get_bos_token_id(self):
        return -1


class Reference:
    """parity/nanochat_reference.py."""

    def model(self, config, state=None):
        from parity import nanochat_reference

        torch_model = nanochat_reference.GPT(nanochat_reference.Config(**config))
        if state is not None:
            torch_model.load_state_dict(torch_state(state), strict=True)
        return torch_model.eval()

    def greedy(self, model, prompt, steps):
        import torch

        return model.greedy(torch.from_numpy(prompt).long(), steps).numpy()


def torch_state(state):
    import torch

    return {k: torch.from_numpy(np.array(v)) for k, v in state.items()}


def compare(side, config, state, seed):
    """One set of weights on both sides -> (max |logit diff|, |loss diff|, greedy equal, cached
    equal to ours uncached)."""
    import jax.numpy as jnp
    import torch

    from archs.nanochat import NanochatGPT
    from compute import generate

    rng = np.random.default_rng(seed)
    idx = rng.integers(0, config["vocab_size"], (2, SEQ))
    targets = np.roll(idx, -1, axis=1)
    targets[:, ::7] = -1  # some ignored
    torch_model = side.model(config, state)
    ours = NanochatGPT.from_nanochat(config, state)
    with torch.no_grad():
        torch_logits = torch_model(torch.from_numpy(idx)).numpy()
        torch_loss = float(torch_model(torch.from_numpy(idx), torch.from_numpy(targets)))
    logits, loss = ours(jnp.asarray(idx), jnp.asarray(targets))
    prompt = idx[:1, :PROMPT]
    torch_ids = side.greedy(torch_model, prompt, NEW_TOKENS)
    cached = generate.generate(ours, prompt, NEW_TOKENS, temperature=0)
    full = generate.generate(ours, prompt, NEW_TOKENS, temperature=0, use_cache=False)
    return (
        max_abs(torch_logits, logits),
        abs(torch_loss - float(loss)),
        bool(np.array_equal(torch_ids, cached)),
        bool(np.array_equal(cached, full)),
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--own", metavar="CHECKOUT", help="nanochat's own code from a checkout")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    require_extras("parity")
    import torch
    from flax import nnx

    from archs.nanochat import NanochatGPT, config_from_nanochat

    pin_numerics()
    side = Reference() if args.own is None else OwnCode(args.own)
    name = "nanochat's own gpt.py" if args.own else "parity/nanochat_reference.py"
    torch.manual_seed(args.seed)
    inits = {
        "torch's init": {k: v.numpy() for k, v in side.model(TINY).state_dict().items()},
        "our init": NanochatGPT(config_from_nanochat(TINY), nnx.Rngs(args.seed)).nanochat_state(),
    }
    rows, ok = [], True
    for init, state in inits.items():
        dlogit, dloss, same, cached = compare(side, TINY, perturbed(state, args.seed), args.seed)
        rows.append([init, dlogit, dloss, str(same), str(cached)])
        ok &= dlogit <= LOGIT_TOL and dloss <= LOSS_TOL and same and cached
    print(f"ours (JAX, float32) vs {name} (float32), config {TINY}, T={SEQ}")
    headers = ["weights", "max |dlogit|", "|dloss|", "greedy == torch's", "cache == full"]
    print_table(rows, headers)
    print(f"tolerances: logits {LOGIT_TOL:g}, loss {LOSS_TOL:g}; greedy tokens equal")
    return 0 if verdict(ok, "nanochat parity") else 1


if __name__ == "__main__":
    exit_on_bad_input(main)
