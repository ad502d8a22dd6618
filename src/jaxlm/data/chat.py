"""Chat records -> token ids and a loss mask that trains on the assistant's tokens only (SFT).

A record holds `messages` ([{"role", "content"}, ...]) or a `prompt`/`completion` pair (optional `system`),
rendered with the tokenizer's chat template and tokenized with its special tokens. Assistant spans are found by
token ids, not by searching the text: the conversation up to an assistant turn, rendered with the generation
prompt, tokenizes to a prefix of the whole, and up to the end of that turn to a longer one; the tokens between
are the turn's. A conversation where this does not hold is refused in one line (docs/data.md, "Chat data").

Legend: L tokens of one conversation.
"""

from __future__ import annotations

import numpy as np

from jaxlm.data.errors import DataError
from jaxlm.data.tokenizer import ROLES, Tokenizer


def messages_of(rec: dict, where: str) -> list[dict]:
    """The conversation of one record, checked: roles known, contents strings, at least one assistant turn."""
    if "messages" in rec and rec["messages"] is not None:
        msgs = rec["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise DataError(f"{where}: `messages` must be a non-empty list of {{role, content}} objects")
    elif "prompt" in rec and "completion" in rec:
        msgs = ([{"role": "system", "content": rec["system"]}] if rec.get("system") else []) + [
            {"role": "user", "content": rec["prompt"]}, {"role": "assistant", "content": rec["completion"]}]
    else:
        raise DataError(f"{where}: a chat record needs `messages` or `prompt` and `completion` (fields: "
                        f"{', '.join(map(str, rec)) or 'none'})")
    out = checked_messages(msgs, where)
    if not any(m["role"] == "assistant" for m in out):
        raise DataError(f"{where}: the conversation has no assistant message, so nothing to train on")
    return out


def checked_messages(msgs: list, where: str, what: str = "message") -> list[dict]:
    """{role, content} of each message, checked: an object with a known role and string content."""
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataError(f"{where}: {what} {i + 1} must be an object with `role` and `content`")
        if m["role"] not in ROLES:
            raise DataError(f"{where}: {what} {i + 1} has the unknown role {m['role']!r} (allowed: "
                            f"{', '.join(ROLES)})")
        if not isinstance(m["content"], str):
            raise DataError(f"{where}: {what} {i + 1} content is a {type(m['content']).__name__}, not a string")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def encode_chat(tok: Tokenizer, messages: list[dict], first: int = 0, expand=None) -> tuple[np.ndarray, np.ndarray]:
    """(ids_L, mask_L): the rendered conversation's token ids, and 1 on the tokens of the assistant turns from
    message `first` on (a preference pair's reply after its prompt turns; 0: all of them). `expand` (text ->
    text) rewrites each rendering before it is tokenized: images' markers become their image tokens
    (vision_data.py). Raises ValueError when the template does not render the conversation prefix by prefix."""
    expand = expand or (lambda text: text)

    def encoded(msgs: list[dict], prompt: bool) -> list[int]:
        return tok.encode_rendered(expand(tok.apply_chat_template(msgs, add_generation_prompt=prompt)))

    ids_L = encoded(messages, False)
    mask_L = np.zeros(len(ids_L), np.uint8)
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or i < first:
            continue
        start = encoded(messages[:i], True) if i else []
        end = encoded(messages[:i + 1], False)
        if ids_L[:len(start)] != start or ids_L[:len(end)] != end or len(end) <= len(start):
            raise ValueError(f"the chat template's rendering up to message {i + 1} does not tokenize to a prefix of "
                             "the whole conversation, so its assistant tokens cannot be found exactly")
        mask_L[len(start):len(end)] = 1
    return np.asarray(ids_L, np.int64), mask_L
