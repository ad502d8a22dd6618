"""The out-of-memory advisor: when a train step does not fit, name its largest buffers by the model's name
scopes (attention scores, logits, MLP activations, ...) with their sizes, and the setting that removes each.

XLA:TPU's out-of-memory error gives totals only, so the attribution comes from a compile that does fit: the
same step at per-device batch 1 (buffers scaled back up by the batch ratio, an estimate), or, at batch 1
already, the same mesh on chips with more memory (v5p). The buffers are read from the optimized HLO of that
compile: every array an instruction outside a fusion produces is materialized on the device.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, NamedTuple

from jaxlm.config import ConfigError

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
          "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+ = (\w+)\[([\d,]*)\]")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
# Name scopes (jax.named_scope in the model) from the most to the least specific, and what removes them.
SCOPES = ("splash_attention", "blockwise_attention", "attention", "chunked_loss", "logits", "mlp_block",
          "attn_block", "embed")


class Buffer(NamedTuple):
    scope: str
    dtype: str
    shape: tuple[int, ...]
    bytes: int
    op_name: str


def largest_buffers(hlo_text: str, top: int = 6) -> list[Buffer]:
    """The `top` largest arrays materialized by the program (instructions outside fusions), largest first,
    each attributed to the innermost model name scope in its op_name ('other' when none)."""
    found = []
    fused = False
    for line in hlo_text.splitlines():
        if line and not line[0].isspace():  # a computation's header: fusion bodies are never materialized
            fused = "fused" in line.split("(")[0] or "fusion" in line.split("(")[0]
            continue
        m = _INSTRUCTION.match(line)
        if fused or not m or m[1] not in _BYTES:
            continue
        op_name = _OP_NAME.search(line)
        op_name = op_name[1] if op_name else ""
        shape = tuple(int(d) for d in m[2].split(",") if d)
        size = _BYTES[m[1]]
        for d in shape:
            size *= d
        words = set(re.findall(r"\w+", op_name))  # scopes appear wrapped too: jvp(logits), transpose(...)
        scope = next((s for s in SCOPES if s in words), "other")
        found.append(Buffer(scope, m[1], shape, size, op_name))
    # Copies and loop buffers carry no op_name: they take the scope of a named buffer of the same array shape.
    named = {(b.dtype, _squeezed(b.shape)): b.scope for b in found if b.scope != "other"}
    found = [b._replace(scope=named.get((b.dtype, _squeezed(b.shape)), "other")) if b.scope == "other" else b
             for b in found]
    found.sort(key=lambda b: -b.bytes)
    out, seen = [], set()
    for b in found:  # the same buffer recurs (forward, rematerialized forward, backward): list each kind once
        if (b.scope, b.dtype, _squeezed(b.shape)) not in seen:
            seen.add((b.scope, b.dtype, _squeezed(b.shape)))
            out.append(b)
    return out[:top]


def _squeezed(shape):
    return tuple(d for d in shape if d != 1)


def remedy(scope: str, model_cfg) -> str:
    """The setting that removes (or shrinks) a scope's buffers, from what this run uses."""
    m = model_cfg
    if scope == "attention" and m.attention == "dot_product":
        return "model.attention=blockwise (or splash on TPU): O(T x block) instead of [T, T] scores"
    if scope in ("logits", "chunked_loss"):
        if 0 < m.loss_chunk_tokens < m.block_size:
            return f"a smaller model.loss_chunk_tokens (now {m.loss_chunk_tokens}): [B, chunk, V] logits"
        return "model.loss_chunk_tokens=512: the [B, T, V] logits a chunk at a time"
    if scope in ("mlp_block", "attn_block", "attention", "blockwise_attention", "splash_attention"):
        if m.remat not in ("full", "offload_layer_inputs"):
            return f"model.remat=full (now {m.remat})"
        if m.remat == "full":
            return "model.remat=offload_layer_inputs (the layers' saved inputs in host memory)"
        return "a smaller training.per_device_batch_size, or more FSDP devices"
    return "a smaller training.per_device_batch_size, or more FSDP devices"


def advise(result, compile_for: Callable, make_target: Callable, log: Callable[[str], None] = print) -> list[str]:
    """Lines naming the largest buffers of a step that did not fit and the setting that removes each, from a
    compile that does fit (see the module docstring); [] when no such compile succeeds."""
    cfg, tgt = result.run.cfg, result.target
    pdb = cfg.training.per_device_batch_size
    if pdb > 1:
        small = cfg.replace(training=dataclasses.replace(cfg.training, per_device_batch_size=1.0))
        scale, how = pdb, f"from a compile at per_device_batch_size=1, scaled x{pdb:g}"
        target = tgt
    else:
        roomier = _roomier_topology(cfg.compile.topology, tgt)
        if roomier is None:
            return []
        small, scale, how = cfg, 1.0, f"from a compile of the same mesh on {roomier} (95 GiB chips)"
        try:
            target = make_target(dataclasses.replace(cfg.compile, topology=roomier, hbm_gib=None))
        except ConfigError:
            return []
    log(f"advisor: attributing the memory {how} ...")
    r = compile_for(small, target)
    if r.executable is None:
        return []
    buffers = largest_buffers(r.executable.as_text())
    lines = [f"largest buffers per device ({how}), by name scope:"]
    for b in buffers:
        shape = f"{b.dtype}[{','.join(map(str, b.shape))}]"
        lines.append(f"  {b.scope:<20} {b.bytes * scale / 2**30:>8.2f} GiB  {shape:<28} -> "
                     f"{remedy(b.scope, cfg.model)}")
    return lines


def _roomier_topology(name: str, tgt) -> str | None:
    """The same number of chips as v5p (95 GiB each; its names count two TensorCores a chip), for TPU targets
    with less memory per chip."""
    m = re.fullmatch(r"(v\d+[a-z]?)-(\d+)", name.strip().lower())
    if tgt.platform != "tpu" or not m or m[1] == "v5p":
        return None
    chips = len(tgt.devices) // max(1, tgt.num_slices)
    return f"v5p-{2 * chips}"
