"""
nanochat's RL on GSM8K (scripts/chat_rl.py): our step (archs/nanochat_rl.py) against a torch side
on the same samples, float32: each micro-batch's loss, the advantages, and every tensor after the
steps. The samples are fixed (token sequences, their masks and rewards), so the sampling's
randomness is out of it; the engine that samples them is checked on its own (docs/chat.md).

- Without --own: the torch reference written by reading chat_rl.py (parity/chat_rl_reference.py)
  on a tiny nanochat GPT of random weights and random samples: 2 steps of 2 questions x 4 samples
  in micro-batches of 2, the second step's rate at half the first's.
- With --own CHECKOUT: nanochat's own scripts/chat_rl.py, run as its command (runpy) over its own
  GPT, GSM8K task, reward and MuonAdamW (setup_optimizer), the Engine's generate_batch replaced by
  one that returns our fixed samples (completions with the right '####' answer or a wrong one,
  a tool call's forced output in some), every loss it backpropagates and reward it computes
  recorded; its chatrl checkpoint after the last step against ours. The base: its own init at
  depth 3, zero projections drawn (parity/nanochat_own_run.py start), as its chatsft checkpoint;
  the tokenizer and GSM8K rows made here (dataio/toy_tasks.py).

    python -m parity.check_chat_rl
    python -m parity.check_chat_rl --own ../nanochat
    python -m parity.check_chat_rl --slip=no_mean     # advantages without the mean: exits 1

Exit code: 0 parity holds, 1 a tolerance is exceeded, 2 bad input.
"""

import argparse
import json
import os
import sys
import tempfile

import jax.numpy as jnp
import numpy as np
from flax import nnx

from archs import nanochat_rl
from archs.nanochat import NanochatGPT
from configurator import UsageError, exit_on_bad_input, require_extras
from parity.check_nanochat_run import run
from parity.common import pin_numerics, verdict

TINY = dict(
    sequence_len=64, vocab_size=200, n_layer=3, n_head=2, n_kv_head=1, n_embd=32, window_pattern="L"
)
PAD = 199  # the tiny runs' <|assistant_end|>
SAMPLES, ROWS, QUESTIONS, STEPS = 4, 2, 2, 2  # num_samples, device_batch_size, examples_per_step
# float32 on both sides. The loss: a sum of ~100 log-probabilities of scale 5 times advantages of
# either sign, whose relative rounding on each side is ~1e-7: 1e-6 holds it with room, where a
# wrong normaliser or a missing mean moves it by 10% or more.
LOSS_RTOL = 1e-6
# Each tensor after the steps: AdamW's first step moves an element by lr g / (|g| + 1e-10), Muon's
# orthogonalises the whole matrix; where both sides' float32 gradients agree to ~1e-6 relative the
# updates agree to ~1e-6 of the distance moved: 1e-4 of the tensor's largest distance moved, plus
# two float32 roundings of its largest value, holds that and catches any update a slip changes (a
# wrong rate, a wrong sign, a missing mean: all O(1) of it).
MOVED_RTOL = 1e-4
# But AdamW divides each element's gradient by the element's own RMS, while a gradient's rounding
# is ~1e-7 of its tensor's largest (sums of terms of that size): an element whose gradient is
# r times smaller than that largest moves by an amount rounding shifts by ~1e-7 r of the distance
# (nanochat's own run: a wte element of gradients 2.5e-4 of the largest moved 1.7e-4 of the
# distance apart). So each AdamW element is held to 1e-4 + ROUND x r of the distance moved (r its
# largest over the steps, our gradients'; at most the distance; a zero gradient, a token absent,
# is exact on both sides), ROUND 1e-6: float32's eps x 8, for sums of many terms.
ROUND = 1e-6
EPS32 = float(np.finfo(np.float32).eps)
SLIPS = {
    "no_mean": "advantages without the mean subtracted (the rewards themselves)",
    "sequence_mean": "the loss normalised per micro-batch only (not by micro-batches x questions)",
}


def random_questions(seed, steps=STEPS, questions=QUESTIONS, samples=SAMPLES, vocab=200, pad=PAD):
    """[step][question] = (sequences, masks, rewards): a shared prompt (mask 0), completions of
    different lengths (mask 1) with a stretch of forced tokens (mask 0, the tool's output) in some;
    rewards 0 or 1 (one question of all-equal rewards: advantages 0)."""
    rng = np.random.default_rng(seed)
    plan = []
    for step in range(steps):
        batch = []
        for q in range(questions):
            prompt = rng.integers(0, pad, rng.integers(5, 12)).tolist()
            sequences, masks = [], []
            for _ in range(samples):
                n = int(rng.integers(3, 30))
                sampled = rng.integers(0, pad, n).tolist()
                mask = [1] * n
                if n > 10 and rng.random() < 0.5:  # a forced stretch
                    at = int(rng.integers(2, n - 5))
                    mask[at : at + 4] = [0] * 4
                sequences.append(prompt + sampled)
                masks.append([0] * len(prompt) + mask)
            rewards = [0.0] * samples if (step, q) == (1, 1) else rng.integers(0, 2, samples)
            batch.append((sequences, masks, [float(r) for r in rewards]))
        plan.append(batch)
    return plan


def random_state(seed=0, config=TINY):
    """nanochat's state dict {name: float32 numpy} of the reference GPT, every tensor moved by
    noise (check_nanochat.perturbed: none zero or constant)."""
    import torch

    from parity import nanochat_reference
    from parity.check_nanochat import perturbed

    torch.manual_seed(seed)
    model = nanochat_reference.GPT(nanochat_reference.Config(**config))
    return perturbed({k: v.numpy().copy() for k, v in model.state_dict().items()}, seed)


STEPPERS = {}  # (config, num_steps, rates) -> (optimizer, RLStep): a slip's run compiles nothing


def stepper(model, num_steps, rates):
    """The optimizer and the jitted step of `model`'s structure, made once per process."""
    key = (repr(model.config), num_steps, rates)
    if key not in STEPPERS:
        tx = nanochat_rl.optimizer(model.config.n_embd, num_steps, **dict(rates))
        STEPPERS[key] = tx, nanochat_rl.RLStep(model, tx)
    return STEPPERS[key]


def our_steps(
    config, state, plan, pad_id, rates=None, slip=None, num_steps=None, rows=ROWS, length=None
):
    """Our RL steps over `plan` from nanochat's `state` -> (each micro-batch's loss, each
    question's advantages, the state dict after the last step, {AdamW tensor: each element's
    largest ratio over the steps of the tensor's largest gradient to its own (ROUND)})."""
    model, scratch = (NanochatGPT.from_nanochat(config, state) for _ in range(2))
    tx, step = stepper(model, num_steps or len(plan), tuple(sorted((rates or {}).items())))
    params = nnx.state(model)
    opt_state = tx.init(params)
    losses, advantages, rounding = [], [], {}
    for questions in plan:
        grads = step.zero_grads(params)
        for sequences, masks, rewards in questions:
            inputs, targets = nanochat_rl.rollout_batch(sequences, masks, pad_id, length)
            adv = nanochat_rl.advantages(rewards)
            adv = jnp.asarray(rewards, jnp.float32) if slip == "no_mean" else adv
            advantages.append(np.asarray(adv))
            passes = len(sequences) // rows
            scale = 1 if slip == "sequence_mean" else passes * len(questions)
            for p in range(passes):
                b = slice(p * rows, (p + 1) * rows)
                loss, grads = step.gradients(params, inputs[b], targets[b], adv[b], scale, grads)
                losses.append(float(loss))
        params, opt_state = step.update(params, opt_state, grads)
        nnx.update(scratch, grads)  # the gradients under nanochat's names
        for name, g in scratch.nanochat_state().items():
            if not name.startswith("transformer.h."):  # the blocks' matrices are Muon's
                with np.errstate(divide="ignore", invalid="ignore"):
                    ratio = np.where(g != 0, np.abs(g).max() / np.abs(g), 0.0)
                rounding[name] = np.maximum(rounding.get(name, 0.0), ratio)
    nnx.update(model, params)
    return losses, advantages, model.nanochat_state(), rounding


def reference_steps(config, state, plan, pad_id, rates=None, num_steps=None, rows=ROWS):
    """The same steps by parity/chat_rl_reference.py -> (losses, advantages, state)."""
    import torch

    from parity import chat_rl_reference, nanochat_reference

    model = nanochat_reference.GPT(nanochat_reference.Config(**config))
    model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in state.items()})
    optimizer = chat_rl_reference.make_optimizer(model, rates)
    losses, advantages = [], []
    for i, questions in enumerate(plan):
        step_losses, adv = chat_rl_reference.rl_step(
            model, optimizer, questions, rows, i, num_steps or len(plan), pad_id
        )
        losses += step_losses
        advantages += [a.numpy() for a in adv]
    return losses, advantages, {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def compare(ours, theirs, start):
    """Figures of ours (our_steps') against theirs ((losses, advantages, state)) from `start`: the
    largest relative loss difference, whether the advantages are equal, and per tensor (largest
    difference, the tolerance there, distance moved, elements held to 1e-3 of it or more)."""
    our_losses, our_adv, our_state, rounding = ours
    losses, adv, state = theirs
    # a question of all-equal rewards has a loss of 0: compared absolutely
    loss_rel = max(abs(a - b) / (abs(b) or 1.0) for a, b in zip(our_losses, losses))
    same_adv = len(our_adv) == len(adv) and all(np.array_equal(a, b) for a, b in zip(our_adv, adv))
    tensors = {}
    for name, value in state.items():
        if name not in our_state:
            continue
        moved = float(np.abs(value.astype(np.float64) - start[name]).max())
        diff = np.abs(our_state[name].astype(np.float64) - value)
        relative = np.minimum(MOVED_RTOL + ROUND * rounding.get(name, 0.0), 1.0)
        tol = 2 * EPS32 * float(np.abs(value).max()) + relative * moved
        at = np.unravel_index(np.argmax(diff / tol), diff.shape)
        tensors[name] = (float(diff[at]), float(np.broadcast_to(tol, diff.shape)[at]), moved)
        tensors[name] += (int(np.sum(relative >= 1e-3)), float(diff.max()))
    return {"loss_rel": loss_rel, "same_advantages": same_adv, "tensors": tensors}


def within(figures, n_losses, n_expected):
    return (
        n_losses == n_expected
        and figures["loss_rel"] <= LOSS_RTOL
        and figures["same_advantages"]
        and all(t[0] <= t[1] for t in figures["tensors"].values())
    )


def print_figures(figures, what):
    tensors = figures["tensors"]
    worst = max(tensors, key=lambda k: tensors[k][0] / max(tensors[k][1], 1e-30))
    largest = max(tensors, key=lambda k: tensors[k][4])
    loose = sum(t[3] for t in tensors.values())
    print(f"  every micro-batch's loss: largest relative difference {figures['loss_rel']:.2e}")
    print(f"  advantages {'equal' if figures['same_advantages'] else 'DIFFER'}")  # bitwise
    print(
        f"  {len(tensors)} tensors after the steps: largest difference {tensors[largest][4]:.2e} "
        f"({largest}, moved {tensors[largest][2]:.2e}); nearest its tolerance: {worst} "
        f"{tensors[worst][0]:.2e} of {tensors[worst][1]:.2e} ({loose} AdamW elements of small "
        "gradients held to 1e-3 of the distance moved or more)"
    )
    print(f"  against {what}")


def check_reference(slip=None):
    state, plan = random_state(0), random_questions(1)
    ours = our_steps(TINY, state, plan, PAD, slip=slip, length=TINY["sequence_len"])
    theirs = reference_steps(TINY, state, plan, PAD)
    start = {k: v.astype(np.float64) for k, v in state.items()}
    figures = compare(ours, theirs, start)
    return figures, within(figures, len(ours[0]), len(theirs[0]))


# --- nanochat's own chat_rl.py
OWN = dict(depth=3, aspect_ratio=32, head_dim=32, seq=128)  # n_embd 96, 3 heads
TRAIN_ROWS = 4  # GSM8K train rows: 2 steps of 2 questions
OWN_FLAGS = (  # chat_rl's own flags: 2 steps, pass@k on one test question, saved at the end
    "--device-type=cpu --eval-examples=1 --save-every=1000 --max-new-tokens=32 "
    f"--examples-per-step={QUESTIONS} --num-samples={SAMPLES} --device-batch-size={ROWS}"
).split()


def completions(tokenizer, conversation, rng):
    """SAMPLES completions of one GSM8K question as (ids, mask): '#### ' the right answer in some,
    a wrong one in others, one with a calculator call whose output (with its delimiters) is
    forced."""
    from dataio.hub_tasks import extract_answer

    right = extract_answer(conversation["messages"][-1]["content"][-1]["text"])
    special = tokenizer.encode_special
    found = []
    for i in range(SAMPLES):
        answer = right if rng.random() < 0.5 else str(int(right) + int(rng.integers(1, 9)))
        words = " ".join(["so"] * int(rng.integers(1, 6)))
        if i == 1:  # a tool call: <|python_start|>6*7<|python_end|> then its forced output
            call = [
                special("<|python_start|>"),
                *tokenizer.encode("6*7"),
                special("<|python_end|>"),
            ]
            output = [
                special("<|output_start|>"),
                *tokenizer.encode("42"),
                special("<|output_end|>"),
            ]
            tail = tokenizer.encode(f" {words}\n#### {answer}")
            ids, mask = call + output + tail, [1] * len(call) + [0] * len(output) + [1] * len(tail)
        else:
            ids = tokenizer.encode(f"It is {words}.\n#### {answer}")
            mask = [1] * len(ids)
        found.append((ids, mask))
    return found


def own_plan(base, seed=0):
    """The GSM8K train rows in nanochat's order, each question's prompt and samples (prompt +
    completion, as the engine returns them), their masks and our rewards -> ([step][question] =
    (sequences, masks, rewards), {prompt: (sequences, masks)} for nanochat's patched engine, the
    padding id)."""
    from dataio.chat_tokenizer import ChatTokenizer
    from dataio.conversations import render_for_completion
    from dataio.hub_tasks import GSM8K
    from dataio.task_folder import dataset_folder

    tokenizer = ChatTokenizer.from_directory(os.path.join(base, "tokenizer"))
    task = GSM8K(dataset_folder(base, GSM8K), "main", "train")
    rng = np.random.default_rng(seed)
    questions, engine = [], {}
    for index in range(len(task)):
        conversation = task[index]
        prompt = render_for_completion(tokenizer, conversation)
        sequences, masks, rewards = [], [], []
        for ids, mask in completions(tokenizer, conversation, rng):
            sequences.append(prompt + ids)
            masks.append([0] * len(prompt) + mask)
            rewards.append(task.reward(conversation, tokenizer.decode(ids)))
        questions.append((sequences, masks, rewards))
        engine[",".join(map(str, prompt))] = (sequences, masks)
    plan = [questions[i : i + QUESTIONS] for i in range(0, len(questions), QUESTIONS)]
    return plan, engine, tokenizer.encode_special("<|assistant_end|>")


def prepare_own(folder, checkout):
    """nanochat's base directory: a tokenizer, GSM8K rows, and its own init as the chatsft
    checkpoint chat_rl loads."""
    from dataio import toy_tasks
    from dataio.chat_tokenizer import ChatTokenizer

    base = os.path.join(folder, "base")
    toy_tasks.write_task_cache(base, {"smoltalk": 1, "mmlu": 1, "gsm8k": TRAIN_ROWS})
    texts = [f"{a} boxes of {a % 9} apples, {a % 7} more? so It is #### {a}" for a in range(999)]
    tokenizer = ChatTokenizer.train(iter(texts), 512)  # as many merges as the text has
    tokenizer.save(os.path.join(base, "tokenizer"))
    start = os.path.join(base, "chatsft_checkpoints", f"d{OWN['depth']}")
    shape = [f"--{k}={v}" for k, v in OWN.items()] + [f"--vocab={tokenizer.n_vocab}"]
    command = [sys.executable, "-m", "parity.nanochat_own_run", "start", "--checkout", checkout]
    run([*command, "--out", start, *shape], "nanochat's init", own_env(base))
    return base, start


def own_env(base, threads=2):
    # TORCHDYNAMO_DISABLE: its fused optimizer steps eager, the same float32 arithmetic
    env = dict(NANOCHAT_BASE_DIR=base, NANOCHAT_DTYPE="float32", TORCHDYNAMO_DISABLE="1")
    return dict(os.environ, **env, OMP_NUM_THREADS=str(threads))


def nanochat_side(spec_path):
    """In its own process: scripts/chat_rl.py run as its command, its Engine.generate_batch
    returning the spec's samples, each loss it backpropagates and each reward it computes
    recorded."""
    import runpy

    import torch

    with open(spec_path) as f:
        spec = json.load(f)
    torch.set_num_threads(spec["threads"])
    sys.path.insert(0, os.path.abspath(spec["checkout"]))
    sys.modules.setdefault("wandb", type(sys)("wandb"))  # imported, unused at --run=dummy
    from nanochat import engine
    from tasks import gsm8k

    served, losses, rewards = {}, [], []

    def generate_batch(self, tokens, num_samples=1, **settings):
        key = ",".join(map(str, tokens))
        if key not in spec["samples"]:  # pass@k's evaluation: an empty answer
            return [list(tokens)] * num_samples, [[0] * len(tokens)] * num_samples
        sequences, masks = spec["samples"][key]
        start = served.get(key, 0)
        served[key] = start + num_samples
        return sequences[start : start + num_samples], masks[start : start + num_samples]

    own_reward, own_backward = gsm8k.GSM8K.reward, torch.Tensor.backward

    def reward(task, conversation, response):
        rewards.append(own_reward(task, conversation, response))
        return rewards[-1]

    def backward(loss, *args, **kwargs):
        losses.append(loss.item())
        return own_backward(loss, *args, **kwargs)

    engine.Engine.generate_batch, gsm8k.GSM8K.reward = generate_batch, reward
    torch.Tensor.backward = backward
    sys.argv = ["scripts/chat_rl.py", *spec["argv"]]
    try:
        runpy.run_module("scripts.chat_rl", run_name="__main__")
    finally:
        with open(spec["out"], "w") as f:
            json.dump({"losses": losses, "rewards": rewards}, f)


def check_own(checkout, folder, slip=None):
    """Ours and the reference against nanochat's own chat_rl.py -> (figures of ours, of the
    reference, ok)."""
    import torch

    if not os.path.isfile(os.path.join(checkout, "scripts", "chat_rl.py")):
        raise UsageError(f"--own {checkout}: no scripts/chat_rl.py there (a nanochat checkout?)")
    checkout = os.path.abspath(checkout)
    base, start = prepare_own(folder, checkout)
    plan, samples, pad = own_plan(base)
    spec = dict(checkout=checkout, samples=samples, threads=2, argv=OWN_FLAGS)
    spec["out"] = os.path.join(folder, "nanochat_rl.json")
    with open(os.path.join(folder, "spec.json"), "w") as f:
        json.dump(spec, f)
    command = [sys.executable, "-m", "parity.check_chat_rl", "--nanochat_side"]
    run([*command, os.path.join(folder, "spec.json")], "nanochat's chat_rl.py", own_env(base))
    with open(spec["out"]) as f:
        recorded = json.load(f)
    last = len(plan) - 1
    saved = os.path.join(base, "chatrl_checkpoints", f"d{OWN['depth']}", f"model_{last:06d}.pt")
    their_state = {k: v.numpy() for k, v in torch.load(saved, map_location="cpu").items()}
    with open(os.path.join(start, "meta_000000.json")) as f:
        config = json.load(f)["model_config"]
    weights = torch.load(os.path.join(start, "model_000000.pt"), map_location="cpu")
    state = {k: v.float().numpy() for k, v in weights.items()}
    ours = our_steps(config, state, plan, pad, slip=slip)
    ref = reference_steps(config, state, plan, pad)
    # its advantages stay inside its get_batch: worked out from the rewards it computed, as it does
    their_rewards = np.array(recorded["rewards"], np.float32).reshape(-1, SAMPLES)
    theirs = (recorded["losses"], [r - r.mean() for r in their_rewards], their_state)
    start64 = {k: v.astype(np.float64) for k, v in state.items()}
    our_rewards = [r for questions in plan for _, _, rs in questions for r in rs]
    figures = compare(ours, theirs, start64)
    figures["same_rewards"] = our_rewards == recorded["rewards"]
    figures["rewards"] = (sum(our_rewards), len(our_rewards))
    ref_figures = compare((*ref, ours[3]), theirs, start64)
    ok = within(figures, len(ours[0]), len(recorded["losses"])) and figures["same_rewards"]
    return figures, ref_figures, ok


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--nanochat_side"]:
        return nanochat_side(argv[1])
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    p.add_argument("--own", metavar="CHECKOUT", help="a nanochat checkout: its own chat_rl.py")
    p.add_argument("--slip", choices=sorted(SLIPS), help="ours with a known slip: must fail")
    p.add_argument("--work", help="keep the work folder here (--own)")
    args = p.parse_args(argv)
    require_extras("parity")
    pin_numerics()
    what = f" with a slip: {SLIPS[args.slip]}" if args.slip else ""
    if not args.own:
        figures, ok = check_reference(args.slip)
        print(
            f"nanochat's RL step{what}: ours vs parity/chat_rl_reference.py, depth 3, {STEPS} "
            f"steps of {QUESTIONS} questions x {SAMPLES} samples, {ROWS} a micro-batch, float32"
        )
        print_figures(figures, "the torch reference")
        return 0 if verdict(ok, "nanochat's RL step") else 1
    with tempfile.TemporaryDirectory() as temporary:
        folder = args.work or temporary
        os.makedirs(folder, exist_ok=True)
        figures, ref_figures, ok = check_own(args.own, folder, args.slip)
    right, total = figures["rewards"]
    print(
        f"nanochat's RL on GSM8K{what}: ours vs its own scripts/chat_rl.py, depth {OWN['depth']}, "
        f"{TRAIN_ROWS // QUESTIONS} steps of {QUESTIONS} questions x {SAMPLES} fixed samples, "
        f"{ROWS} a micro-batch, float32"
    )
    print(f"  rewards: {'equal' if figures['same_rewards'] else 'DIFFER'} ({right:.0f}/{total})")
    print_figures(figures, "nanochat's own chat_rl.py (ours)")
    print_figures(ref_figures, "nanochat's own chat_rl.py (parity/chat_rl_reference.py)")
    return 0 if verdict(ok, "nanochat's RL step") else 1


if __name__ == "__main__":
    exit_on_bad_input(main)
