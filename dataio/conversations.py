"""
nanochat's conversations (nanochat/tokenizer.py: render_conversation, render_for_completion) as
token ids. A conversation is what nanochat's tasks build: {"messages": [...]}, each message a
{"role", "content"}: an optional system message, then user and assistant in turn. A user's (and the
system's) content is a string; an assistant's is a string or a list of parts {"type", "text"}:
"text", a "python" tool call, or the tool's "python_output" (GSM8K's calculator calls, the spelling
tasks' count). Rendered: BOS, then each message between its special tokens, the system message
merged into the first user message; the mask is 1 on exactly the tokens finetuning supervises (the
assistant's text, its tool calls with their delimiters, and <|assistant_end|>), 0 on the rest (BOS,
the user's turns, <|assistant_start|>, the tool's output, which Python writes at test time). A
conversation that is none of this is one line naming the fix (a UsageError, a ValueError).
"""

from configurator import UsageError
from dataio.unpickling import short

MAX_TOKENS = 2048  # nanochat's default cut (it keeps SFT rows from running out of memory)
SYSTEM_JOIN = "\n\n"  # between the system message and the first user message it is merged into
# each part type: the special tokens around its text, and whether finetuning learns its tokens
PARTS = {
    "text": (None, None, True),
    "python": ("<|python_start|>", "<|python_end|>", True),  # the call: the model writes it
    "python_output": ("<|output_start|>", "<|output_end|>", False),  # the result: Python writes it
}
SHAPE = (
    'a conversation is {"messages": [...]}: an optional system message, then user and assistant '
    'in turn, each {"role": ..., "content": ...}'
)
ASSISTANT_CONTENT = (
    "an assistant's content is a string or a list of parts "
    '{"type": "text" | "python" | "python_output", "text": str}'
)


def check_conversation(conversation, where="conversation"):
    """The messages to render, as (role, content) pairs: checked, the system message merged into the
    first user message, an assistant's content as a tuple of (part type, text) (a string is one text
    part). Anything else is one line naming `where` and the fix."""

    def bad(why):
        return UsageError(f"{where}: {why}")

    if not isinstance(conversation, dict) or not isinstance(conversation.get("messages"), list):
        got = "no messages" if isinstance(conversation, dict) else short(conversation)
        raise bad(f"it holds {got}; {SHAPE}")
    messages = conversation["messages"]
    if not messages:
        raise bad(f"an empty conversation: give it a user message at least; {SHAPE}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not {"role", "content"} <= set(message):
            raise bad(f"messages[{i}] is {short(message)}, not a dict with a role and a content")
    first = 1 if messages[0]["role"] == "system" else 0
    if first and len(messages) == 1:
        raise bad("a system message alone: follow it with the user message it is merged into")
    checked = []
    for i, message in enumerate(messages):
        role, content = message["role"], message["content"]
        speaker = "system" if i < first else ("user", "assistant")[(i - first) % 2]
        if role != speaker:
            raise bad(
                f"messages[{i}] is from {short(role)} where the {speaker} speaks; {SHAPE} "
                "(a system message only first)"
            )
        if role != "assistant" and not isinstance(content, str):
            raise bad(f"messages[{i}] ({role}) holds {short(content)}: a {role}'s content is a str")
        if role == "assistant":
            content = assistant_parts(content, f"{where}: messages[{i}]")
        checked.append((role, content))
    if first:  # nanochat's surgery: the system message becomes the first user message's opening
        (_, system), (_, user) = checked[:2]
        checked[:2] = [("user", system + SYSTEM_JOIN + user)]
    return checked


def assistant_parts(content, where):
    """An assistant message's content as (part type, text) pairs, checked."""
    if isinstance(content, str):
        return (("text", content),)
    if not isinstance(content, list):
        raise UsageError(f"{where} (assistant) holds {short(content)}: {ASSISTANT_CONTENT}")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str) or kind not in PARTS:  # a list type is no key
            got = f"the part type {short(kind)}" if isinstance(part, dict) else short(part)
            raise UsageError(f"{where}.content[{j}] is {got}: {ASSISTANT_CONTENT}")
        if not isinstance(part.get("text"), str):
            raise UsageError(
                f"{where}.content[{j}] ({kind}) has the text {short(part.get('text'))}: "
                f"{ASSISTANT_CONTENT}"
            )
        parts.append((kind, part["text"]))
    return tuple(parts)


def rendered_pieces(tokenizer, messages):
    """(ids, supervised) of each piece of a rendering, in order, from check_conversation's messages;
    `tokenizer`: nanochat's interface (encode with prepend/append, encode_special)."""
    special = tokenizer.encode_special
    yield [special("<|bos|>")], False
    for role, content in messages:
        if role == "user":
            yield tokenizer.encode(content, prepend="<|user_start|>", append="<|user_end|>"), False
            continue
        yield [special("<|assistant_start|>")], False  # the prompt's end, given at test time
        for kind, text in content:
            start, end, supervised = PARTS[kind]
            yield tokenizer.encode(text, prepend=start, append=end), supervised
        yield [special("<|assistant_end|>")], True  # the model learns to stop


def render_conversation(tokenizer, conversation, max_tokens=MAX_TOKENS):
    """nanochat's render_conversation: (ids, mask), two lists of ints as long as each other, mask 1
    on the tokens finetuning supervises; both cut to max_tokens (None: not cut)."""
    ids, mask = [], []
    for piece, supervised in rendered_pieces(tokenizer, check_conversation(conversation)):
        ids += piece
        mask += [int(supervised)] * len(piece)
    return ids[:max_tokens], mask[:max_tokens]


def render_for_completion(tokenizer, conversation, max_tokens=MAX_TOKENS):
    """nanochat's render_for_completion (chat_eval's and chat_rl's prompts): the ids of the
    conversation without its last message, the assistant's, then <|assistant_start|> for the model
    to answer after. As nanochat's, the ids are cut to max_tokens before that token is added, so a
    longer prompt loses its end; the caller's conversation is left as it is."""
    last_role = check_conversation(conversation)[-1][0]  # the whole, the message dropped too
    if last_role != "assistant":
        raise UsageError(
            f"the last message is from the {last_role}: a completion's conversation ends with "
            "the assistant's message, which the model's answer replaces"
        )
    prompt = {**conversation, "messages": conversation["messages"][:-1]}
    ids, _ = render_conversation(tokenizer, prompt, max_tokens)
    return ids + [tokenizer.encode_special("<|assistant_start|>")]


def visualize_tokenization(tokenizer, ids, mask, with_token_id=False):
    """nanochat's picture of a rendering for a terminal: each token's text, green where the mask is
    1 and red where 0 (with its id in gray if asked), joined by |."""
    green, red, gray, reset = "\033[92m", "\033[91m", "\033[90m", "\033[0m"
    tokens = []
    for token_id, supervised in zip(ids, mask, strict=True):
        tokens.append(f"{green if supervised == 1 else red}{tokenizer.decode([token_id])}{reset}")
        if with_token_id:
            tokens.append(f"{gray}({token_id}){reset}")
    return "|".join(tokens)
