"""Documents -> token ids in worker processes: batches of texts, conversations or preference pairs encoded in
input order, a few batches per worker in flight so that memory stays bounded however large the corpus
(prepare.write_dataset writes what comes back to shards).
"""

from __future__ import annotations

import collections
import itertools
import os
from typing import NamedTuple

import numpy as np

_WORKER: dict = {}  # the tokenizer of a worker process (or of this process when workers=0)
BATCH_DOCUMENTS, BATCH_BYTES = 512, 1 << 21  # documents handed to a worker at a time


def _worker_init(spec: dict, chat_template: str | None) -> None:
    os.environ["RAYON_NUM_THREADS"] = "1"  # one tokenizer thread per worker: the workers fill the cores
    from jaxlm.data import tokenizer as tokenizer_lib

    tok = tokenizer_lib.from_spec(spec)
    if chat_template:
        tok.chat_template = chat_template
    _WORKER["tok"] = tok


def _work(job: tuple) -> tuple[Flat | list, np.ndarray, list | None, collections.Counter | None]:
    """Encode one batch of documents: ('text', texts), ('chat', conversations), ('preference', pairs) or ('jsonl',
    sources.JsonLines) -> (texts as one Flat, else per document (ids, mask or None), per pair a list of two such
    documents, or the error text of a document; the batch's token counts per id; for a JSON-lines block the
    documents' places and what reading it counted, else None, None)."""
    kind, payload = job
    tok = _WORKER["tok"]
    wheres = stats = None
    if kind == "jsonl":
        from jaxlm.data import sources

        stats = collections.Counter()
        payload, wheres = sources.block_texts(payload, stats)
    if kind in ("text", "jsonl"):
        docs = _encode_texts(tok, payload)
    else:
        from jaxlm.data import chat, preference

        encode = {"chat": chat.encode_chat, "preference": preference.encode_pair}[kind]
        docs = []
        for item in payload:
            try:
                docs.append(encode(tok, item))
            except ValueError as e:  # TokenizerError included: a template that refuses this conversation
                docs.append(str(e))
    if isinstance(docs, Flat):
        flat = docs.ids
    else:
        arrays = [part[0] for d in docs if not isinstance(d, str) for part in parts(d, kind)]
        flat = np.concatenate(arrays) if arrays else np.zeros(0, np.int64)
    return docs, np.bincount(flat[flat >= 0], minlength=tok.vocab_size), wheres, stats


def parts(doc, kind: str) -> list:
    """The documents (ids, mask) of one encoded item: a pair's two, or the document itself."""
    return doc if kind == "preference" else [doc]


class Flat(NamedTuple):
    """A batch of text documents end to end: their token ids [T] and their lengths [D] (one array each, not one
    per document: the cheap form to send between processes and to write)."""
    ids: np.ndarray
    lengths: np.ndarray

    def documents(self) -> list:
        """The per-document form (ids, None) of the other kinds."""
        return [(ids, None) for ids in np.split(self.ids, np.cumsum(self.lengths)[:-1])] if len(self.lengths) else []


def _encode_texts(tok, texts: list[str]) -> Flat | list:
    try:
        docs = tok.encode_documents(texts)
        lengths = np.fromiter(map(len, docs), np.int64, len(docs))
        return Flat(np.fromiter(itertools.chain.from_iterable(docs), np.int64, int(lengths.sum())), lengths)
    except ValueError:  # a text this tokenizer cannot encode (a char vocabulary): find it, say where
        docs = []
        for text in texts:
            try:
                docs.append((np.asarray(tok.encode_document(text), np.int64), None))
            except ValueError as e:
                docs.append(str(e))
        return docs


def _batches(items, kind: str):
    """Group (payload, where, nbytes) items into jobs of about BATCH_DOCUMENTS documents or BATCH_BYTES; a
    sources.JsonLines block among them is a job of its own."""
    from jaxlm.data import sources

    payloads, wheres, size = [], [], 0
    for item in items:
        if isinstance(item, sources.JsonLines):
            if payloads:
                yield (kind, payloads), wheres, size
                payloads, wheres, size = [], [], 0
            yield ("jsonl", item), None, len(item.data)
            continue
        payload, where, nbytes = item
        payloads.append(payload)
        wheres.append(where)
        size += nbytes
        if len(payloads) >= BATCH_DOCUMENTS or size >= BATCH_BYTES:
            yield (kind, payloads), wheres, size
            payloads, wheres, size = [], [], 0
    if payloads:
        yield (kind, payloads), wheres, size


def encoded(items, kind: str, workers: int, tok, chat_template: str | None):
    """(documents, counts, wheres, nbytes, counted) per batch in input order (see _work), encoded by `workers`
    processes (0: this one). At most a few batches per worker are in flight, so memory stays bounded however
    large the corpus."""
    jobs = _batches(items, kind)
    if workers == 0:
        _WORKER["tok"] = tok
        for job, wheres, size in jobs:
            yield _result(_work(job), wheres, size)
        return
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")  # no fork of a process that may hold threads
    with ctx.Pool(workers, initializer=_worker_init, initargs=(tok.spec, chat_template)) as pool:
        pending: collections.deque = collections.deque()
        for job, wheres, size in jobs:
            pending.append((pool.apply_async(_work, (job,)), wheres, size))
            if len(pending) >= 2 * workers + 1:
                result, wheres, size = pending.popleft()
                yield _result(result.get(), wheres, size)
        while pending:
            result, wheres, size = pending.popleft()
            yield _result(result.get(), wheres, size)


def _result(result, wheres, size):
    docs, counts, block_wheres, counted = result
    return docs, counts, wheres if block_wheres is None else block_wheres, size, counted
