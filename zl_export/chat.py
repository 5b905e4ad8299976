"""Chat rows: `{"messages": [{"role": ..., "content": ...}, ...]}` as one prompt and one completion.

The trained turn is the conversation's last message, which must be the assistant's; the prompt is every message
before it, rendered with the tokenizer's own chat template with the assistant's turn opened
(`apply_chat_template(..., add_generation_prompt=True)`), and the completion is that turn's content followed by the
tokenizer's end-of-sequence token (for SmolLM2 `<|im_end|>`, which is how its template closes a turn). A tokenizer
without a chat template (the byte tokenizer of the random models) gets the plain fallback, one block per turn:

    <|system|>
    You answer in one word.
    <|user|>
    Capital of France?
    <|assistant|>
    Paris<eos>

The rendered prompt is tokenized as every prompt is (`zl_export.tokenizer.encode_prompt`): the tokenizer's BOS in
front when it adds one by default, once. A template that writes the BOS itself (`{{ bos_token }}`: Gemma's, Llama
2's) renders it as text that encodes to the BOS id, and it is not doubled; the plain fallback gets it like any text.

Why only the last assistant turn carries loss: a row stays one prompt and one completion, which is what the
target slots (sized from the completions), `zl eval` (held-out completion NLL, generations from the prompt) and
`zl generate` assume; earlier assistant turns are context. To train on every turn, write one row per turn (each a
prefix of the conversation ending in that assistant turn).
"""

from __future__ import annotations

from zl_base.errors import ZLError
from zl_export.records import check_text, json_kind

ROLES = ("system", "user", "assistant")
#: The plain fallback: each turn as "<|role|>\ncontent\n", then "<|assistant|>\n" opens the trained turn.
PLAIN_TURN = "<|{role}|>\n{content}\n"
PLAIN = "plain"  # the sidecar's `chat_template` when the fallback was used (else "tokenizer")
_EXAMPLE = '{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}'


def parse_messages(value: object, where: str) -> list[dict[str, str]]:
    """A row's `messages`, checked: a non-empty list of {role, content} with known roles, ending in a non-empty
    assistant turn (the completion).

    Args:
        where: names the row, e.g. "data.jsonl line 7".

    Raises:
        ZLError: naming the row and the first problem.
    """
    messages = _turns(value, where)
    if not any(m["role"] == "assistant" for m in messages):
        raise ZLError(f"{where}: no assistant turn, so nothing to learn; end the conversation with "
                      '{"role": "assistant", "content": ...}.')
    if messages[-1]["role"] != "assistant":
        raise ZLError(f"{where}: the conversation ends with a {messages[-1]['role']} turn; the last message must be "
                      "the assistant turn to train on. Drop the turns after it.")
    if not messages[-1]["content"].strip():
        raise ZLError(f"{where}: the last assistant turn is empty (no completion); fill it in or delete the row.")
    return messages


#: ShareGPT's speakers (`from`) -> roles; torchtune's sharegpt style and TRL read the same.
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
_SHAREGPT_EXAMPLE = '{"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]}'


def sharegpt_messages(value: object, where: str) -> list[dict[str, str]]:
    """A ShareGPT row's `conversations` ([{from: human|gpt|system, value}, ...]) as `messages`, then checked as a
    chat row's are (`parse_messages`).

    Raises:
        ZLError: naming the row and the turn: not a list of {from, value} strings, an unknown speaker, or what
            `parse_messages` refuses.
    """
    return parse_messages(sharegpt_turns(value, where), where)


def sharegpt_turns(value: object, where: str) -> list[dict[str, str]]:
    """`conversations` as `messages` turns ({role, content}), not yet checked as a conversation (a training row's
    ends in the assistant turn, `parse_messages`; a prompt's in the user turn, `parse_prompt_messages`).

    Raises:
        ZLError: not a list of {from, value} strings, or an unknown speaker.
    """
    if not isinstance(value, list) or not value:
        raise ZLError(f"{where}: 'conversations' is {_kind(value)}, expected a list of turns like "
                      f"{_SHAREGPT_EXAMPLE}.")
    messages = []
    for i, turn in enumerate(value):
        if not isinstance(turn, dict) or not isinstance(turn.get("from"), str) or not isinstance(turn.get("value"),
                                                                                                 str):
            raise ZLError(f"{where}: turn {i} is {_kind(turn)}, expected an object with a string 'from' and 'value', "
                          f"like {_SHAREGPT_EXAMPLE}.")
        role = SHAREGPT_ROLES.get(turn["from"].strip().lower())
        if role is None:
            raise ZLError(f"{where}: turn {i} is from {turn['from']!r}; expected one of "
                          f"{', '.join(SHAREGPT_ROLES)}. Rename the speaker or drop the turn.")
        messages.append({"role": role, "content": turn["value"]})
    return messages


def parse_prompt_messages(value: object, where: str) -> list[dict[str, str]]:
    """A prompt's `messages` (`zl generate`), checked as `parse_messages` checks a row's turns, but ending in the
    non-empty user turn the model is to answer.

    Raises:
        ZLError: naming the row and the first problem.
    """
    messages = _turns(value, where)
    if messages[-1]["role"] != "user":
        raise ZLError(f"{where}: the conversation ends with a{'n' * (messages[-1]['role'] == 'assistant')} "
                      f"{messages[-1]['role']} turn; a prompt's last message must be the user turn to answer. Drop "
                      "the turns after it (a training row's assistant reply, too).")
    if not messages[-1]["content"].strip():
        raise ZLError(f"{where}: the last user turn is empty; give it some text or delete the row.")
    return messages


def _turns(value: object, where: str) -> list[dict[str, str]]:
    """Every turn checked: {role, content} strings, a known role (lowercased), no NUL."""
    if not isinstance(value, list) or not value:
        raise ZLError(f"{where}: 'messages' is {_kind(value)}, expected a list of turns like {_EXAMPLE}.")
    messages = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            seen = "" if not isinstance(m, dict) else " (its " + ", ".join(
                f"{k!r} is {'missing' if k not in m else 'a JSON ' + json_kind(m[k])}"
                for k in ("role", "content") if not isinstance(m.get(k), str)) + ")"  # "'content' is a JSON null"
            raise ZLError(f"{where}: message {i} is {_kind(m)}, expected an object with a string 'role' and "
                          f"'content'{seen}, like {_EXAMPLE}.")
        role = m["role"].strip().lower()
        if role not in ROLES:
            raise ZLError(f"{where}: message {i} has role {m['role']!r}; expected one of {', '.join(ROLES)}. Rename "
                          "the role or drop the message.")
        check_text(m["content"], f"{where}: message {i}")
        if "\0" in m["content"]:
            raise ZLError(f"{where}: message {i} holds a NUL character; the text looks binary. Save it as UTF-8 text.")
        messages.append({"role": role, "content": m["content"]})
    return messages


def plain_prompt(messages: list[dict[str, str]]) -> str:
    """The fallback rendering of every turn before the last, then the opened assistant turn."""
    return plain_turns(messages[:-1])


def plain_turns(turns: list[dict[str, str]]) -> str:
    """The fallback rendering of `turns`, then the opened assistant turn."""
    return "".join(PLAIN_TURN.format(**m) for m in turns) + "<|assistant|>\n"


def render_prompt(tokenizer, messages: list[dict[str, str]], where: str) -> tuple[str, str]:
    """The prompt text of a checked conversation, and which rendering made it ("tokenizer" or PLAIN).

    Raises:
        ZLError: the tokenizer's template rejects the conversation (e.g. one that needs alternating turns).
    """
    return render_turns(tokenizer, messages[:-1], where)


def render_turns(tokenizer, turns: list[dict[str, str]], where: str, plain: bool = False) -> tuple[str, str]:
    """`turns` rendered with the assistant's turn opened, the text the model continues, and which rendering made
    it: the tokenizer's chat template ("tokenizer"), else (no template, or `plain`) the fallback (PLAIN). Training
    renders a row's turns before its reply with it, `zl generate` a prompt's turns.

    Raises:
        ZLError: the tokenizer's template rejects the conversation (e.g. one that needs alternating turns).
    """
    chat_prompt = None if plain else getattr(tokenizer, "chat_prompt", None)
    if chat_prompt is None:
        return plain_turns(turns), PLAIN
    try:
        text = chat_prompt(turns)
    except Exception as e:  # jinja2's TemplateError, or what a template raises itself
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ZLError(f"{where}: the chat template of {tokenizer.name} rejects this conversation ({first}); reorder "
                      "the turns as the model expects (often: optional system, then user and assistant alternating).") from None
    return (plain_turns(turns), PLAIN) if text is None else (text, "tokenizer")


def _kind(value: object) -> str:
    if isinstance(value, str):
        return "text" if value.strip() else "empty"
    if isinstance(value, list):
        return "an empty list" if not value else "a list"
    return {dict: "an object", bool: "a boolean", int: "a number", float: "a number"}.get(type(value), "missing")
