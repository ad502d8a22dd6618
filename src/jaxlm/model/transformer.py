"""The one forward pass shared by every family: embed, a scanned stack of pre-norm blocks, norm, logits.

Families differ only through named ModelConfig options (norm kind, biases, post-norms, soft-caps, local or
global attention per layer, dense or mixture-of-experts MLP); there is no per-family code path. `prefill` and
`decode_step` are the same blocks run over a KV cache (model/kvcache.py) for generation.

Shape legend: B batch, T length, D model width, V vocab, L layers, N heads, K kv heads, H head width,
F MLP hidden width, E experts, P layers per repeat of cfg.layer_pattern, S cache slots.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxlm import quant
from jaxlm.config import ModelConfig
from jaxlm.model import attention, kvcache, layers, moe, pipeline
from jaxlm.params import ParamSpec, normal, ones, zeros
from jaxlm.sharding import constrain
from jaxlm.sharding import pipeline as pipeline_settings


def _norm_specs(cfg: ModelConfig, shape, axes) -> dict:
    p = {"scale": ParamSpec(shape, axes, zeros if cfg.norm_plus_one else ones, cfg.param_dtype)}
    if cfg.norm == "layernorm" and cfg.bias:
        p["bias"] = ParamSpec(shape, axes, zeros, cfg.param_dtype)
    return p


def param_specs(cfg: ModelConfig) -> dict:
    """Every weight of the model, declared once. Layer weights are stacked along a leading `layers` axis."""
    assert cfg.vocab_size is not None, "vocab_size must be resolved before building the model"
    L, D, N, K, H, F, V = cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.hd, cfg.ff, cfg.vocab_size
    dt = cfg.param_dtype
    w = normal(cfg.init_std)
    w_out = normal(cfg.init_std / (2 * L) ** 0.5)  # residual-branch outputs, as in GPT-2
    attn = {
        "q": ParamSpec((L, D, N, H), ("layers", "embed", "heads", "head_dim"), w, dt),
        "k": ParamSpec((L, D, K, H), ("layers", "embed", "kv_heads", "head_dim"), w, dt),
        "v": ParamSpec((L, D, K, H), ("layers", "embed", "kv_heads", "head_dim"), w, dt),
        "o": ParamSpec((L, N, H, D), ("layers", "heads", "head_dim", "embed"), w_out, dt),
    }
    if cfg.n_experts:
        E = cfg.n_experts
        mlp = {
            "router": ParamSpec((L, D, E), ("layers", "embed", None), w, dt),
            "up": ParamSpec((L, E, D, F), ("layers", "experts", "embed", "mlp"), w, dt),
            "down": ParamSpec((L, E, F, D), ("layers", "experts", "mlp", "embed"), w_out, dt),
        }
        if cfg.glu:
            mlp["gate"] = ParamSpec((L, E, D, F), ("layers", "experts", "embed", "mlp"), w, dt)
    else:
        mlp = {
            "up": ParamSpec((L, D, F), ("layers", "embed", "mlp"), w, dt),
            "down": ParamSpec((L, F, D), ("layers", "mlp", "embed"), w_out, dt),
        }
        if cfg.glu:
            mlp["gate"] = ParamSpec((L, D, F), ("layers", "embed", "mlp"), w, dt)
    if cfg.bias or cfg.qkv_bias:
        attn["q_bias"] = ParamSpec((L, N, H), ("layers", "heads", "head_dim"), zeros, dt)
        attn["k_bias"] = ParamSpec((L, K, H), ("layers", "kv_heads", "head_dim"), zeros, dt)
        attn["v_bias"] = ParamSpec((L, K, H), ("layers", "kv_heads", "head_dim"), zeros, dt)
    if cfg.bias:
        attn["o_bias"] = ParamSpec((L, D), ("layers", "embed"), zeros, dt)
        mlp["up_bias"] = ParamSpec((L, F), ("layers", "mlp"), zeros, dt)
        mlp["down_bias"] = ParamSpec((L, D), ("layers", "embed"), zeros, dt)
    if cfg.qk_norm:
        attn["q_norm"] = _norm_specs(cfg, (L, H), ("layers", "head_dim"))
        attn["k_norm"] = _norm_specs(cfg, (L, H), ("layers", "head_dim"))
    specs = {
        "embed": {"tokens": ParamSpec((V, D), ("vocab", "embed"), w, dt)},
        "layers": {
            "attn_norm": _norm_specs(cfg, (L, D), ("layers", "embed")),
            "attn": attn,
            "mlp_norm": _norm_specs(cfg, (L, D), ("layers", "embed")),
            "mlp": mlp,
        },
        "final_norm": _norm_specs(cfg, (D,), ("embed",)),
    }
    if cfg.post_norms:
        specs["layers"]["attn_post_norm"] = _norm_specs(cfg, (L, D), ("layers", "embed"))
        specs["layers"]["mlp_post_norm"] = _norm_specs(cfg, (L, D), ("layers", "embed"))
    if cfg.position == "learned":
        specs["embed"]["positions"] = ParamSpec((cfg.block_size, D), (None, "embed"), w, dt)
    if not cfg.tie_embeddings:
        specs["lm_head"] = ParamSpec((D, V), ("embed", "vocab"), w, dt)
    return specs


_cp = jax.checkpoint_policies
QKV = ("query_proj", "key_proj", "value_proj")
# What the backward pass keeps of each layer's forward (the rest it recomputes), by the names that
# attention.py and layers.py give activations with checkpoint_name (MaxText's policy names).
REMAT_POLICIES = {
    "full": _cp.nothing_saveable,
    "minimal": _cp.dots_with_no_batch_dims_saveable,
    "save_dots": _cp.checkpoint_dots,
    "save_qkv_proj": _cp.save_only_these_names(*QKV),
    "save_out_proj": _cp.save_only_these_names("out_proj"),
    "save_qkv_out_proj": _cp.save_only_these_names(*QKV, "out_proj"),
    "save_attention": _cp.save_only_these_names(*QKV, "context", "out_proj"),
    "offload_qkv_proj": _cp.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=list(QKV),
        offload_src="device", offload_dst="pinned_host"),
    "offload_attention": _cp.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=[*QKV, "context", "out_proj"],
        offload_src="device", offload_dst="pinned_host"),
    # Full remat whose one saved activation per layer, the layer's input, waits in host memory: the [L, B, T, D]
    # stack that every other policy keeps on the device.
    "offload_layer_inputs": _cp.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=["decoder_layer_input"],
        offload_src="device", offload_dst="pinned_host"),
}


def block(x_BTD: jax.Array, p: dict, cfg: ModelConfig, positions_BT: jax.Array, key: jax.Array | None,
          local: bool = False, segment_ids_BT: jax.Array | None = None):
    """One pre-norm block; returns the new residual stream and the MoE routing statistics [3, E] (an empty
    [3, 0] array for a dense MLP)."""
    keys = jax.random.split(key, 3) if key is not None else (None, None, None)
    # Every use below reads the named copy, so a policy that offloads it leaves no device copy for the backward.
    x_BTD = checkpoint_name(x_BTD, "decoder_layer_input")
    attn = lambda h, q: (attention.attention(h, q, cfg, positions_BT, keys[0], local, segment_ids_BT),  # noqa: E731
                         None)
    x_BTD, stats_3E, _ = _block(x_BTD, p, cfg, attn, keys[1:])
    return x_BTD, stats_3E


def _block(x_BTD, p, cfg: ModelConfig, attn, keys=(None, None)):
    """The block around an attention function attn(h_BTD, p_attn) -> (out_BTD, extra); also returns extra
    (what a cached attention hands back: keys and values, or the updated layer cache)."""
    norm = lambda x, q: layers.norm(x, q, cfg.norm, cfg.norm_eps, cfg.norm_plus_one)  # noqa: E731
    with jax.named_scope("attn_block"):
        h_BTD, extra = attn(norm(x_BTD, p["attn_norm"]), p["attn"])
        if cfg.post_norms:
            h_BTD = norm(h_BTD, p["attn_post_norm"])
        x_BTD = x_BTD + layers.dropout(h_BTD, cfg.dropout, keys[0])
    with jax.named_scope("mlp_block"):
        h_BTD = norm(x_BTD, p["mlp_norm"])
        if cfg.n_experts:
            h_BTD, stats_3E = moe.moe(h_BTD, p["mlp"], cfg.activation, cfg.glu, cfg.experts_per_token,
                                       cfg.expert_capacity_factor, cfg.expert_all_to_all)
        else:
            h_BTD, stats_3E = layers.mlp(h_BTD, p["mlp"], cfg.activation, cfg.glu), jnp.zeros((3, 0), jnp.float32)
        if cfg.post_norms:
            h_BTD = norm(h_BTD, p["mlp_post_norm"])
        x_BTD = x_BTD + layers.dropout(h_BTD, cfg.dropout, keys[1])
    return constrain(x_BTD, ("batch", "length", "embed")), stats_3E, extra


def embed(params: dict, tokens_BT: jax.Array, cfg: ModelConfig, positions_BT: jax.Array) -> jax.Array:
    cdt = jnp.dtype(cfg.compute_dtype)
    with jax.named_scope("embed"):
        x_BTD = quant.take(params["embed"]["tokens"], tokens_BT).astype(cdt)
        if cfg.embed_scale:
            x_BTD = x_BTD * jnp.asarray(cfg.d_model ** 0.5, cdt)  # rounded to the compute dtype, as Gemma does
        if cfg.position == "learned":
            x_BTD = x_BTD + jnp.take(params["embed"]["positions"], positions_BT, axis=0).astype(cdt)
        return x_BTD


def unembed(params: dict, x_BTD: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Final norm and output projection: float32 logits [B, T, V]."""
    cdt = jnp.dtype(cfg.compute_dtype)
    with jax.named_scope("logits"):
        x_BTD = layers.norm(x_BTD, params["final_norm"], cfg.norm, cfg.norm_eps, cfg.norm_plus_one)
        w = params["embed"]["tokens"] if cfg.tie_embeddings else params["lm_head"]
        spec = "BTD,VD->BTV" if cfg.tie_embeddings else "BTD,DV->BTV"
        if quant.applies(w, logits=True):
            logits_BTV = quant.dot(spec, x_BTD, w)
        else:
            # The gradient is pinned in the weights' dtype: the [D, V] sum over the batch is reduced in float32.
            w = layers.pin_grad(w, ("vocab", "embed") if cfg.tie_embeddings else ("embed", "vocab"))
            logits_BTV = jnp.einsum(spec, x_BTD, w.astype(cdt), preferred_element_type=jnp.float32)
        return layers.softcap(logits_BTV, cfg.final_logit_softcap)


# The dense matmul weights of a layer, by block: what _matmul_weights casts and pins.
MATMUL_WEIGHTS = {"attn": ("q", "k", "v", "o"), "mlp": ("up", "gate", "down")}


def _matmul_weights(p: dict, cfg: ModelConfig) -> dict:
    """One layer's weights with its dense matmul weights cast to the compute dtype and their gradients
    pinned to their shardings (layers.matmul_weight). Inside the remat'd layer body, so the cast copies are
    recomputed in the backward pass, never saved. Expert weights are left to moe.py."""
    specs = param_specs(cfg)["layers"]
    cdt = jnp.dtype(cfg.compute_dtype)
    p = {**p}
    for blk, names in MATMUL_WEIGHTS.items():
        if blk == "mlp" and cfg.n_experts:
            continue
        p[blk] = {**p[blk], **{name: layers.matmul_weight(p[blk][name], specs[blk][name].axes[1:], cdt)
                               for name in names if name in p[blk]}}
    return p


def layer_stack(x_BTD: jax.Array, layer_params: dict, cfg: ModelConfig, positions_BT: jax.Array,
                segment_ids_BT: jax.Array | None, layer_keys: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """Run the n layers stacked in layer_params (n a multiple of len(cfg.pattern); the first is a layer of the
    pattern's first kind): the new residual stream and the layers' routing statistics [n, 2, E]."""
    # Layers repeat cfg.layer_pattern (e.g. local, global); a scan step runs one repeat, so alternating
    # layer kinds still compile once per kind, not once per layer.
    pattern = cfg.pattern
    P = len(pattern)
    n = jax.tree.leaves(layer_params)[0].shape[0]
    bodies = []
    for kind in pattern:
        body = lambda x, p, k, local=(kind == "local"): block(x, _matmul_weights(p, cfg), cfg,  # noqa: E731
                                                                positions_BT, k, local, segment_ids_BT)
        if cfg.remat != "none":
            body = jax.checkpoint(body, policy=REMAT_POLICIES[cfg.remat], prevent_cse=not cfg.scan_layers)
        bodies.append(body)
    if cfg.scan_layers:
        def step(x, inputs):
            p_group, k_group = inputs
            stats = []
            for j, body in enumerate(bodies):
                x, s = body(x, jax.tree.map(lambda a: a[j], p_group), None if k_group is None else k_group[j])
                stats.append(s)
            return x, jnp.stack(stats)

        grouped = jax.tree.map(lambda a: a.reshape(n // P, P, *a.shape[1:]), (layer_params, layer_keys))
        x_BTD, stats_n2E = jax.lax.scan(step, x_BTD, grouped)
        return x_BTD, stats_n2E.reshape(n, *stats_n2E.shape[2:])
    stats = []
    for i in range(n):
        p = jax.tree.map(lambda a: a[i], layer_params)
        x_BTD, s = bodies[i % P](x_BTD, p, None if layer_keys is None else layer_keys[i])
        stats.append(s)
    return x_BTD, jnp.stack(stats)


@quant.scoped
def forward_with_aux(params: dict, tokens_BT: jax.Array, cfg: ModelConfig, key: jax.Array | None = None,
                     positions_BT: jax.Array | None = None, segment_ids_BT: jax.Array | None = None
                     ) -> tuple[jax.Array, jax.Array]:
    """Logits [B, T, V] in float32 and the auxiliary (load-balancing) loss, 0 for dense models.

    positions_BT default to 0..T-1 in every row; segment_ids_BT (int32, None = one segment per row) mark the
    documents packed into a row: attention never crosses a segment, and positions restart at each one."""
    x_BTD, aux = hidden_with_aux(params, tokens_BT, cfg, key, positions_BT, segment_ids_BT)
    return unembed(params, x_BTD, cfg), aux


@quant.scoped
def hidden_with_aux(params: dict, tokens_BT: jax.Array, cfg: ModelConfig, key: jax.Array | None = None,
                    positions_BT: jax.Array | None = None, segment_ids_BT: jax.Array | None = None
                    ) -> tuple[jax.Array, jax.Array]:
    """The residual stream after the last block [B, T, D] (before the final norm) and the auxiliary loss."""
    B, T = tokens_BT.shape
    if positions_BT is None:
        positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    if cfg.dropout == 0.0:
        key = None
    x_BTD = embed(params, tokens_BT, cfg, positions_BT)
    if key is not None:
        key, sub = jax.random.split(key)
        x_BTD = layers.dropout(x_BTD, cfg.dropout, sub)
    x_BTD = constrain(x_BTD, ("batch", "length", "embed"))

    layer_keys = jax.random.split(key, cfg.n_layers) if key is not None else None
    run = lambda x, p, pos, seg, keys: layer_stack(x, p, cfg, pos, seg, keys)  # noqa: E731
    if (pipe := pipeline_settings()) is not None:
        axes = jax.tree.map(lambda spec: spec.axes, param_specs(cfg)["layers"],
                            is_leaf=lambda v: isinstance(v, ParamSpec))
        x_BTD, stats_L2E = pipeline.run(run, x_BTD, params["layers"], axes, positions_BT, segment_ids_BT,
                                        layer_keys, pipe, len(cfg.pattern))
    else:
        x_BTD, stats_L2E = run(x_BTD, params["layers"], positions_BT, segment_ids_BT, layer_keys)

    aux = moe.load_balancing_loss(stats_L2E) if cfg.n_experts else jnp.zeros((), jnp.float32)
    return x_BTD, aux


def forward(params: dict, tokens_BT: jax.Array, cfg: ModelConfig, key: jax.Array | None = None,
            positions_BT: jax.Array | None = None, segment_ids_BT: jax.Array | None = None) -> jax.Array:
    """Logits [B, T, V] in float32. `key` enables dropout (training); None is deterministic."""
    return forward_with_aux(params, tokens_BT, cfg, key, positions_BT, segment_ids_BT)[0]


@quant.scoped
def attention_logit_max(params: dict, tokens_BT: jax.Array, cfg: ModelConfig, positions_BT: jax.Array | None = None,
                        segment_ids_BT: jax.Array | None = None) -> jax.Array:
    """The largest attention logit of every layer's query heads over the batch [L, N] (before soft-capping), from
    a forward pass without dropout or output layer: what MuonClip's QK-clip watches (attention.clip_qk)."""
    B, T = tokens_BT.shape
    if positions_BT is None:
        positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    x_BTD = constrain(embed(params, tokens_BT, cfg, positions_BT), ("batch", "length", "embed"))

    def step(x_BTD, p_group):
        tops = []
        for j, kind in enumerate(cfg.pattern):
            def attn(h_BTD, p_attn, local=(kind == "local")):
                return attention.attention_with_logit_max(h_BTD, p_attn, cfg, positions_BT, local, segment_ids_BT)

            x_BTD, _, top_N = _block(x_BTD, _matmul_weights(jax.tree.map(lambda a: a[j], p_group), cfg), cfg, attn)
            tops.append(top_N)
        return x_BTD, jnp.stack(tops)

    with jax.named_scope("attention_logit_max"):
        _, top_RPN = jax.lax.scan(step, x_BTD, _grouped(cfg, params["layers"]))
    return top_RPN.reshape(cfg.n_layers, -1)


def _grouped(cfg: ModelConfig, layer_params: dict) -> dict:
    """Stacked layer weights [L, ...] -> [L / P, P, ...], one scan step per repeat of cfg.layer_pattern."""
    P = len(cfg.pattern)
    return jax.tree.map(lambda a: a.reshape(cfg.n_layers // P, P, *a.shape[1:]), layer_params)


@quant.scoped
def prefill(params: dict, tokens_BT: jax.Array, lengths_B: jax.Array, cfg: ModelConfig, cache_length: int,
            quantize: bool = False) -> tuple[jax.Array, kvcache.KVCache]:
    """Run a batch of prompts, right-padded to T (sequence b has lengths_B[b] real tokens, 1 <= length <=
    cache_length), and fill a fresh cache for sequences of up to `cache_length` tokens. Returns the float32
    logits after each prompt's last real token [B, V] and the cache. Padding sits after the real tokens, so
    causality alone keeps it out of their attention, and prefill_layout leaves it out of the cache."""
    B, T = tokens_BT.shape
    positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    x_BTD = constrain(embed(params, tokens_BT, cfg, positions_BT), ("batch", "length", "embed"))
    layouts = [kvcache.prefill_layout(lengths_B, T, kvcache.slots(cfg, kind, cache_length)) for kind in cfg.pattern]

    def step(x_BTD, p_group):
        entries = []
        for j, kind in enumerate(cfg.pattern):
            def attn(h_BTD, p_attn, local=(kind == "local")):
                out_BTD, k_BTKH, v_BTKH = attention.attention_with_kv(h_BTD, p_attn, cfg, positions_BT, None, local)
                return out_BTD, (k_BTKH, v_BTKH)

            x_BTD, _, kv = _block(x_BTD, jax.tree.map(lambda a: a[j], p_group), cfg, attn)
            entry = {}
            for name, x_BTKH in zip(("k", "v"), kv):
                x_BSKH = jnp.take_along_axis(x_BTKH, layouts[j][0][:, :, None, None], axis=1)
                entry[name], entry[f"{name}_scale"] = kvcache.store(x_BSKH.transpose(0, 2, 1, 3), quantize)
            entries.append(entry)
        return x_BTD, tuple(entries)

    with jax.named_scope("prefill"):
        x_BTD, entries = jax.lax.scan(step, x_BTD, _grouped(cfg, params["layers"]))
        last_B1D = jnp.take_along_axis(x_BTD, (lengths_B - 1)[:, None, None], axis=1)
        logits_BV = unembed(params, last_B1D, cfg)[:, 0]
    kinds = tuple(kvcache.KindCache(pos=layout[1], **e) for layout, e in zip(layouts, entries))
    return logits_BV, kvcache.KVCache(kinds, lengths_B.astype(jnp.int32))


def _decode_inputs(params: dict, tokens_B: jax.Array, pos_B: jax.Array, k_pos: list[jax.Array], cfg: ModelConfig):
    """What a decode step starts from, whatever the cache's layout: the new tokens embedded at positions pos_B
    [B, 1, D], those positions [B, 1], each pattern entry's slot for them ([B] per entry of k_pos, the
    entries' [B, S] positions held) and the positions held once the step has written there."""
    B = tokens_B.shape[0]
    positions_B1 = pos_B[:, None]
    x_B1D = constrain(embed(params, tokens_B[:, None], cfg, positions_B1), ("batch", "length", "embed"))
    slots = [pos_B % p_BS.shape[1] for p_BS in k_pos]
    k_positions = [p_BS.at[jnp.arange(B), slot_B].set(pos_B) for p_BS, slot_B in zip(k_pos, slots)]
    return x_B1D, positions_B1, slots, k_positions


@quant.scoped
def decode_step(params: dict, tokens_B: jax.Array, cache: kvcache.KVCache, cfg: ModelConfig
                ) -> tuple[jax.Array, kvcache.KVCache]:
    """Append one token per sequence at position cache.length: float32 logits of the next token [B, V] and
    the cache holding the new keys and values."""
    pos_B = cache.length
    x_B1D, positions_B1, slots, k_positions = _decode_inputs(params, tokens_B, pos_B, [c.pos for c in cache.kinds],
                                                             cfg)

    def step(carry, inputs):  # the stacked caches ride in the carry: each layer writes its entries in place
        x_B1D, stacks = carry
        p_group, r = inputs
        stacks = list(stacks)
        for j, kind in enumerate(cfg.pattern):
            def attn(h_B1D, p_attn, j=j, local=(kind == "local")):
                return attention.attention_decode(h_B1D, p_attn, cfg, positions_B1, stacks[j], r, slots[j],
                                                  k_positions[j], local)

            x_B1D, _, stacks[j] = _block(x_B1D, jax.tree.map(lambda a: a[j], p_group), cfg, attn)
        return (x_B1D, tuple(stacks)), None

    stacks = tuple({"k": c.k, "v": c.v, "k_scale": c.k_scale, "v_scale": c.v_scale} for c in cache.kinds)
    R = cfg.n_layers // len(cfg.pattern)
    with jax.named_scope("decode"):
        (x_B1D, new), _ = jax.lax.scan(step, (x_B1D, stacks), (_grouped(cfg, params["layers"]), jnp.arange(R)))
        logits_BV = unembed(params, x_B1D, cfg)[:, 0]
    kinds = tuple(kvcache.KindCache(pos=k_pos, **c) for k_pos, c in zip(k_positions, new))
    return logits_BV, kvcache.KVCache(kinds, pos_B + 1)


@quant.scoped
def layer_weights(params: dict, cfg: ModelConfig) -> tuple[dict, ...]:
    """The layers' weights one by one, dense matmul weights in the compute dtype: taken apart once before a
    decode loop (decode_layers), so that its steps neither slice nor cast the stacked weights."""
    return tuple(_matmul_weights(jax.tree.map(lambda a: a[i], params["layers"]), cfg) for i in range(cfg.n_layers))


@quant.scoped
def decode_layers(params: dict, layer_params: tuple[dict, ...], tokens_B: jax.Array, cache: kvcache.LayerCaches,
                  cfg: ModelConfig) -> tuple[jax.Array, kvcache.LayerCaches]:
    """decode_step over the cache taken apart by layer (kvcache.unstack) and the weights (layer_weights), the
    layers unrolled: each reads and writes its own cache buffers in place, where the scan over stacked layers
    slices a copy of every layer's keys and values per step. Equal to decode_step up to float rounding (the
    q.k product reads the keys transposed), which left the sampled tokens of tests/test_generate.py unchanged."""
    pos_B = cache.length
    x_B1D, positions_B1, slots, k_positions = _decode_inputs(params, tokens_B, pos_B, cache.pos, cfg)
    P = len(cfg.pattern)
    new = []
    with jax.named_scope("decode"):
        for i, (p, layer) in enumerate(zip(layer_params, cache.layers)):
            j = i % P

            def attn(h_B1D, p_attn, j=j, layer=layer):
                return attention.attention_decode_layer(h_B1D, p_attn, cfg, positions_B1, layer, slots[j],
                                                        k_positions[j], cfg.pattern[j] == "local")

            x_B1D, _, layer = _block(x_B1D, p, cfg, attn)
            new.append(layer)
        logits_BV = unembed(params, x_B1D, cfg)[:, 0]
    return logits_BV, kvcache.LayerCaches(tuple(new), tuple(k_positions), pos_B + 1)


def decoder(params: dict, cache: kvcache.KVCache, cfg: ModelConfig, unroll: bool, rows_b: jax.Array | None = None,
            slots: int | None = None):
    """A decode loop's step and the cache in the layout it takes: `step(tokens_B, cache) -> (logits_BV, cache)`,
    of the sequences rows_b of `cache` and cut to `slots` slots (kvcache.kept_slots) when given. With `unroll`
    the weights and the cache are taken apart by layer here, once (decode_layers; kvcache.restack puts the
    cache back), else the step scans the stacked layers (decode_step; kvcache.put_rows puts it back)."""
    if not unroll:
        return (lambda tokens_B, c: decode_step(params, tokens_B, c, cfg)), (
            cache if rows_b is None and slots is None else kvcache.take_rows(cache, cfg, rows_b, slots))
    layer_params = layer_weights(params, cfg)
    return ((lambda tokens_B, c: decode_layers(params, layer_params, tokens_B, c, cfg)),
            kvcache.unstack(cache, cfg, rows_b, slots))


def token_losses(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
    """Each token's next-token cross-entropy [B, T] in float32."""
    logits_BTV = logits_BTV.astype(jnp.float32)
    lse_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
    target_logit_BT = jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0]
    return lse_BT - target_logit_BT


def cross_entropy_sum(logits_BTV: jax.Array, targets_BT: jax.Array, weights_BT: jax.Array | None = None) -> jax.Array:
    """Sum over tokens of the next-token cross-entropy in float32, each token's term times its weight."""
    return _weighted_sum(token_losses(logits_BTV, targets_BT), weights_BT)


def _weighted_sum(losses_BT: jax.Array, weights_BT: jax.Array | None) -> jax.Array:
    return jnp.sum(losses_BT if weights_BT is None else losses_BT * weights_BT)


def chunked_cross_entropy_sum(params: dict, x_BTD: jax.Array, targets_BT: jax.Array, cfg: ModelConfig,
                              weights_BT: jax.Array | None = None) -> jax.Array:
    """`cross_entropy_sum(unembed(params, x_BTD, cfg), ...)` computed cfg.loss_chunk_tokens positions at a
    time (chunked_token_losses), summed as cross_entropy_sum sums them, so that chunking changes no more than
    the output projection's rounding, not the order of the sum."""
    losses_BT = chunked_token_losses(params, x_BTD, targets_BT, cfg)
    return _weighted_sum(losses_BT, None if weights_BT is None else weights_BT.astype(jnp.float32))


def by_chunks(fn, params: dict, x_BTD: jax.Array, targets_BT: jax.Array, cfg: ModelConfig):
    """`fn(unembed(params, x_BTD, cfg), targets_BT)` (a pytree of [B, T] arrays) computed cfg.loss_chunk_tokens
    positions at a time: a scan over chunks of the sequence whose body is rematerialized, so the forward keeps one
    chunk's logits [B, C, V] and the backward recomputes them chunk by chunk (n C chunks cover T, the last
    padded)."""
    B, T, D = x_BTD.shape
    C = min(cfg.loss_chunk_tokens, T)
    pad = -T % C
    padded = (jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2)) for a in (x_BTD, targets_BT))
    chunks = tuple(a.reshape(B, (T + pad) // C, C, *a.shape[2:]).swapaxes(0, 1) for a in padded)

    @jax.checkpoint
    def chunk(x_BCD, targets_BC):
        return fn(unembed(params, x_BCD, cfg), targets_BC)

    with jax.named_scope("chunked_loss"):
        _, out_nBC = jax.lax.scan(lambda carry, xs: (carry, chunk(*xs)), None, chunks)
    return jax.tree.map(lambda a_nBC: a_nBC.swapaxes(0, 1).reshape(B, T + pad)[:, :T], out_nBC)


def chunked_token_losses(params: dict, x_BTD: jax.Array, targets_BT: jax.Array, cfg: ModelConfig) -> jax.Array:
    """`token_losses(unembed(params, x_BTD, cfg), targets_BT)` [B, T], a chunk of the sequence at a time
    (by_chunks)."""
    return by_chunks(token_losses, params, x_BTD, targets_BT, cfg)


@quant.scoped
def token_logprobs(params: dict, tokens_BT: jax.Array, targets_BT: jax.Array, cfg: ModelConfig,
                   key: jax.Array | None = None, positions_BT: jax.Array | None = None,
                   segment_ids_BT: jax.Array | None = None, temperature: float = 1.0
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each target's log-probability [B, T] under softmax(logits / temperature), each position's entropy of that
    distribution [B, T], and the auxiliary (load-balancing) loss: what objectives that score whole replies
    (preference tuning, reinforcement learning) take from the model. Sequences longer than cfg.loss_chunk_tokens
    are computed a chunk at a time (by_chunks), so the [B, T, V] logits never exist at once."""
    x_BTD, aux = hidden_with_aux(params, tokens_BT, cfg, key, positions_BT, segment_ids_BT)

    def scored(logits_BCV, targets_BC):
        logits_BCV = logits_BCV.astype(jnp.float32) / temperature
        lse_BC = jax.nn.logsumexp(logits_BCV, axis=-1)
        target_BC = jnp.take_along_axis(logits_BCV, targets_BC[..., None], axis=-1)[..., 0]
        probs_BCV = jnp.exp(logits_BCV - lse_BC[..., None])
        return target_BC - lse_BC, lse_BC - jnp.sum(probs_BCV * logits_BCV, axis=-1)

    if 0 < cfg.loss_chunk_tokens < targets_BT.shape[1]:
        return (*by_chunks(scored, params, x_BTD, targets_BT, cfg), aux)
    return (*scored(unembed(params, x_BTD, cfg), targets_BT), aux)


def describe_loss(cfg: ModelConfig) -> str:
    """For the logs: how the training loss runs at cfg.block_size tokens ('' when all at once)."""
    C = cfg.loss_chunk_tokens
    return f" | loss in chunks of {C} tokens" if 0 < C < cfg.block_size else ""


def cross_entropy(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy in float32."""
    return cross_entropy_sum(logits_BTV, targets_BT) / targets_BT.size


@quant.scoped
def loss_fn(params: dict, tokens_BT: jax.Array, targets_BT: jax.Array, cfg: ModelConfig,
            key: jax.Array | None = None, positions_BT: jax.Array | None = None,
            segment_ids_BT: jax.Array | None = None, weights_BT: jax.Array | None = None,
            normalizer: jax.Array | None = None) -> jax.Array:
    """Cross-entropy, plus the weighted load-balancing loss for mixture-of-experts models; for sequences longer than
    cfg.loss_chunk_tokens tokens the logits are computed a chunk of the sequence at a time (never all at once).

    Each token's loss counts with its weight (weights_BT: 1 trained, 0 masked such as prompts or padding; None =
    all 1) and the weighted sum is divided by `normalizer` (default: the sum of the weights here). A step that
    accumulates micro-batches passes the weight of the whole step over the number of micro-batches, so that
    the mean over micro-batches is exactly the mean over every counted token of the step."""
    x_BTD, aux = hidden_with_aux(params, tokens_BT, cfg, key, positions_BT, segment_ids_BT)
    if normalizer is None:
        normalizer = targets_BT.size if weights_BT is None else jnp.maximum(jnp.sum(weights_BT), 1e-9)
    if 0 < cfg.loss_chunk_tokens < targets_BT.shape[1]:
        total = chunked_cross_entropy_sum(params, x_BTD, targets_BT, cfg, weights_BT)
    else:
        total = cross_entropy_sum(unembed(params, x_BTD, cfg), targets_BT, weights_BT)
    loss = total / normalizer
    return loss + cfg.router_aux_loss_coef * aux if cfg.n_experts else loss
