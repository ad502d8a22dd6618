"""Preference pairs (DPO, IPO, ORPO): records -> a prompt with a chosen and a rejected reply, stored as two
documents with a loss mask on the reply's tokens; and the loader that lays whole pairs into rows (PairLoader).

Records (TRL's formats, docs/data.md): {"prompt", "chosen", "rejected"} as strings (no chat template; each part
tokenized on its own, so the reply's span is exact) or as messages rendered with the tokenizer's chat template
(the reply's span found by data/chat.py's prefix method); {"chosen", "rejected"} alone are two conversations
whose shared first turns are the prompt. A prepared folder (meta.json's kind "preference") holds pair p as
documents 2p (prompt + chosen) and 2p + 1 (prompt + rejected); a pair is never cut.

Legend: A micro-batches per step, B rows per micro-batch, T block_size, R = T + 1 tokens per row, P pairs.
"""

from __future__ import annotations

import numpy as np

from jaxlm.data import chat, packing, shards
from jaxlm.data.errors import DataError
from jaxlm.data.tokenizer import Tokenizer

KIND = "preference"  # meta.json's "kind" for a folder of pairs


def is_preference(meta: dict) -> bool:
    return meta.get("kind") == KIND


# ---- records -> pairs -----------------------------------------------------------------------------------------

def pair_of(rec: dict, where: str) -> tuple:
    """("text", prompt, chosen, rejected) as strings, or ("chat", prompt, chosen, rejected) as message lists, the
    replies starting with the assistant's turn; a one-line DataError for a record that is not a pair."""
    chosen, rejected, prompt = rec.get("chosen"), rec.get("rejected"), rec.get("prompt")
    if chosen is None or rejected is None or (prompt is None and not (isinstance(chosen, list)
                                                                      and isinstance(rejected, list))):
        raise DataError(f"{where}: a preference record needs `prompt`, `chosen` and `rejected` (`prompt` may be left "
                        f"out when chosen and rejected are conversations sharing their first turns); fields: "
                        f"{', '.join(map(str, rec)) or 'none'}")
    if isinstance(prompt, str):
        for name, v in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
            if not isinstance(v, str):
                raise DataError(f"{where}: `{name}` is a {type(v).__name__}, and with a string prompt all three are "
                                "strings; write the prompt as a list of messages for a conversation")
        pair = ("text", prompt, chosen, rejected)
    elif prompt is None:
        chosen, rejected = (chat.checked_messages(v, where, f"`{name}` message")
                            for name, v in (("chosen", chosen), ("rejected", rejected)))
        k = 0
        while k < min(len(chosen), len(rejected)) and chosen[k] == rejected[k]:
            k += 1
        if chosen == rejected:
            raise DataError(f"{where}: `chosen` and `rejected` are the same conversation, so the pair prefers "
                            "neither; fix or drop the record")
        pair = ("chat", chosen[:k], chosen[k:], rejected[k:])
    else:
        if not isinstance(prompt, list):
            raise DataError(f"{where}: `prompt` is a {type(prompt).__name__}; give a string or a list of messages")
        pair = ("chat", chat.checked_messages(prompt, where, "`prompt` message"),
                *(_reply(v, where, name) for name, v in (("chosen", chosen), ("rejected", rejected))))
    if pair[0] == "chat":
        for name, reply in (("chosen", pair[2]), ("rejected", pair[3])):
            if not reply or reply[0]["role"] != "assistant":
                what = "nothing" if not reply else f"a {reply[0]['role']} turn"
                raise DataError(f"{where}: `{name}`'s reply must start with an assistant turn after the prompt's "
                                f"turns, and it starts with {what}")
    if pair[2] == pair[3]:
        raise DataError(f"{where}: `chosen` and `rejected` are the same reply, so the pair prefers neither; fix or "
                        "drop the record")
    return pair


def _reply(value, where: str, name: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    if not isinstance(value, list):
        raise DataError(f"{where}: `{name}` is a {type(value).__name__}; give a string or a list of messages")
    return chat.checked_messages(value, where, f"`{name}` message")


def encode_pair(tok: Tokenizer, pair: tuple, expand=None) -> list[tuple[np.ndarray, np.ndarray]]:
    """[(ids, mask) of prompt + chosen, (ids, mask) of prompt + rejected], the mask 1 on the reply's tokens;
    `expand` rewrites a chat pair's renderings (chat.encode_chat: images' markers). Raises ValueError (the message
    without the record's place) for a pair that cannot be trained on."""
    kind, prompt, *replies = pair
    docs = []
    for name, reply in zip(("chosen", "rejected"), replies):
        if kind == "text":
            head = ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode(prompt)
            tail = tok.encode(reply) + ([tok.eos_id] if tok.eos_id is not None else [])
            ids, mask = np.asarray(head + tail, np.int64), np.repeat(np.uint8([0, 1]), [len(head), len(tail)])
        else:
            ids, mask = chat.encode_chat(tok, prompt + reply, first=len(prompt), expand=expand)
        if not mask.any():
            raise ValueError(f"`{name}` encodes to no token, so there is nothing to compare")
        if mask[0]:
            raise ValueError("the prompt encodes to no token, so the reply's first token has nothing to be "
                             "predicted from; give a prompt (or a tokenizer with a BOS token)")
        docs.append((ids, mask))
    if np.array_equal(docs[0][0], docs[1][0]):
        raise ValueError("`chosen` and `rejected` encode to the same tokens, so the pair prefers neither")
    return docs


# ---- the prepared pairs ----------------------------------------------------------------------------------------

def pair_lengths(split: shards.Split) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(start, chosen document's length, both documents' length) of each pair [P] of a prepared split."""
    starts = split.doc_starts_D1
    if starts is None or (len(starts) - 1) % 2:
        raise DataError(f"the {split.name} split of {split.dir} does not hold whole pairs (an odd number of "
                        "documents); prepare it again with `jaxlm prepare preference`")
    return starts[:-1:2], starts[1::2] - starts[:-1:2], starts[2::2] - starts[:-1:2]


def check_fits(split: shards.Split, block_size: int) -> None:
    """Every pair fits a row of block_size + 1 tokens (a pair is never cut): one line naming the longest if not."""
    _, _, lengths_P = pair_lengths(split)
    p = int(np.argmax(lengths_P))
    if lengths_P[p] > block_size + 1:
        raise DataError(f"pair {p} of the {split.name} split of {split.dir} is {int(lengths_P[p])} tokens (prompt "
                        f"twice and both replies), more than a row of model.block_size={block_size} holds; a pair "
                        f"is never cut: set model.block_size to at least {int(lengths_P[p]) - 1}, or prepare the "
                        f"data again with --max-tokens {block_size} --drop-long")


class PairLoader:
    """Rows of whole pairs from one split: a packing.Packed plan of [grad_accum, batch] rows per `next()`,
    resumable exactly. packed=False puts one pair in a row (chosen, rejected, padding), True as many whole pairs as
    fit; pair k of a row is segments 2k + 1 (chosen) and 2k + 2 (rejected), a target counting where it is a reply
    token of its own segment. The order is packing.PackedLoader's with pairs for documents, so the position is
    the number of pairs each stream has consumed."""

    def __init__(self, split: shards.Split, block_size: int, batch_size: int, grad_accum: int, seed: int,
                 packed: bool, images_P: np.ndarray | None = None, images_per_row: int = 0):
        self.split, self.T, self.seed, self.packed = split, block_size, seed, packed
        # Pairs with images (data/vision_data.py): each pair's images [P], and the most a row takes.
        self.images_P, self.images_per_row = images_P, images_per_row
        self.shape = (grad_accum, batch_size)
        self.starts_P, self.chosen_P, self.lengths_P = pair_lengths(split)
        self.n_pairs = len(self.lengths_P)
        self.consumed_B = np.zeros(batch_size, np.int64)  # pairs each stream has placed
        self._perms: dict[int, np.ndarray] = {}

    def _pair(self, b: int) -> int:
        """The pair stream b is on: number b + consumed * B of the sequence of epochs."""
        return packing.stream_item(self._perms, self.seed, b + int(self.consumed_B[b]) * self.shape[1], self.n_pairs)

    def row(self, b: int) -> list[tuple[int, int]]:
        """One row from stream b as pieces (offset, length): each pair's chosen, then its rejected document."""
        room, slots, pieces = self.T + 1, self.images_per_row, []
        while True:
            p = self._pair(b)
            start, chosen, length = int(self.starts_P[p]), int(self.chosen_P[p]), int(self.lengths_P[p])
            n = 0 if self.images_P is None else int(self.images_P[p])
            if length > room or n > slots:  # never at a row's start: check_fits (and run.image_slots) see to it
                return pieces
            pieces += [(start, chosen), (start + chosen, length - chosen)]
            room, slots = room - length, slots - n
            self.consumed_B[b] += 1
            if not self.packed:
                return pieces

    def next(self) -> packing.Packed:
        return packing.plan(self.row, self.shape, loss_mask=True)

    def _layout(self) -> dict:
        return {"grad_accum": self.shape[0], "batch_size": self.shape[1], "block_size": self.T,
                "tokens": self.split.n_tokens, "pairs": self.n_pairs, "packing": self.packed}

    def state(self) -> dict:
        return {"kind": "pairs", "seed": self.seed, "consumed": self.consumed_B.tolist(), **self._layout()}

    def restore(self, state: dict) -> None:
        self.seed, (self.consumed_B,) = packing.restored_streams(state, "pairs", self._layout(), ("consumed",),
                                                                 self.shape[1])
        self._perms.clear()


def every_pair(split: shards.Split, block_size: int, rows: int, images_P: np.ndarray | None = None,
               images_per_row: int = 0):
    """Plans of `rows` rows [rows] that hold every pair of the split once, in order, packed: what the reference
    pass reads (the last plan's spare rows are empty). With images, a row takes at most images_per_row."""
    starts_P, chosen_P, lengths_P = pair_lengths(split)
    n_P = np.zeros(len(starts_P), np.int64) if images_P is None else images_P
    plan: list = []
    row: list = []
    room, slots = block_size + 1, images_per_row
    for start, chosen, length, n in zip(starts_P.tolist(), chosen_P.tolist(), lengths_P.tolist(), n_P.tolist()):
        if length > room or n > slots:
            plan.append(row)
            row, room, slots = [], block_size + 1, images_per_row
            if len(plan) == rows:
                yield packing.Packed(plan, (rows,), loss_mask=True)
                plan = []
        row += [(start, chosen), (start + chosen, length - chosen)]
        room, slots = room - length, slots - n
    plan.append(row)
    yield packing.Packed(plan + [[] for _ in range(rows - len(plan))], (rows,), loss_mask=True)
