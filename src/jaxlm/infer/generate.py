"""Generation: two decoders with the loop on device (the sampling rules are sampling.py's).

`generate` prefills a batch of prompts into a KV cache (model/kvcache.py), then runs the engine's decode loop
(sampling.sampled_steps: row b samples as the server's choice b of the seed, stops at a stop token or after
max_new_tokens); new tokens can be streamed to the host as they come. The loop runs in segments whose cache
doubles in length (`segments`) and, unless the model is deep, carries each layer's weights and cache apart
(decode.decode_layers). `sample` is the plain decoder without a cache (the forward pass over a sliding window per
token): the end-of-training sample and the baseline of benchmarks/decode.py.

Shape legend: B batch, T prompt length, V vocab, N new tokens.
"""

from __future__ import annotations

from functools import partial

import contextlib
import dataclasses
import itertools
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxlm import sharding
from jaxlm.infer import sampling
from jaxlm.config import ConfigError, DecodeConfig, ModelConfig, validate_decode
from jaxlm.model import decode, forward, images_as_input, kvcache


@partial(jax.jit, static_argnames=("cfg", "prompt_len", "new_tokens", "temperature", "top_k"))
def _sample(params, prompt, key, cfg: ModelConfig, prompt_len: int, new_tokens: int, temperature: float,
            top_k: int):
    T = cfg.block_size
    buf = jnp.zeros(max(prompt_len + new_tokens, T), jnp.int32).at[:prompt_len].set(prompt)

    def body(i, carry):
        buf, key = carry
        n = prompt_len + i
        start = jnp.maximum(n - T, 0)
        window_T = jax.lax.dynamic_slice(buf, (start,), (T,))
        logits_TV = forward(params, window_T[None], cfg)[0]
        last_V = jax.lax.dynamic_index_in_dim(logits_TV, n - 1 - start, keepdims=False)
        key, sub = jax.random.split(key)
        return buf.at[n].set(sampling.sample_tokens(last_V[None], sub, temperature, top_k, 1.0)[0]), key

    buf, _ = jax.lax.fori_loop(0, new_tokens, body, (buf, key))
    return buf[prompt_len: prompt_len + new_tokens]


def sample(params, cfg: ModelConfig, prompt_ids: list[int], new_tokens: int, key: jax.Array,
           temperature: float = 0.8, top_k: int = 0) -> list[int]:
    if not prompt_ids:
        raise ValueError("the prompt must hold at least one token")
    if new_tokens <= 0:
        return []
    out = _sample(params, jnp.asarray(prompt_ids, jnp.int32), key, cfg, len(prompt_ids), new_tokens,
                  float(temperature), int(top_k))
    return [int(t) for t in jax.device_get(out)]


# ---- cached generation ------------------------------------------------------------------------------------------

class _InOrder:
    """Calls `fn(tokens, live)` step after step. The decode loop's host callback is unordered (JAX orders
    callbacks only on one device, and decoding may run on a mesh), so a step that arrives early waits here for
    the steps before it."""

    def __init__(self, fn: Callable[[np.ndarray, np.ndarray], None]):
        self.fn, self.next, self.held, self.lock = fn, 0, {}, threading.Lock()

    def __call__(self, i, tokens_B, live_B) -> None:
        with self.lock:
            self.held[int(i)] = (np.asarray(tokens_B), np.asarray(live_B))
            while self.next in self.held:
                self.fn(*self.held.pop(self.next))
                self.next += 1


# The host callbacks of the decode loops running now, by stream id. A compiled loop is shared by every call of its
# shapes, in any thread: each call passes its own id in (an argument, not a constant of the program), and `emit`
# hands the loop's values to that call's callback.
_STREAMS: dict[int, Callable] = {}
_STREAMS_LOCK = threading.Lock()
_STREAM_IDS = itertools.count(1)  # 0: no stream


@contextlib.contextmanager
def streaming(fn: Callable) -> Iterator[np.ndarray]:
    """A stream id (an int32 scalar for a decode loop's argument) whose `emit`s call fn until the block ends."""
    with _STREAMS_LOCK:
        i = next(_STREAM_IDS) % 2**31
        _STREAMS[i] = fn
    try:
        yield np.int32(i)
    finally:
        with _STREAMS_LOCK:
            del _STREAMS[i]


def emit(stream_id, *values) -> None:
    """A decode loop's host callback (jax.debug.callback): values to the callback of stream_id."""
    with _STREAMS_LOCK:
        fn = _STREAMS.get(int(stream_id))
    if fn is not None:
        fn(*values)


@partial(jax.jit, static_argnames=("cfg", "cache_length", "quantize", "layout"))
def _prefill(params, prompts_BT, lengths_B, cfg: ModelConfig, cache_length: int, quantize: bool,
             layout: sharding.Layout | None = None, images=None):
    with sharding.within(layout):
        return decode.prefill(params, prompts_BT, lengths_B, cfg, cache_length, quantize, images)


FIRST_SEGMENT = 64  # cache slots of the first decode segment at least; each next one doubles
MAX_SEGMENTS = 4  # each compiles its own copy of the decode step
# Models of up to this many layers decode with the layers unrolled (decode.decode_layers), deeper ones with
# the scan over stacked layers (decode.decode_step), whose compile time does not grow with depth (the trade,
# measured: docs/generate.md).
UNROLL_LAYERS = 16


def segments(prompt_len: int, cache_length: int, max_new_tokens: int) -> list[tuple[int, int]]:
    """The decode loop runs in segments of growing cache length, so that a step attends over about the
    filled part of the cache instead of all of it: [(slots, the step it ends before)], doubling up to
    cache_length from FIRST_SEGMENT slots, or from more where that would take over MAX_SEGMENTS. Step i writes
    position length + i <= prompt_len + i (prompts are padded to prompt_len), which a segment of S slots holds
    while i < S - prompt_len (what segments gain: docs/generate.md)."""
    S = FIRST_SEGMENT
    while S * 2 ** (MAX_SEGMENTS - 1) < cache_length:
        S *= 2
    out = []
    while S < cache_length:
        end = min(S - prompt_len, max_new_tokens)
        if end > (out[-1][1] if out else 0):
            out.append((S, end))
        if end == max_new_tokens:
            return out
        S *= 2
    return out + [(cache_length, max_new_tokens)]


@partial(jax.jit, static_argnames=("cfg", "max_new_tokens", "stream", "prompt_len", "cache_length", "unroll",
                                   "layout"))
def _decode(params, logits_BV, cache, sampled: sampling.RowSampling, stream_id, cfg: ModelConfig,
            max_new_tokens: int, stream: bool, prompt_len: int, cache_length: int, unroll: bool,
            layout: sharding.Layout | None = None):
    """Sample up to max_new_tokens per sequence (sampling.sampled_steps, the engine's loop, one call per
    segment): [B, N] tokens (0 after a sequence stopped) and counts [B]. With `unroll` the layers are unrolled,
    else scanned. `cache` comes from prefill of prompts padded to prompt_len, with the slots of the first of the
    segments up to cache_length; a segment's loop ends at its last step or once every sequence has stopped, and
    the next one grows the cache. With `stream` each step's tokens go to the host callback of stream_id
    (`streaming`)."""
    B = logits_BV.shape[0]
    with sharding.within(layout):
        step, cache = decode.decoder(params, cache, cfg, unroll)
        live_B, start, tokens, produced = jnp.ones((B,), bool), 0, [], []
        for S, end in segments(prompt_len, cache_length, max_new_tokens):
            def on_step(i, tok_B, live_B, start=start):
                # Replicated first (a few ints a step): the callback reads its operands on one device.
                jax.debug.callback(emit, stream_id, start + i, sharding.constrain(tok_B, (None,)),
                                   sharding.constrain(live_B, (None,)))

            cache = kvcache.grow(cache, cfg, S)
            count = jnp.full((B,), start, jnp.int32)  # every live row has made `start` tokens
            here = dataclasses.replace(sampled, left_b=sampled.left_b - count, count_b=count)
            out, logits_BV, cache, live_B = sampling.sampled_steps(
                lambda tok_B, live_B, cache: step(tok_B, cache), cache, logits_BV, end - start, live_B, here,
                end - start, on_step if stream else None, logprobs=False)
            tokens.append(out[0])
            produced.append(out[4])
            start = end
    return jnp.concatenate(tokens).T, jnp.sum(jnp.concatenate(produced), axis=0, dtype=jnp.int32)


@dataclass
class Generation:
    tokens: list[list[int]]  # new tokens of each sequence, up to and including its stop token
    compile_s: float
    prefill_s: float
    decode_s: float

    @property
    def decode_tokens_per_s(self) -> float:
        return sum(map(len, self.tokens)) / max(self.decode_s, 1e-9)


def check_prompts(prompts: Sequence[Sequence[int]], cfg: ModelConfig, d: DecodeConfig) -> int:
    """Validate the prompts against the model and the cache; returns the cache length."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ConfigError("every prompt must hold at least one token")
    longest = max(map(len, prompts))
    lo, hi = min(min(p) for p in prompts), max(max(p) for p in prompts)
    if lo < 0 or hi >= cfg.vocab_size:
        raise ConfigError(f"prompt token ids must be in [0, {cfg.vocab_size}), got [{lo}, {hi}]")
    length = d.cache_length or longest + d.max_new_tokens
    if longest > length:
        raise ConfigError(f"the prompt of {longest} tokens is longer than decode.cache_length={length}; "
                          "shorten it or raise decode.cache_length")
    if longest + d.max_new_tokens > length:
        raise ConfigError(f"the prompt of {longest} tokens + decode.max_new_tokens={d.max_new_tokens} do not fit "
                          f"in decode.cache_length={length}; lower max_new_tokens or raise cache_length")
    if cfg.position == "learned" and length > cfg.block_size:
        raise ConfigError(f"this model has learned positions up to model.block_size={cfg.block_size}, but the "
                          f"prompt of {longest} tokens + decode.max_new_tokens={d.max_new_tokens} need {length}; "
                          "shorten the prompt or lower decode.max_new_tokens")
    return length


PAD = 16


def padded_prompts(prompts: Sequence[Sequence[int]], T: int) -> tuple[np.ndarray, np.ndarray]:
    """The prompts right-padded with 0 to [B, T] (the padding is masked) and their lengths [B]."""
    prompts_BT = np.zeros((len(prompts), T), np.int32)
    for b, p in enumerate(prompts):
        prompts_BT[b, :len(p)] = p
    return prompts_BT, np.asarray([len(p) for p in prompts], np.int32)


def row_sampling(d: DecodeConfig, stop_ids: Sequence[int], B: int) -> sampling.RowSampling:
    """The settings of B rows as the decode loop takes them (arrays, so that new values reuse the program): row b
    samples from key(d.seed) folded with b, as the server samples a request's choice b of that seed."""
    stop_BM = np.full((B, max(len(stop_ids), 1)), -1, np.int32)
    stop_BM[:, :len(stop_ids)] = list(stop_ids)
    full = lambda x, dtype: np.full((B,), x, dtype)  # noqa: E731
    return sampling.RowSampling(full(d.max_new_tokens, np.int32), stop_BM, full(False, bool),
                                full(d.seed % 2**32, np.uint32), np.arange(B, dtype=np.int32), full(0, np.int32),
                                full(d.temperature, np.float32), full(d.top_k, np.int32), full(d.top_p, np.float32))


def _round_up(n: int) -> int:
    return -(-n // PAD) * PAD


_EXECUTABLES: dict = {}  # (prefill, decode) compiled for a key of shapes, shardings and static settings
MAX_EXECUTABLES = 32  # kept in such a dict (here and in speculative.py); the oldest is dropped first
_EXECUTABLES_LOCK = threading.Lock()


def signature(args) -> tuple:
    """What of a call's arguments selects its compiled program: their structure, shapes, dtypes and shardings."""
    return jax.tree.structure(args), tuple((np.shape(a), str(a.dtype), getattr(a, "sharding", None))
                                           for a in jax.tree.leaves(args))


def compiled_once(executables: dict, key, compile: Callable):
    """executables[key], made by compile() when it is missing (compiled once per process: a server or notebook
    calling again with the same shapes compiles nothing); at most MAX_EXECUTABLES are kept, the oldest dropped
    first. Threads may call it at once (two may then compile the same program)."""
    with _EXECUTABLES_LOCK:
        found = executables.get(key)
    if found is not None:
        return found
    made = compile()
    with _EXECUTABLES_LOCK:
        while len(executables) >= MAX_EXECUTABLES:
            executables.pop(next(iter(executables)))  # the oldest
        return executables.setdefault(key, made)


def executables() -> list[tuple]:
    """The (prefill, decode) executables this process has compiled for generate, oldest first (a profile reads
    their optimized HLO: benchmarks/gpu_sections.py)."""
    with _EXECUTABLES_LOCK:
        return list(_EXECUTABLES.values())


def _compiled(params, prompts_BT, lengths_B, sampled, cfg: ModelConfig, length: int, d: DecodeConfig, mesh,
              stream: bool, images=None):
    """The prefill and decode executables for these shapes, on this mesh, compiled once per process."""
    layout = sharding.layout(mesh)
    unroll = cfg.n_layers <= UNROLL_LAYERS
    k = (signature((params, prompts_BT, lengths_B, sampled, images)), cfg, length, d.quantize_kv_cache,
         d.max_new_tokens, layout, stream, unroll)

    def compile():
        T = prompts_BT.shape[1]
        first = segments(T, length, d.max_new_tokens)[0][0]
        static = dict(cfg=cfg, cache_length=first, quantize=d.quantize_kv_cache, layout=layout)
        prefill = _prefill.lower(params, prompts_BT, lengths_B, images=images, **static).compile()
        logits_shape, cache_shape = jax.eval_shape(partial(_prefill, images=images, **static), params, prompts_BT,
                                                   lengths_B)
        decode = _decode.lower(params, logits_shape, cache_shape, sampled, np.int32(0), cfg, d.max_new_tokens,
                               stream, T, length, unroll, layout).compile()
        return prefill, decode

    return compiled_once(_EXECUTABLES, k, compile)


def generate(params, cfg: ModelConfig, prompts: Sequence[Sequence[int]], d: DecodeConfig,
             stop_ids: Sequence[int] = (), on_tokens: Callable[[np.ndarray, np.ndarray], None] | None = None,
             mesh: jax.sharding.Mesh | None = None, images: np.ndarray | None = None) -> Generation:
    """Sample d.max_new_tokens (at most) after each prompt, all prompts decoded as one batch. `on_tokens(tokens,
    live)` is called on the host after every step with the new token of each sequence and whether it is still
    generating. With a mesh, activations and the cache are sharded by the logical-axis rules (batch, kv_heads).
    images (a model with a vision tower): the prompts' preprocessed images [n, side, side, 3] in the order of
    their image tokens (data/images.py), encoded in the prefill."""
    validate_decode(d)
    length = check_prompts(prompts, cfg, d)
    # Prompt and cache lengths are rounded up to a multiple of PAD (padding is masked), so that prompts of
    # similar lengths share compiled programs. Learned positions stop at block_size, which check_prompts has
    # already found long enough for the unpadded lengths.
    B, T = len(prompts), _round_up(max(map(len, prompts)))
    if d.cache_length is None:
        length = T + d.max_new_tokens
    if cfg.position == "learned":
        T, length = min(T, cfg.block_size), min(length, cfg.block_size)
    prompts_BT, lengths_B = padded_prompts(prompts, T)
    sampled = row_sampling(d, stop_ids, B)
    t0 = time.perf_counter()
    images = images_as_input(images, cfg, prompts)
    prefill, decode = _compiled(params, prompts_BT, lengths_B, sampled, cfg, length, d, mesh, on_tokens is not None,
                                images)
    t1 = time.perf_counter()
    logits_BV, cache = jax.block_until_ready(prefill(params, prompts_BT, lengths_B, images=images))
    t2 = time.perf_counter()
    streamed = streaming(_InOrder(on_tokens)) if on_tokens is not None else contextlib.nullcontext(np.int32(0))
    with streamed as stream_id:
        out_BN, count_B = jax.block_until_ready(decode(params, logits_BV, cache, sampled, stream_id))
        jax.effects_barrier()
    t3 = time.perf_counter()
    out_BN, count_B = np.asarray(out_BN), np.asarray(count_B)
    return Generation([out_BN[b, :count_B[b]].tolist() for b in range(B)], t1 - t0, t2 - t1, t3 - t2)

