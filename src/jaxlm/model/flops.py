"""Parameter counts and model FLOPs per token, from the model's weight declarations (`jaxlm describe`, MFU).

Training FLOPs per token (forward + backward, the figure MFU is computed from): 6 per weight of every matmul a
token goes through (attention projections, latent attention's included; the router, shared experts and
experts_per_token of the routed experts, or the dense MLP; the output projection, tied to the token embedding or
not; multi-token prediction modules; norms, biases and the embedding lookup are not matmuls) plus the attention
scores and the weighted sum of values, 12 * layers * heads * head_dim * block_size for the full square as nanoGPT
counts it, or half that when only the causal triangle is counted (`causal=True`, what jaxlm prints); local and
chunked layers count their band of keys.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxlm import params as P
from jaxlm.config import ModelConfig
from jaxlm.model import kvcache, stack, vision, vision_qwen
from jaxlm.model.transformer import param_specs


def non_embedding_params(cfg: ModelConfig) -> int:
    """Parameters other than the token and position embedding tables (`--print-params`, model scaling)."""
    return P.count(param_specs(cfg), exclude=lambda path: path.startswith("['embed']"))


# The leaves of the weights tree that a token multiplies by (the rest: norms, biases, sinks, balancing biases,
# learned positions); the experts' own are counted experts_per_token / n_experts of the time.
MATMUL_LEAVES = ("q", "k", "v", "o", "q_a", "q_b", "kv_a", "k_rope", "k_b", "v_b", "up", "gate", "down",
                 "shared_up", "shared_gate", "shared_down", "router", "proj", "lm_head")
EXPERT_LEAVES = ("up", "gate", "down", "up_bias", "gate_bias", "down_bias")


def _leaves(specs) -> list[tuple[list[str], tuple[int, ...]]]:
    flat = jax.tree_util.tree_flatten_with_path(specs, is_leaf=P.is_spec)[0]
    return [([k.key for k in path], s.shape) for path, s in flat]


def _is_expert(path: list[str], specs) -> bool:
    """An experts' weight: under an MLP whose weights include a router."""
    node = specs
    for k in path[:-1]:
        node = node[k]
    return path[-1] in EXPERT_LEAVES and "router" in node


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """total: the model's weights (the multi-token prediction modules apart, as the families publish them);
    active: those one token uses, the routed experts counted experts_per_token of n_experts (Meta's and
    Qwen's convention); active_matmul: active without the input embedding table when it is not also the
    output projection (a token reads one row of it: OpenAI's and DeepSeek's convention); embedding: the token
    table; non_embedding: total without the token table and the output projection; mtp: the multi-token
    prediction modules; vision: the vision tower and projector (in total, not in active: they run per image)."""
    specs = param_specs(cfg)
    out = {"total": 0, "active": 0, "embedding": 0, "mtp": 0, "vision": 0}
    for path, shape in _leaves(specs):
        n = math.prod(shape)
        if path[0] == "mtp":
            out["mtp"] += n
            continue
        out["total"] += n
        if path[0] == "vision":
            out["vision"] += n
            continue
        out["active"] += n * cfg.experts_per_token // cfg.n_experts if _is_expert(path, specs) else n
        if path[:2] == ["embed", "tokens"]:
            out["embedding"] += n
    out["active_matmul"] = out["active"] - (0 if cfg.tie_embeddings else out["embedding"])
    out["non_embedding"] = out["total"] - out["embedding"] - (0 if cfg.tie_embeddings else cfg.d_model * cfg.vocab_size)
    return out


def matmul_weights(cfg: ModelConfig) -> int:
    """Weights that take part in a matmul for every token: per layer the attention projections (latent
    attention's included), the router, shared experts and experts_per_token of the routed experts (or the
    dense MLP), plus the output projection (counted whether or not it shares its table with the token
    embedding) and, with multi-token prediction, its modules (they run in every training step)."""
    specs = param_specs(cfg)
    total = 0
    for path, shape in _leaves(specs):
        n = math.prod(shape)
        if path[0] == "vision":  # per image, not per token
            continue
        if path[-1] in MATMUL_LEAVES or (path[:2] == ["embed", "tokens"] and cfg.tie_embeddings):
            total += n * cfg.experts_per_token // cfg.n_experts if _is_expert(path, specs) else n
    return total + cfg.mtp_layers * cfg.d_model * cfg.vocab_size  # the MTP modules share the output projection


def attention_keys(cfg: ModelConfig, causal: bool) -> float:
    """Keys a query attends to, summed over the layers (and the MTP modules' global ones): block_size for
    global layers (half with `causal`), the window or chunk for local and chunked ones (all of their band)."""
    T = cfg.block_size
    total = 0.0
    for kind in stack.layout(cfg).kinds + (stack.Kind("global", False),) * cfg.mtp_layers:
        band = {"local": cfg.sliding_window, "chunked": cfg.attention_chunk}.get(kind.attention)
        total += min(band, T) if band else (T / 2 if causal else T)
    return total


def flops_per_token(cfg: ModelConfig, causal: bool = False) -> float:
    """Training FLOPs (forward + backward) per token: 6 per matmul weight (matmul_weights) plus the attention
    scores and weighted values, 6 * heads * (query-key width + value width) per key a query attends to
    (12 * layers * heads * head_dim * block_size for the full square, as nanoGPT's estimate_mfu counts it).
    The default counts full-square global attention; `causal=True` counts half of it, the work a causal model
    needs, and is what `jaxlm train` reports. Local and chunked layers count their band."""
    attention = 6.0 * cfg.n_heads * (cfg.qk_dim + cfg.v_dim) * attention_keys(cfg, causal)
    return 6.0 * matmul_weights(cfg) + attention


def describe_model(cfg: ModelConfig) -> list[str]:
    """`jaxlm describe`: parameter counts (total, active per token both ways, embedding, MTP modules), the
    layer layout, training FLOPs per token and KV-cache bytes per token, one line each."""
    c = param_counts(cfg)
    lay = stack.layout(cfg)
    n_moe = sum(k.moe for k in lay.kinds)
    lines = [f"parameters {c['total']:,} total ({c['total'] / 1e9:.3g}B), active per token {c['active']:,} "
             f"({c['active'] / 1e9:.3g}B; {c['active_matmul']:,} = {c['active_matmul'] / 1e9:.3g}B without the "
             f"input embedding table), embedding {c['embedding']:,}"
             + (f", multi-token prediction modules {c['mtp']:,} more" if c["mtp"] else ""),
             f"layers {cfg.n_layers} ({'; '.join(_layer_summary(lay))}), width {cfg.d_model}, "
             + (f"latent attention (q rank {cfg.q_lora_rank}, kv rank {cfg.kv_lora_rank}) with {cfg.n_heads} heads"
                if cfg.latent else f"{cfg.n_heads} heads of {cfg.hd} ({cfg.kv_heads} kv)")
             + (f", {cfg.n_experts} experts of {cfg.expert_ff} (top {cfg.experts_per_token}"
                + (f", {cfg.n_shared_experts} shared" if cfg.n_shared_experts else "") + f") in {n_moe} layers"
                if n_moe else "") + f", MLP {cfg.ff}",
             f"training FLOPs per token at {cfg.block_size} tokens: {flops_per_token(cfg, causal=True):,.0f} "
             f"(causal attention counted as half)",
             f"KV cache per token of a long sequence: {kvcache.bytes_per_token(cfg):,} bytes in {cfg.compute_dtype}"
             + _cache_comparison(cfg)]
    if cfg.vision is None:
        return lines
    return lines + [(vision_qwen if cfg.vision.kind == "qwen2_5" else vision).describe(cfg)]


def _cache_comparison(cfg: ModelConfig) -> str:
    """For latent attention: what the same heads' keys and values would take, and a GQA model of the same
    width with 8 kv heads of the value width."""
    if not cfg.latent:
        return ""
    itemsize = jnp.dtype(cfg.compute_dtype).itemsize
    heads = cfg.n_layers * cfg.n_heads * (cfg.qk_dim + cfg.v_dim) * itemsize
    gqa = kvcache.bytes_per_token(dataclasses.replace(cfg, kv_lora_rank=0, q_lora_rank=0, n_kv_heads=8,
                                                      head_dim=cfg.v_head_dim))
    return (f" (latent {cfg.kv_lora_rank} + rotary key {cfg.qk_rope_head_dim} per layer; the heads' own keys and "
            f"values would take {heads:,}, a GQA model with 8 kv heads of {cfg.v_head_dim} {gqa:,})")


def _layer_summary(lay) -> list[str]:
    runs = []
    for kind in lay.kinds:
        name = kind.attention + (" MoE" if kind.moe else "")
        if runs and runs[-1][0] == name:
            runs[-1][1] += 1
        else:
            runs.append([name, 1])
    if len(runs) > 8:  # a long repeating pattern: say it once
        return [f"pattern {','.join(k.attention for k in lay.kinds[lay.start:lay.start + lay.G])} repeated"]
    return [f"{n} {name}" for name, n in runs]
