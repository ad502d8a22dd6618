"""The paged KV cache: every sequence's keys and values in fixed-size pages of one pool, found through a page table
(position p in page table[p // page_size] at offset p % page_size; serve/pages.py hands the pages out). Pattern
entry j's pool keeps a token's entry (*lead, last) as [*lead, R_j, NP, page, last]; every layer keeps every
position. `attention` reads a row's pages `rows` (prefill chunks: gathered per row), `flat` (a few queries per
row: the rows' pages listed one after another, an online softmax per row) or by a TPU kernel, JAX's for decode
(`kernel_decode`) or ours for any rows (`kernel_ragged`), as the pool's format says (PoolFormat; docs/serve.md).
A packed pool (ours with packed_kv) keeps a kv head's key and value as one entry "kv", (K, Hk + Hv), read so here.
Shapes: P rows (sequences) of a call, C tokens per row, T = tokens, R repeats of an entry, NP pages, M pages per
row in the table, F pages listed flat, K kv heads, G query heads per kv head, N = K G, H head width, D width,
S keys."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from jaxlm import runtime, sharding
from jaxlm.config import ConfigError, ModelConfig, kernel_options as parse_kernel_options
from jaxlm.model import attention as attention_lib
from jaxlm.model import kvcache, latent, layers, pool_write, ragged_paged

PAGE_BLOCK_TOKENS = 1024  # keys a step of the flat path's loop reads (64 pages of 16: a few MB, cache-resident)
# ... and at most this many per row of the call: a block is read whole, the pages past the rows' last padding, so
# a call of few rows takes smaller blocks (docs/serve.md, "The paged KV cache")
PAGE_BLOCK_TOKENS_PER_ROW = 256
FLAT_MAX_QUERIES = 16  # rows of up to this many tokens read their pages flat, longer ones by rows
KERNEL_BLOCK_TOKENS = 256  # keys of a row the kernel reads per block (pages_per_compute_block x page_size at most)
PACKED_LANES = 128  # a packed pool's key and value together at most: a TPU vector register's lanes


class PoolFormat(NamedTuple):
    """How a pool is laid out and read: its vectors padded to a multiple of `lane` (lanes), and standard
    attention reading its pages with `kernel`: a ragged_paged.Kernel (ours: decode steps and prefill chunks), or
    a page-attention kernel of the signature of JAX's Pallas paged_attention (decode steps only), or None (the
    flat path); `page`, the page size serve.page_size's default (-1) takes on these devices. pool_format gives a
    platform's; tests pass their own."""
    lane: int = 1
    kernel: Callable | None = None
    page: int = 16


# TPU: the kernel copies each page of each kv head by a DMA of its own, and at 16 positions a page those copies (64
# rows x 8 kv heads x 16 pages x keys and values: 16,384 of 4 KiB for one layer of the 1B shape's decode step) cost
# more than the bytes they move (docs/serve.md, "The paged KV cache"); 128 cuts them eightfold
TPU_PAGE = 128


def lanes(platform: str) -> int:
    """What a pool's vectors (keys, values, latents: entries of shape (*lead, last)) on devices of `platform` are
    padded to a multiple of: 128 on TPU (a vector register's lanes; narrower ones, as heads of 64, made XLA lay the
    pool out with the pages innermost and copy all of it at every write and read: docs/serve.md), else 1. Scales
    are not padded."""
    return 128 if platform == "tpu" else 1


ATTENTION_KERNELS = ("jax", "ragged", "flat")  # serve.attention_kernel's values


def pool_format(platform: str, attention_kernel: str = "ragged", kernel_options: str = "") -> PoolFormat:
    """The format of a pool on devices of `platform`: on TPU 128 lanes and the page-attention kernel
    `attention_kernel` (serve.attention_kernel: "jax", JAX's Pallas paged_attention,
    jax.experimental.pallas.ops.tpu.paged_attention; "ragged", ours, ragged_paged.Kernel, set by
    `kernel_options`, serve.attention_kernel_options; "flat", none), elsewhere neither."""
    if platform != "tpu":
        return PoolFormat(lanes(platform))
    if attention_kernel == "ragged":
        return PoolFormat(lanes(platform), ragged_paged.Kernel(**parse_kernel_options(kernel_options)), TPU_PAGE)
    if attention_kernel == "flat":
        return PoolFormat(lanes(platform), None, TPU_PAGE)
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    return PoolFormat(lanes(platform), paged_attention, TPU_PAGE)


def packs(fmt: PoolFormat | None) -> bool | None:
    """Whether a pool of format `fmt` packs keys and values in one entry (our kernel with packed_kv): True, False,
    or None where the model decides (packed where its pool can be: entry_specs)."""
    return fmt.kernel.packed_kv if fmt is not None and isinstance(fmt.kernel, ragged_paged.Kernel) else False


def page_size(setting: int, fmt: PoolFormat | None = None) -> int:
    """serve.page_size as a pool of format `fmt` takes it (None: this process's default devices'): -1, the default,
    is the format's page (TPU_PAGE on a TPU, 16 elsewhere); 0 (the slot cache) and sizes given stay."""
    return setting if setting >= 0 else (fmt or pool_format(runtime.platform())).page


@jax.tree_util.register_dataclass
@dataclass
class PagedCache:
    """The pool: kinds[j] maps each entry of pattern entry j (entry_specs) to its pages [*lead, R_j, NP, page,
    last]. Page tables and lengths live with the caller (the server's allocator) and come in with each call.
    `kernel`, static (a program over the pool is compiled for it): its format's page-attention kernel."""
    kinds: tuple[dict, ...]
    kernel: Callable | None = field(default=None, metadata=dict(static=True))

    @property
    def pages(self) -> int:
        return next(iter(self.kinds[0].values())).shape[-3]

    @property
    def page_size(self) -> int:
        return next(iter(self.kinds[0].values())).shape[-2]


def entry_specs(cfg: ModelConfig, quantize: bool = False, packed: bool | None = False) -> tuple[dict, ...]:
    """Per pattern entry: {entry name: (trailing shape per token, dtype)}; `packed`, keys and values in one entry
    "kv" (True: a ConfigError where it cannot be: an int8 pool, latent attention, keys and values of more than
    PACKED_LANES together; None: packed where it can be)."""
    K, Hk, Hv = kvcache.widths(cfg)
    if packed is not False:
        why = ("an int8 pool (decode.quantize_kv_cache) keeps its scales apart" if quantize else
               "latent attention's pool is one latent a token" if cfg.latent else
               f"this model's keys and values are {Hk} + {Hv} lanes wide, more than {PACKED_LANES} together (heads "
               f"of at most {PACKED_LANES // 2})" if Hk + Hv > PACKED_LANES else None)
        if why and packed:
            raise ConfigError(f"serve.attention_kernel_options packed_kv=1 packs a kv head's key and value in one "
                              f"vector of {PACKED_LANES} lanes, and {why}: drop packed_kv")
        if not why:
            return tuple({"kv": ((K, Hk + Hv), jnp.dtype(cfg.compute_dtype))} for _ in cfg.pattern)
    if quantize:
        spec = {"k": ((K, Hk), jnp.int8), "v": ((K, Hv), jnp.int8), "k_scale": ((K,), jnp.float32),
                "v_scale": ((K,), jnp.float32)}
    else:
        dt = jnp.dtype(cfg.compute_dtype)
        spec = {"k": ((K, Hk), dt), "v": ((K, Hv), dt)}
    return tuple(spec for _ in cfg.pattern)


def repeats(cfg: ModelConfig, j: int) -> int:
    """The layers of pattern entry j (the last repeat of the pattern may be partial)."""
    return len(range(j, cfg.n_layers, len(cfg.pattern)))


def pool_shape(trailing: tuple[int, ...], layers: int, pages: int, page_size: int, lane: int = 1) -> tuple[int, ...]:
    """[*lead, R, NP, page, last] for an entry of trailing shape (*lead, last), a vector's last padded to a
    multiple of `lane`."""
    last = -(-trailing[-1] // lane) * lane if len(trailing) > 1 else trailing[-1]
    return (*trailing[:-1], layers, pages, page_size, last)


def init(cfg: ModelConfig, pages: int, page_size: int, quantize: bool = False, fmt: PoolFormat = PoolFormat()
         ) -> PagedCache:
    """A pool of `pages` pages of page_size tokens each (zeros: a page's contents matter only once written), of
    format `fmt` (default: unpadded, no kernel; packed where packs(fmt))."""
    return PagedCache(tuple({name: jnp.zeros(pool_shape(shape, repeats(cfg, j), pages, page_size, fmt.lane), dt)
                             for name, (shape, dt) in spec.items()}
                            for j, spec in enumerate(entry_specs(cfg, quantize, packs(fmt)))), fmt.kernel)


def bytes_per_token(cfg: ModelConfig, quantize: bool = False, lane: int | None = None,
                    packed: bool | None = False) -> int:
    """Pool bytes one token's entries take over all layers (vectors padded as init pads them to `lane`; None: as on
    this process's default devices, where the server sizes its pool; `packed`: keys and values in one entry)."""
    lane = lanes(runtime.platform()) if lane is None else lane
    total = 0
    for j, spec in enumerate(entry_specs(cfg, quantize, packed)):
        for shape, dt in spec.values():
            n = 1
            for d in pool_shape(shape, 1, 1, 1, lane):
                n *= d
            total += repeats(cfg, j) * n * jnp.dtype(dt).itemsize
    return total


def entries(k_PCKH: jax.Array, v_PCKH: jax.Array, arrays: dict) -> dict:
    """The per-token entries [P, C, *trailing] for the pool `arrays` (int8 with scales when it holds scales; keys
    and values side by side, written by one scatter, when it is packed)."""
    if "kv" in arrays:
        return {"kv": jnp.concatenate([k_PCKH, v_PCKH.astype(k_PCKH.dtype)], -1)}
    if "k_scale" in arrays:
        (k, k_scale), (v, v_scale) = kvcache.quantize(k_PCKH), kvcache.quantize(v_PCKH)
        return {"k": k, "v": v, "k_scale": k_scale, "v_scale": v_scale}
    return {"k": k_PCKH, "v": v_PCKH}


def write(arrays: dict, r, new: dict, page_PC: jax.Array, off_PC: jax.Array,
          kernel: ragged_paged.Kernel | None = None) -> dict:
    """The pool of one pattern entry with repeat r's entries of tokens [P, C] written at their pages and offsets
    (vectors padded with zeros to the pool's width); a token whose page is out of range (the pool's page count) is
    dropped. Every lead index (kv head) is indexed, not sliced, so that each write is one contiguous vector: with
    a slice over the heads XLA:TPU laid the pool out anew for a prompt's chunk, copying all of it. `kernel` (where
    its write_kernel is set; each row's tokens at consecutive positions, as attention's are): keys and values
    written by model/pool_write.py's kernel."""
    out = {}
    for name, pool in arrays.items():
        lead = pool.ndim - 4  # [*lead, R, NP, page, last]
        if kernel is not None and kernel.write_kernel and lead == 1 and pool_write.fits(pool.shape,
                                                                                         new[name].shape[-1]):
            K, R, NP, A, L = pool.shape
            pages_PC = jnp.where((page_PC >= 0) & (page_PC < NP), page_PC + r * NP, -1)  # the layers' pages as one
            out[name] = pool_write.write_rows(pool.reshape(K, R * NP, A, L), new[name], pages_PC, off_PC,
                                              interpret=kernel.interpret).reshape(pool.shape)
            continue
        value = jnp.moveaxis(new[name], tuple(range(2, 2 + lead)), tuple(range(lead)))  # [*lead, P, C, last]
        value = jnp.pad(value, [(0, 0)] * (value.ndim - 1) + [(0, pool.shape[-1] - value.shape[-1])])
        heads = tuple(jnp.arange(d).reshape((d,) + (1,) * (lead - i + 1)) for i, d in enumerate(pool.shape[:lead]))
        index = heads + (r, page_PC, off_PC, slice(None))
        out[name] = pool.at[index].set(value.astype(pool.dtype), mode="drop")
    return out


def _keys_entry(arrays: dict) -> jax.Array:
    """A pool's keys [K, R, NP, page, last] (a packed pool's keys and values)."""
    return arrays["kv" if "kv" in arrays else "k"]


def _read_kv(arrays: dict, r, ids: jax.Array, dtype, widths: tuple[int, int]) -> tuple[jax.Array, jax.Array]:
    """k and v of pages `ids` [...] of repeat r: [..., K, page, H] in dtype (int8 read with its scales), H the
    entries' own widths (Hk, Hv) without the pool's padding (a packed pool's pages read once, then split)."""
    def one(name):
        pool = arrays[name]
        lead = pool.ndim - 4
        x = pool.at[(slice(None),) * lead + (r, ids)].get(mode="clip")  # [*lead, ..., page, last]
        return jnp.moveaxis(x, tuple(range(lead)), tuple(range(x.ndim - 2 - lead, x.ndim - 2)))

    if "kv" in arrays:
        x = one("kv")
        return x[..., :widths[0]].astype(dtype), x[..., widths[0]:sum(widths)].astype(dtype)

    def scaled(name, width):
        x = one(name)[..., :width]
        if f"{name}_scale" in arrays:
            scale = arrays[f"{name}_scale"].at[r, ids].get(mode="clip")  # [..., page, K]
            return (x.astype(jnp.float32) * jnp.swapaxes(scale, -1, -2)[..., None]).astype(dtype)
        return x.astype(dtype)

    return scaled("k", widths[0]), scaled("v", widths[1])


def gather_rows(arrays: dict, r, table_PM, end_P, dtype, widths: tuple[int, int]):
    """Each row's pages gathered in table order: k, v [P, K, S, H] (S = M x page; H: widths) and the keys'
    positions [P, S] (EMPTY at or past end_P[p])."""
    k_PMKAH, v_PMKAH = _read_kv(arrays, r, table_PM, dtype, widths)
    P, M, K, A, _ = k_PMKAH.shape
    k_PKSH, v_PKSH = (x.transpose(0, 2, 1, 3, 4).reshape(P, K, M * A, x.shape[-1]) for x in (k_PMKAH, v_PMKAH))
    s_PS = jnp.broadcast_to(jnp.arange(M * A, dtype=jnp.int32), (P, M * A))
    return k_PKSH, v_PKSH, jnp.where(s_PS < end_P[:, None], s_PS, kvcache.EMPTY)


def flat_pages(table_PM: jax.Array, end_P: jax.Array, page_size: int, block: int):
    """The pages holding keys below each row's end, listed row after row: page ids [F], their rows [F] (P past
    the last listed), their index in the row's table [F], and how many are listed. F = P M rounded up to a
    multiple of `block`, and at least two blocks: where a call of one row listed a single block, XLA:CPU copied
    the whole pool every call (docs/serve.md, "Measured")."""
    P, M = table_PM.shape
    count_P = (end_P + page_size - 1) // page_size
    cum_P = jnp.cumsum(count_P)
    F = max(-(-(P * M) // block), 2) * block
    f = jnp.arange(F, dtype=jnp.int32)
    row_F = jnp.searchsorted(cum_P, f, side="right").astype(jnp.int32)
    j_F = f - jnp.where(row_F > 0, jnp.take(cum_P, row_F - 1, mode="clip"), 0)
    page_F = table_PM[jnp.minimum(row_F, P - 1), jnp.clip(j_F, 0, M - 1)]
    return page_F, jnp.where(f < cum_P[-1], row_F, P), j_F, cum_P[-1]


def attend_flat(q_PCNH, read, K: int, A: int, table_PM, end_P, q_pos_PC, scale, softcap, window, chunk,
                sinks_N=None):
    """Each row's queries over the keys below its end in its pages (the mask of a window or chunk as
    attention.mask), reading only the pages that hold keys: every row's listed flat (flat_pages) and taken
    PAGE_BLOCK_TOKENS keys at a time (PAGE_BLOCK_TOKENS_PER_ROW per row when the call has few rows) by
    `read(ids) -> (k [F, K, A, H], v [F, K, A, Hv])` (A tokens a page),
    the softmax carried across blocks per row (running maximum, sum and output, as flash attention does; sinks_N,
    a logit per query head, start them). Returns [P, C, N, Hv]."""
    P, C, N, H = q_PCNH.shape
    G = N // K
    Fb = max(1, min(PAGE_BLOCK_TOKENS, PAGE_BLOCK_TOKENS_PER_ROW * P) // A)
    page_F, row_F, j_F, listed = flat_pages(table_PM, end_P, A, Fb)
    # queries [P, K, G C, H], in (g, c) order; their positions in the same order
    q_PKQH = q_PCNH.reshape(P, C, K, G, H).transpose(0, 2, 3, 1, 4).reshape(P, K, G * C, H)
    q_pos_PQ = jnp.tile(q_pos_PC, (1, G))
    neg = jnp.finfo(jnp.float32).min

    def block(i, carry):
        m_PKQ, l_PKQ, acc_PKQH = carry
        take = lambda x: jax.lax.dynamic_slice_in_dim(x, i * Fb, Fb)  # noqa: E731
        ids, rows, js = take(page_F), take(row_F), take(j_F)
        k_FKAH, v_FKAH = read(ids)
        q_FKQH = jnp.take(q_PKQH, rows, axis=0, mode="clip")
        # precision "highest": at the default, XLA:TPU cast the whole pool to bfloat16 for these dots, before the
        # gather and outside the loop (docs/serve.md, "The paged KV cache")
        logits_FKQA = jnp.einsum("FKQH,FKAH->FKQA", q_FKQH, k_FKAH, preferred_element_type=jnp.float32,
                                 precision="highest")
        logits_FKQA = layers.softcap(logits_FKQA * scale, softcap)
        k_pos_FA = js[:, None] * A + jnp.arange(A, dtype=jnp.int32)
        q_pos_FQ = jnp.take(q_pos_PQ, rows, axis=0, mode="clip")
        end_F = jnp.take(end_P, rows, mode="clip")
        ok_FQA = attention_lib.mask(q_pos_FQ, k_pos_FA, window, chunk=chunk) & (
            k_pos_FA[:, None, :] < end_F[:, None, None])
        logits_FKQA = jnp.where(ok_FQA[:, None], logits_FKQA, neg)
        m_new = jnp.maximum(m_PKQ, jax.ops.segment_max(logits_FKQA.max(-1), rows, P, indices_are_sorted=True))
        p_FKQA = jnp.where(ok_FQA[:, None], jnp.exp(logits_FKQA - jnp.take(m_new, rows, axis=0, mode="clip")[
            ..., None]), 0)
        alpha = jnp.exp(m_PKQ - m_new)
        l_PKQ = l_PKQ * alpha + jax.ops.segment_sum(p_FKQA.sum(-1), rows, P, indices_are_sorted=True)
        out_FKQH = jnp.einsum("FKQA,FKAH->FKQH", p_FKQA.astype(v_FKAH.dtype), v_FKAH,
                              preferred_element_type=jnp.float32, precision="highest")
        acc_PKQH = acc_PKQH * alpha[..., None] + jax.ops.segment_sum(out_FKQH, rows, P, indices_are_sorted=True)
        return m_new, l_PKQ, acc_PKQH

    Hv = jax.eval_shape(read, page_F[:Fb])[1].shape[-1]
    if sinks_N is None:
        m0, l0 = jnp.full((P, K, G * C), neg), jnp.zeros((P, K, G * C))
    else:  # a sink is a key every query sees, of logit sinks_N[n] and value zero: the softmax's starting point
        m0 = jnp.broadcast_to(jnp.repeat(sinks_N.astype(jnp.float32).reshape(K, G), C, axis=1), (P, K, G * C))
        l0 = jnp.ones((P, K, G * C))
    init = (m0, l0, jnp.zeros((P, K, G * C, Hv)))
    _, l_PKQ, acc_PKQH = jax.lax.fori_loop(0, (listed + Fb - 1) // Fb, block, init)
    out_PKQH = acc_PKQH / jnp.maximum(l_PKQ, jnp.finfo(jnp.float32).tiny)[..., None]
    return out_PKQH.reshape(P, K, G, C, Hv).transpose(0, 3, 1, 2, 4).reshape(P, C, N, Hv).astype(q_PCNH.dtype)


def decode_kernel(kernel: Callable | None, arrays: dict, C: int, window, chunk, sinks, latent_attention: bool):
    """The pool's page-attention kernel if this call can use it, else None: standard attention over an
    unquantized pool, without windows, chunks or sinks, on one device (the kernels are not partitioned over a
    mesh); JAX's kernel takes decode steps (C = 1) of keys and values of one width only, ours
    (ragged_paged.Kernel) any C."""
    if kernel is None or latent_attention or "k_scale" in arrays or window is not None or chunk is not None or (
            sinks is not None) or sharding.mesh_size() > 1:
        return None
    if isinstance(kernel, ragged_paged.Kernel):
        return kernel
    return kernel if C == 1 and "k" in arrays and arrays["k"].shape[-1] == arrays["v"].shape[-1] else None


def kernel_ragged(kernel: ragged_paged.Kernel, q_PCNH, arrays: dict, r, table_PM, end_P, q_pos_PC, scale: float,
                  softcap, Hv: int) -> jax.Array:
    """Each row's queries (at q_pos_PC, causal) over its keys below end_P by our ragged kernel, the pool's layers
    seen as one axis of pages (repeat r's page i is r NP + i) as in kernel_decode; the output cut to the values'
    width Hv (a packed pool: the values' lanes, past the keys' H). Returns [P, C, N, Hv]."""
    K, R, NP, A, _ = _keys_entry(arrays).shape
    ids_PM = jnp.clip(table_PM, 0, NP - 1).astype(jnp.int32) + r * NP
    pages = lambda x: x.reshape(K, R * NP, A, x.shape[-1])  # noqa: E731
    k, v = (pages(arrays["kv"]), None) if "kv" in arrays else (pages(arrays["k"]), pages(arrays["v"]))
    start = q_PCNH.shape[-1] if v is None else 0
    return kernel(q_PCNH, k, v, end_P, ids_PM, q_pos_PC, scale=scale, softcap=softcap, values=(start, Hv))


def kernel_decode(kernel, q_P1NH, arrays: dict, r, table_PM, end_P, scale: float, softcap) -> jax.Array:
    """Each row's query over its keys below end_P by `kernel` (JAX's paged_attention signature: q [P, N, H],
    pages [K, pages, page, H], lengths [P], page indices [P, M]), the pool's layers seen as one axis of pages
    (repeat r's page i is r NP + i); the query padded with zeros to the pool's width (its lanes), the output cut back
    to the query's. Rows with no keys give zeros. Returns [P, 1, N, H]."""
    K, R, NP, A, Hp = arrays["k"].shape
    M, H = table_PM.shape[1], q_P1NH.shape[-1]
    per_block = max(d for d in range(1, M + 1) if M % d == 0 and d * A <= max(KERNEL_BLOCK_TOKENS, A))
    ids_PM = jnp.clip(table_PM, 0, NP - 1).astype(jnp.int32) + r * NP
    k, v = (arrays[name].reshape(K, R * NP, A, Hp) for name in ("k", "v"))
    q_PNH = jnp.pad(q_P1NH[:, 0] * scale, ((0, 0), (0, 0), (0, Hp - H))).astype(k.dtype)
    out_PNH = kernel(q_PNH, k, v, end_P.astype(jnp.int32), ids_PM, attn_logits_soft_cap=softcap,
                     pages_per_compute_block=per_block)[..., :H]
    return jnp.where(end_P[:, None, None] > 0, out_PNH, 0).astype(q_P1NH.dtype)[:, None]


def attention(h_PCD, p, cfg: ModelConfig, arrays: dict, r, q_pos_PC, page_PC, off_PC, table_PM, end_P,
              kind: str, flat: bool, kernel: Callable | None = None):
    """One layer's attention (of attention kind `kind`; latent attention when cfg.latent) for tokens [P, C] at
    positions q_pos_PC over a paged cache: their entries are written first (at page_PC, off_PC; out-of-range
    pages drop the padding's), then each row's queries attend to its keys below end_P (their own included)
    through its page table (flat, or by the pool's page-attention `kernel` where decode_kernel takes it: ours for
    every row, JAX's for decode steps).
    Returns the output and the layer kind's updated pool."""
    attn_mod = latent if cfg.latent else attention_lib
    with jax.named_scope("latent_attention" if cfg.latent else "attention"):
        q_PCNH, (k_PCKH, v_PCKH) = attn_mod.project_entries(h_PCD, p, cfg, q_pos_PC, kind)
        window, chunk = attention_lib.limits(cfg, kind)
        widths = kvcache.widths(cfg)[1:]
        kernel = decode_kernel(kernel, arrays, q_PCNH.shape[1], window, chunk, p.get("sinks"), cfg.latent)
        ours = kernel if isinstance(kernel, ragged_paged.Kernel) else None
        arrays = write(arrays, r, entries(k_PCKH, v_PCKH, arrays), page_PC, off_PC, ours)
        if isinstance(kernel, ragged_paged.Kernel):
            out_PCNH = kernel_ragged(kernel, q_PCNH, arrays, r, table_PM, end_P, q_pos_PC, attention_lib.scale(cfg),
                                     cfg.attn_logit_softcap, widths[1])
            return attention_lib.project_out(out_PCNH, p), arrays
        if not flat:
            k_PKSH, v_PKSH, k_pos_PS = gather_rows(arrays, r, table_PM, end_P, q_PCNH.dtype, widths)
            mask_PCS = attention_lib.mask(q_pos_PC, k_pos_PS, window, chunk=chunk)
            return attn_mod.attend_entries(q_PCNH, k_PKSH, v_PKSH, mask_PCS, p, cfg), arrays
        if kernel is not None:
            out_P1NH = kernel_decode(kernel, q_PCNH, arrays, r, table_PM, end_P, attention_lib.scale(cfg),
                                     cfg.attn_logit_softcap)
            return attention_lib.project_out(out_P1NH, p), arrays
        K, A = _keys_entry(arrays).shape[0], _keys_entry(arrays).shape[-2]
        read = lambda ids: _read_kv(arrays, r, ids, q_PCNH.dtype, widths)  # noqa: E731
        if cfg.latent:  # absorbed: keys [latent, rotary key], values the latents
            def read(ids, plain=read):
                kr_FKAr, c_FKAC = plain(ids)
                return latent.absorbed_keys(kr_FKAr, c_FKAC), c_FKAC

            q_PCNH = latent.absorb_query(q_PCNH, p, cfg)
        out_PCNH = attend_flat(q_PCNH, read, K, A, table_PM, end_P, q_pos_PC, attention_lib.scale(cfg),
                               cfg.attn_logit_softcap, window, chunk, p.get("sinks"))
        if cfg.latent:
            return latent.absorbed_output(out_PCNH, p), arrays
        return attention_lib.project_out(out_PCNH, p), arrays
