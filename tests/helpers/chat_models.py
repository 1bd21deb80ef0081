"""Tiny chat models for the chat tests: nanochat's tokenizer trained on a few lines, and a nanochat
GPT (parity/nanochat_reference.py's, in torch) trained on one conversation until its greedy answer
is that conversation's, a call of the Python tool included. Made in a few seconds, deterministic,
nothing cached outside the test."""

import torch

from dataio.chat_tokenizer import SPECIAL_TOKENS, ChatTokenizer
from dataio.conversations import render_conversation
from parity import nanochat_reference as ref

VOCAB = 256 + len(SPECIAL_TOKENS) + 60  # the bytes, the specials and a few merges: fast to train
CORPUS = ["what is 12*7? It is 84. Let me compute that.", "hello world, hello tokenizer"] * 8
# the assistant calls the calculator, reads its output and answers
TOOL_CONVERSATION = {
    "messages": [
        {"role": "user", "content": "what is 12*7?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me compute: "},
                {"type": "python", "text": "12*7"},
                {"type": "python_output", "text": "84"},
                {"type": "text", "text": "It is 84."},
            ],
        },
    ]
}
# nanochat's GPTConfig fields: grouped key/value heads, the last layer with a value embedding
TOOL_CONFIG = dict(sequence_len=64, n_layer=2, n_head=2, n_kv_head=1, n_embd=32, window_pattern="L")
MAX_STEPS = 500  # Adam steps at most; about 50 memorise the conversation
# the right token's logit ahead of every other by this much: the two sides' float32 logits differ by
# ~1e-5, so their greedy answers cannot part over a near tie
MARGIN = 1.0


def tiny_tokenizer():
    return ChatTokenizer.train(iter(CORPUS), VOCAB)


def tool_model(tokenizer, conversation=TOOL_CONVERSATION, seed=0):
    """(nanochat's GPTConfig fields, its state dict {name: float32 numpy}) of a model trained on the
    rendering of `conversation` (every next token, Adam) until it predicts every token after
    <|assistant_start|> in it by MARGIN: its greedy answer, the forced output fed, is the
    conversation's."""
    ids, _ = render_conversation(tokenizer, conversation)
    answer = ids.index(tokenizer.encode_special("<|assistant_start|>"))  # predicted from here on
    config = {**TOOL_CONFIG, "vocab_size": tokenizer.n_vocab}
    torch.manual_seed(seed)
    model = ref.GPT(ref.Config(**config))
    x, y = torch.tensor([ids[:-1]]), torch.tensor([ids[1:]])
    targets = y[0, answer:, None]
    params = list(model.parameters())
    moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]
    for step in range(1, MAX_STEPS + 1):
        with torch.no_grad():
            logits = model(x)[0, answer:]  # (T, V)
            others = logits.scatter(1, targets, -torch.inf).max(-1).values
            if (logits.gather(1, targets)[:, 0] - others).min() > MARGIN:
                return config, {k: v.numpy().copy() for k, v in model.state_dict().items()}
        model(x, y).backward()
        adam_step(params, moments, step)
    raise AssertionError(f"the tool model did not learn its conversation in {MAX_STEPS} steps")


@torch.no_grad()
def adam_step(params, moments, step, lr=1e-2, betas=(0.9, 0.999), eps=1e-8):
    """torch.optim.Adam's update, written out: constructing the optimizer imports torch._dynamo,
    seconds of this test's time."""
    for p, (m, v) in zip(params, moments):
        m.lerp_(p.grad, 1 - betas[0])
        v.lerp_(p.grad.square(), 1 - betas[1])
        m_hat, v_hat = m / (1 - betas[0] ** step), v / (1 - betas[1] ** step)
        p -= lr * m_hat / (v_hat.sqrt() + eps)
        p.grad = None


def expected_answer(tokenizer, conversation=TOOL_CONVERSATION):
    """(the completion prompt, the answer's tokens after it without <|assistant_end|>, their
    masks: 0 on the tool's output and its delimiters, which the engine forces)."""
    ids, _ = render_conversation(tokenizer, conversation)
    start = ids.index(tokenizer.encode_special("<|assistant_start|>")) + 1
    output_start = tokenizer.encode_special("<|output_start|>")
    output_end = tokenizer.encode_special("<|output_end|>")
    answer = ids[start:-1]
    first, last = answer.index(output_start), answer.index(output_end)
    masks = [0 if first <= i <= last else 1 for i in range(len(answer))]
    return ids[:start], answer, masks
