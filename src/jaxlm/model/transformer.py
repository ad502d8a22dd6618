"""The one forward pass shared by every family: embed, a scanned stack of pre-norm blocks, norm, logits.

Families differ only through named ModelConfig options (norm kind, biases, post-norms, soft-caps, local or
global attention per layer, dense or mixture-of-experts MLP); there is no per-family code path. `prefill`,
`decode_step` and `prefill_chunks` are the same blocks run over a KV cache (model/kvcache.py) for generation.

Shape legend: B batch, T length, D model width, V vocab, L layers, N heads, K kv heads, H head width,
F MLP hidden width, E experts, P layers per repeat of cfg.layer_pattern, S cache slots.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxlm.model import quant
from jaxlm.config import ConfigError, ModelConfig
from jaxlm.model import attention, kvcache, latent, layers, moe, paged, pipeline, stack
from jaxlm.params import ParamSpec, normal
from jaxlm.sharding import constrain
from jaxlm.sharding import pipeline as pipeline_settings


def block_specs(cfg: ModelConfig, L: int, mlp: dict) -> dict:
    """The weights of L stacked blocks with the MLP weights `mlp`: norms, attention (ordinary or latent)."""
    attn = latent.specs(cfg, L) if cfg.latent else attention.specs(cfg, L)
    p = {"attn_norm": layers.norm_specs(cfg, (L, cfg.d_model), ("layers", "embed")), "attn": attn,
         "mlp_norm": layers.norm_specs(cfg, (L, cfg.d_model), ("layers", "embed")), "mlp": mlp}
    if cfg.post_norms:
        p["attn_post_norm"] = layers.norm_specs(cfg, (L, cfg.d_model), ("layers", "embed"))
        p["mlp_post_norm"] = layers.norm_specs(cfg, (L, cfg.d_model), ("layers", "embed"))
    return p


def param_specs(cfg: ModelConfig) -> dict:
    """Every weight of the model, declared once. Layer weights are stacked along a leading `layers` axis (over
    the layers that have them: model/stack.py)."""
    assert cfg.vocab_size is not None, "vocab_size must be resolved before building the model"
    D, V, dt = cfg.d_model, cfg.vocab_size, cfg.param_dtype
    w = normal(cfg.init_std)
    lay = stack.layout(cfg)
    n_moe = sum(k.moe for k in lay.kinds)
    mlp = moe.specs(cfg, n_moe) if n_moe else layers.mlp_specs(cfg, cfg.n_layers, cfg.ff)
    specs = {
        "embed": {"tokens": ParamSpec((V, D), ("vocab", "embed"), w, dt)},
        "layers": block_specs(cfg, cfg.n_layers, mlp),
        "final_norm": layers.norm_specs(cfg, (D,), ("embed",)),
    }
    if lay.mixed:
        specs["layers"]["dense_mlp"] = layers.mlp_specs(cfg, cfg.n_layers - n_moe, cfg.ff)
    if cfg.position == "learned":
        specs["embed"]["positions"] = ParamSpec((cfg.block_size, D), (None, "embed"), w, dt)
    if not cfg.tie_embeddings:
        specs["lm_head"] = ParamSpec((D, V), ("embed", "vocab"), w, dt)
    if cfg.mtp_layers:
        M = cfg.mtp_layers
        block_mlp = moe.specs(cfg, M) if cfg.n_experts else layers.mlp_specs(cfg, M, cfg.ff)
        specs["mtp"] = {"embed_norm": layers.norm_specs(cfg, (M, D), ("layers", "embed")),
                        "hidden_norm": layers.norm_specs(cfg, (M, D), ("layers", "embed")),
                        "proj": ParamSpec((M, 2 * D, D), ("layers", None, "embed"), w, dt),
                        "block": block_specs(cfg, M, block_mlp),
                        "norm": layers.norm_specs(cfg, (M, D), ("layers", "embed"))}
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
          kind: str = "global", segment_ids_BT: jax.Array | None = None):
    """One pre-norm block of attention kind `kind`; returns the new residual stream and the MoE routing
    statistics [3, E] (zeros for a dense MLP in a model with experts; [3, 0] in a model without)."""
    keys = jax.random.split(key, 3) if key is not None else (None, None, None)
    # Every use below reads the named copy, so a policy that offloads it leaves no device copy for the backward.
    x_BTD = checkpoint_name(x_BTD, "decoder_layer_input")
    attn_mod = latent if cfg.latent else attention
    attn = lambda h, q: (attn_mod.attention_with_kv(h, q, cfg, positions_BT, keys[0], kind,  # noqa: E731
                                                    segment_ids_BT)[0], None)
    x_BTD, stats_3E, _ = _block(x_BTD, p, cfg, attn, keys[1:])
    return x_BTD, stats_3E


def _mlp(h_BTD, p, cfg: ModelConfig):
    """A layer's MLP, mixture of experts when its weights have a router: output and routing statistics."""
    act = layers.activation_of(cfg)
    if "router" in p:
        return moe.moe(h_BTD, p, act, moe.router_of(cfg), cfg.expert_capacity_factor, cfg.expert_all_to_all)
    return layers.mlp(h_BTD, p, act), jnp.zeros((3, cfg.n_experts), jnp.float32)


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
        h_BTD, stats_3E = _mlp(norm(x_BTD, p["mlp_norm"]), p["mlp"], cfg)
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
    with jax.named_scope("logits"):
        x_BTD = layers.norm(x_BTD, params["final_norm"], cfg.norm, cfg.norm_eps, cfg.norm_plus_one)
        return _head(params, x_BTD, cfg)


def _head(params, h_BTD, cfg: ModelConfig):
    """The output projection of normalized hidden states (tied to the embedding or not), soft-capped."""
    cdt = jnp.dtype(cfg.compute_dtype)
    w = params["embed"]["tokens"] if cfg.tie_embeddings else params["lm_head"]
    spec = "BTD,VD->BTV" if cfg.tie_embeddings else "BTD,DV->BTV"
    if quant.applies(w, logits=True):
        logits_BTV = quant.dot(spec, h_BTD, w)
    else:
        # The gradient is pinned in the weights' dtype: the [D, V] sum over the batch is reduced in float32.
        w = layers.pin_grad(w, ("vocab", "embed") if cfg.tie_embeddings else ("embed", "vocab"))
        logits_BTV = jnp.einsum(spec, h_BTD, w.astype(cdt), preferred_element_type=jnp.float32)
    return layers.softcap(logits_BTV, cfg.final_logit_softcap)


# The dense matmul weights of a layer, by block: what _matmul_weights casts and pins (the experts' own
# up/gate/down are left to moe.py).
MATMUL_WEIGHTS = {"attn": ("q", "k", "v", "o", "q_a", "q_b", "kv_a", "k_rope", "k_b", "v_b"),
                  "mlp": ("up", "gate", "down", "shared_up", "shared_gate", "shared_down")}
EXPERT_WEIGHTS = ("up", "gate", "down")


def _matmul_weights(p: dict, cfg: ModelConfig, specs: dict | None = None) -> dict:
    """One layer's weights with its dense matmul weights cast to the compute dtype and their gradients
    pinned to their shardings (layers.matmul_weight). Inside the remat'd layer body, so the cast copies are
    recomputed in the backward pass, never saved. `specs`: the layer's stacked specs (default the main
    layers')."""
    specs = param_specs(cfg)["layers"] if specs is None else specs
    cdt = jnp.dtype(cfg.compute_dtype)
    p = {**p}
    for blk, names in MATMUL_WEIGHTS.items():
        experts = blk == "mlp" and "router" in p[blk]
        blk_specs = specs[blk] if experts or "dense_mlp" not in specs or blk != "mlp" else specs["dense_mlp"]
        p[blk] = {**p[blk], **{name: layers.matmul_weight(p[blk][name], blk_specs[name].axes[1:], cdt)
                               for name in names if name in p[blk] and not (experts and name in EXPERT_WEIGHTS)}}
    return p


def layer_stack(x_BTD: jax.Array, layer_params: dict, cfg: ModelConfig, positions_BT: jax.Array,
                segment_ids_BT: jax.Array | None, layer_keys: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """Run the n layers stacked in layer_params (all of them, or a pipeline stage's n, a multiple of
    len(cfg.pattern)): the new residual stream and the layers' routing statistics [n, 3, E] in layer order."""
    n = jax.tree.leaves(layer_params["attn_norm"])[0].shape[0]
    P = len(cfg.pattern)
    bodies = {}

    def body(kind: stack.Kind, scanned: bool):
        if (kind, scanned) not in bodies:
            fn = lambda x, p, k: block(x, _matmul_weights(p, cfg), cfg, positions_BT, k,  # noqa: E731
                                       kind.attention, segment_ids_BT)
            if cfg.remat != "none":
                fn = jax.checkpoint(fn, policy=REMAT_POLICIES[cfg.remat], prevent_cse=not scanned)
            bodies[kind, scanned] = fn
        return bodies[kind, scanned]

    def step(x_BTD, p, kind, j, r, key):
        return body(kind, scanned=not isinstance(r, int))(x_BTD, p, key)

    keys = None if layer_keys is None else tuple(layer_keys[j::P] for j in range(P))
    x_BTD, stats = stack.run(cfg, layer_params, step, x_BTD, keys, scan=cfg.scan_layers, n_layers=n)
    return x_BTD, stack.in_layer_order(stats, n)


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
    x_BTD, stats_L3E = _hidden(params, tokens_BT, cfg, key, positions_BT, segment_ids_BT)
    return x_BTD, _aux(stats_L3E, cfg)


def _positions(tokens_BT, positions_BT):
    B, T = tokens_BT.shape
    return jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)) if positions_BT is None else positions_BT


def _hidden(params, tokens_BT, cfg: ModelConfig, key, positions_BT, segment_ids_BT):
    """The residual stream after the last block and the MoE layers' routing statistics [L_moe, 3, E]."""
    positions_BT = _positions(tokens_BT, positions_BT)
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
        if not stack.layout(cfg).simple:
            raise ConfigError("pipeline stages (mesh stage axis over 1) need every layer in whole model.layer_pattern "
                              "repeats of one MLP kind; this model's layers differ (dense and MoE layers, or a "
                              "last partial repeat): set mesh.ici_stage / mesh.dcn_stage to 1")
        axes = jax.tree.map(lambda spec: spec.axes, param_specs(cfg)["layers"],
                            is_leaf=lambda v: isinstance(v, ParamSpec))
        x_BTD, stats_L3E = pipeline.run(run, x_BTD, params["layers"], axes, positions_BT, segment_ids_BT,
                                        layer_keys, pipe, len(cfg.pattern))
    else:
        x_BTD, stats_L3E = run(x_BTD, params["layers"], positions_BT, segment_ids_BT, layer_keys)
    moe_layers = [i for i, kind in enumerate(stack.layout(cfg).kinds) if kind.moe]
    return x_BTD, stats_L3E[jnp.asarray(moe_layers, jnp.int32)] if moe_layers else stats_L3E[:0]


def _aux(stats_L3E, cfg: ModelConfig) -> jax.Array:
    return moe.load_balancing_loss(stats_L3E) if stats_L3E.shape[0] else jnp.zeros((), jnp.float32)


def forward(params: dict, tokens_BT: jax.Array, cfg: ModelConfig, key: jax.Array | None = None,
            positions_BT: jax.Array | None = None, segment_ids_BT: jax.Array | None = None) -> jax.Array:
    """Logits [B, T, V] in float32. `key` enables dropout (training); None is deterministic."""
    return forward_with_aux(params, tokens_BT, cfg, key, positions_BT, segment_ids_BT)[0]


def mtp_hidden(params: dict, x_BTD: jax.Array, tokens_BT: jax.Array, cfg: ModelConfig, positions_BT: jax.Array,
               segment_ids_BT: jax.Array | None = None):
    """DeepSeek-V3's multi-token prediction modules over the main model's last residual stream x_BTD: module m
    (from 0) at position t combines the previous depth's hidden state at t (the main model's after its final
    norm, for m = 0) with the embedding of token t + m + 1 (tokens_BT here are the *next* tokens, the
    targets), runs one block at positions t + m + 1 and normalizes; its logits predict token t + m + 2. Returns
    each module's normalized hidden states [M, B, T, D] and routing statistics [M, 3, E] (positions past the
    sequence see padding, which the loss masks)."""
    mtp = params["mtp"]
    norm = lambda x, q: layers.norm(x, q, cfg.norm, cfg.norm_eps, cfg.norm_plus_one)  # noqa: E731
    block_specs_ = param_specs(cfg)["mtp"]["block"]
    h_BTD = norm(x_BTD, params["final_norm"])
    hidden, stats = [], []
    for m in range(cfg.mtp_layers):
        p = jax.tree.map(lambda a: a[m], mtp)
        ahead_BT = jnp.pad(tokens_BT[:, m:], [(0, 0), (0, m)])
        pos_BT = positions_BT + m + 1
        e_BTD = embed(params, ahead_BT, cfg, pos_BT)
        with jax.named_scope("mtp"):
            cat_BT2D = jnp.concatenate([norm(e_BTD, p["embed_norm"]), norm(h_BTD, p["hidden_norm"])], axis=-1)
            h_BTD = layers.dot("BTE,ED->BTD", cat_BT2D, layers.matmul_weight(
                p["proj"], (None, "embed"), jnp.dtype(cfg.compute_dtype)))
            h_BTD, stats_3E = block(h_BTD, _matmul_weights(p["block"], cfg, block_specs_), cfg, pos_BT, None,
                                    "global", segment_ids_BT)
            h_BTD = norm(h_BTD, p["norm"])
        hidden.append(h_BTD)
        stats.append(stats_3E)
    return jnp.stack(hidden), jnp.stack(stats)


@quant.scoped
def mtp_logits(params: dict, tokens_BT: jax.Array, cfg: ModelConfig, positions_BT: jax.Array | None = None
               ) -> jax.Array:
    """The multi-token prediction modules' logits [M, B, T, V] for a batch of tokens: module m's at position t
    predict token t + m + 2, from tokens up to t + m + 1 (those past the end are padding)."""
    positions_BT = _positions(tokens_BT, positions_BT)
    x_BTD, _ = _hidden(params, tokens_BT, cfg, None, positions_BT, None)
    next_BT = jnp.pad(tokens_BT[:, 1:], [(0, 0), (0, 1)])
    hidden_MBTD, _ = mtp_hidden(params, x_BTD, next_BT, cfg, positions_BT)
    return jnp.stack([_head(params, h_BTD, cfg) for h_BTD in hidden_MBTD])


@quant.scoped
def attention_logit_max(params: dict, tokens_BT: jax.Array, cfg: ModelConfig, positions_BT: jax.Array | None = None,
                        segment_ids_BT: jax.Array | None = None) -> jax.Array:
    """The largest attention logit of every layer's query heads over the batch [L, N] (before soft-capping), from
    a forward pass without dropout or output layer: what MuonClip's QK-clip watches (clip_qk)."""
    positions_BT = _positions(tokens_BT, positions_BT)
    x_BTD = constrain(embed(params, tokens_BT, cfg, positions_BT), ("batch", "length", "embed"))
    attn_mod = latent if cfg.latent else attention

    def step(x_BTD, p, kind, j, r, _):
        def attn(h_BTD, p_attn):
            return attn_mod.attention_with_logit_max(h_BTD, p_attn, cfg, positions_BT, kind.attention, segment_ids_BT)

        x_BTD, _, top_N = _block(x_BTD, _matmul_weights(p, cfg), cfg, attn)
        return x_BTD, top_N

    with jax.named_scope("attention_logit_max"):
        _, tops = stack.run(cfg, params["layers"], step, x_BTD, scan=cfg.scan_layers)
    return stack.in_layer_order(tops, cfg.n_layers)


def clip_qk(params: dict, logit_max_LN: jax.Array, threshold: float, cfg: ModelConfig) -> dict:
    """`params` with the layers' query and key weights QK-clipped (attention.clip_qk, latent.clip_qk)."""
    attn_mod = latent if cfg.latent else attention
    layer_params = params["layers"]
    return {**params, "layers": {**layer_params, "attn": attn_mod.clip_qk(layer_params["attn"], logit_max_LN,
                                                                          threshold, cfg)}}


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
    attn_mod = latent if cfg.latent else attention

    def step(x_BTD, p, kind, j, r, _):
        def attn(h_BTD, p_attn):
            out_BTD, k_BTKH, v_BTKH = attn_mod.attention_with_kv(h_BTD, p_attn, cfg, positions_BT, None,
                                                                 kind.attention)
            return out_BTD, (k_BTKH, v_BTKH)

        x_BTD, _, kv = _block(x_BTD, p, cfg, attn)
        entry = {}
        for name, x_BTKH in zip(("k", "v"), kv):
            x_BSKH = jnp.take_along_axis(x_BTKH, layouts[j][0][:, :, None, None], axis=1)
            entry[name], entry[f"{name}_scale"] = kvcache.store(x_BSKH.transpose(0, 2, 1, 3), quantize)
        return x_BTD, entry

    with jax.named_scope("prefill"):
        x_BTD, entries = stack.run(cfg, params["layers"], step, x_BTD)
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
    attn_mod = latent if cfg.latent else attention

    def step(carry, p, kind, j, r, _):  # the stacked caches ride in the carry: each layer writes its entries in place
        x_B1D, stacks = carry

        def attn(h_B1D, p_attn):
            return attn_mod.attention_decode(h_B1D, p_attn, cfg, positions_B1, stacks[j], r, slots[j],
                                             k_positions[j], kind.attention)

        x_B1D, _, new_j = _block(x_B1D, p, cfg, attn)
        return (x_B1D, stacks[:j] + (new_j,) + stacks[j + 1:]), None

    stacks = tuple({"k": c.k, "v": c.v, "k_scale": c.k_scale, "v_scale": c.v_scale} for c in cache.kinds)
    with jax.named_scope("decode"):
        (x_B1D, new), _ = stack.run(cfg, params["layers"], step, (x_B1D, stacks))
        logits_BV = unembed(params, x_B1D, cfg)[:, 0]
    kinds = tuple(kvcache.KindCache(pos=k_pos, **c) for k_pos, c in zip(k_positions, new))
    return logits_BV, kvcache.KVCache(kinds, pos_B + 1)


@quant.scoped
def layer_weights(params: dict, cfg: ModelConfig) -> tuple[dict, ...]:
    """The layers' weights one by one, dense matmul weights in the compute dtype: taken apart once before a
    decode loop (decode_layers), so that its steps neither slice nor cast the stacked weights."""
    lay = stack.layout(cfg)
    return tuple(_matmul_weights(stack.layer_view(params["layers"], lay, i), cfg) for i in range(cfg.n_layers))


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
    attn_mod = latent if cfg.latent else attention
    new = []
    with jax.named_scope("decode"):
        for i, (p, layer) in enumerate(zip(layer_params, cache.layers)):
            j = i % P

            def attn(h_B1D, p_attn, j=j, layer=layer):
                return attn_mod.attention_decode_layer(h_B1D, p_attn, cfg, positions_B1, layer, slots[j],
                                                       k_positions[j], cfg.pattern[j])

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
                              weights_BT: jax.Array | None = None, logits_of=None) -> jax.Array:
    """`cross_entropy_sum(unembed(params, x_BTD, cfg), ...)` computed cfg.loss_chunk_tokens positions at a
    time (chunked_token_losses), summed as cross_entropy_sum sums them, so that chunking changes no more than
    the output projection's rounding, not the order of the sum. `logits_of(x_BCD)` replaces unembed (the MTP
    modules' normalized states take the output projection alone)."""
    losses_BT = by_chunks(token_losses, params, x_BTD, targets_BT, cfg, logits_of)
    return _weighted_sum(losses_BT, None if weights_BT is None else weights_BT.astype(jnp.float32))


def by_chunks(fn, params: dict, x_BTD: jax.Array, targets_BT: jax.Array, cfg: ModelConfig, logits_of=None):
    """`fn(unembed(params, x_BTD, cfg), targets_BT)` (a pytree of [B, T] arrays) computed cfg.loss_chunk_tokens
    positions at a time: a scan over chunks of the sequence whose body is rematerialized, so the forward keeps one
    chunk's logits [B, C, V] and the backward recomputes them chunk by chunk (n C chunks cover T, the last
    padded). `logits_of(x_BCD)` replaces unembed."""
    B, T, D = x_BTD.shape
    C = min(cfg.loss_chunk_tokens, T)
    pad = -T % C
    padded = (jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2)) for a in (x_BTD, targets_BT))
    chunks = tuple(a.reshape(B, (T + pad) // C, C, *a.shape[2:]).swapaxes(0, 1) for a in padded)
    logits_of = logits_of or (lambda x_BCD: unembed(params, x_BCD, cfg))

    @jax.checkpoint
    def chunk(x_BCD, targets_BC):
        return fn(logits_of(x_BCD), targets_BC)

    with jax.named_scope("chunked_loss"):
        _, out_nBC = jax.lax.scan(lambda carry, xs: (carry, chunk(*xs)), None, chunks)
    return jax.tree.map(lambda a_nBC: a_nBC.swapaxes(0, 1).reshape(B, T + pad)[:, :T], out_nBC)


def chunked_token_losses(params: dict, x_BTD: jax.Array, targets_BT: jax.Array, cfg: ModelConfig) -> jax.Array:
    """`token_losses(unembed(params, x_BTD, cfg), targets_BT)` [B, T], a chunk of the sequence at a time
    (by_chunks)."""
    return by_chunks(token_losses, params, x_BTD, targets_BT, cfg)


def _token_loss_sum(params, x_BTD, targets_BT, cfg: ModelConfig, weights_BT, logits_of=None):
    if 0 < cfg.loss_chunk_tokens < targets_BT.shape[1]:
        return chunked_cross_entropy_sum(params, x_BTD, targets_BT, cfg, weights_BT, logits_of)
    logits_BTV = unembed(params, x_BTD, cfg) if logits_of is None else logits_of(x_BTD)
    return cross_entropy_sum(logits_BTV, targets_BT, weights_BT)


def mtp_loss_sum(params: dict, x_BTD: jax.Array, targets_BT: jax.Array, cfg: ModelConfig, positions_BT: jax.Array,
                 segment_ids_BT: jax.Array | None, weights_BT: jax.Array | None):
    """The multi-token prediction modules' cross-entropy sums, averaged over the modules (DeepSeek-V3's
    L_MTP times the token count: the caller divides by the main loss's normalizer, as DeepSeek divides by T),
    and their routing statistics. Module m's target at t is targets[t + m + 1], counted where it exists, is
    weighted (weights_BT shifted alike) and lies in the same packed document."""
    hidden_MBTD, stats_M3E = mtp_hidden(params, x_BTD, targets_BT, cfg, positions_BT, segment_ids_BT)
    B, T = targets_BT.shape
    total = jnp.zeros((), jnp.float32)
    for m, h_BTD in enumerate(hidden_MBTD):
        shift = lambda a, fill=0: jnp.pad(a[:, m + 1:], [(0, 0), (0, m + 1)], constant_values=fill)  # noqa: E731
        valid_BT = (jnp.arange(T) < T - m - 1)[None].astype(jnp.float32)
        if weights_BT is not None:
            valid_BT = valid_BT * shift(weights_BT.astype(jnp.float32))
        if segment_ids_BT is not None:
            valid_BT = valid_BT * (shift(segment_ids_BT, -1) == segment_ids_BT)
        total = total + _token_loss_sum(params, h_BTD, shift(targets_BT), cfg, jnp.broadcast_to(valid_BT, (B, T)),
                                        lambda x: _head(params, x, cfg))
    return total / cfg.mtp_layers, stats_M3E


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
    """Cross-entropy, plus the weighted load-balancing loss for mixture-of-experts models and the weighted
    multi-token prediction loss (model.mtp_layers); for sequences longer than cfg.loss_chunk_tokens tokens the
    logits are computed a chunk of the sequence at a time (never all at once).

    Each token's loss counts with its weight (weights_BT: 1 trained, 0 masked such as prompts or padding; None =
    all 1) and the weighted sum is divided by `normalizer` (default: the sum of the weights here). A step that
    accumulates micro-batches passes the weight of the whole step over the number of micro-batches, so that
    the mean over micro-batches is exactly the mean over every counted token of the step."""
    return loss_terms(params, tokens_BT, targets_BT, cfg, key, positions_BT, segment_ids_BT, weights_BT,
                      normalizer)[0]


@quant.scoped
def loss_terms(params: dict, tokens_BT: jax.Array, targets_BT: jax.Array, cfg: ModelConfig,
               key: jax.Array | None = None, positions_BT: jax.Array | None = None,
               segment_ids_BT: jax.Array | None = None, weights_BT: jax.Array | None = None,
               normalizer: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`loss_fn`'s loss and its terms, for the logs: cross_entropy; with experts load_balancing (before
    router_aux_loss_coef); with MTP modules mtp (their mean cross-entropy, before mtp_loss_weight)."""
    positions_BT = _positions(tokens_BT, positions_BT)
    x_BTD, stats_L3E = _hidden(params, tokens_BT, cfg, key, positions_BT, segment_ids_BT)
    if normalizer is None:
        normalizer = targets_BT.size if weights_BT is None else jnp.maximum(jnp.sum(weights_BT), 1e-9)
    loss = _token_loss_sum(params, x_BTD, targets_BT, cfg, weights_BT) / normalizer
    terms = {"cross_entropy": loss}
    if cfg.mtp_layers:
        mtp_total, mtp_stats = mtp_loss_sum(params, x_BTD, targets_BT, cfg, positions_BT, segment_ids_BT, weights_BT)
        terms["mtp"] = mtp_total / normalizer
        loss = loss + cfg.mtp_loss_weight * terms["mtp"]
        if cfg.n_experts:
            stats_L3E = jnp.concatenate([stats_L3E, mtp_stats])
    if cfg.n_experts:
        terms["load_balancing"] = _aux(stats_L3E, cfg)
        loss = loss + cfg.router_aux_loss_coef * terms["load_balancing"]
    return loss, terms


@quant.scoped
def prefill_chunks(params: dict, cache: kvcache.KVCache, tokens_PC: jax.Array, start_P: jax.Array,
                   length_P: jax.Array, slot_P: jax.Array, cfg: ModelConfig, fresh: bool = False
                   ) -> tuple[kvcache.KVCache, jax.Array]:
    """Run, for each row p (P rows here, of chunks of C tokens), prompt tokens [start_P[p], start_P[p] + C)
    (tokens_PC[p]; those at or past length_P[p] are padding) in slot slot_P[p], whose cache holds the prompt's
    positions before start_P[p].
    Returns the cache with each row's keys and values and length min(start + C, length) in its slot, and each
    row's logits after its chunk's last real token [P, V] (the next token's, once the chunk reaches the prompt's
    end). A slot may appear in one row only, or be B, past the last (a padding row: reads slot B - 1, writes
    nothing). A row's layout and mask depend only on its own start, length and cached positions, so each row
    gets what it would get alone. The server's slot cache prefills prompts this way, a chunk at a time between
    decode steps, and after a prefix copied into the slot (serve/engine.py).
    `fresh` (every start_P 0, and fresh_fits): the slots' earlier contents are neither read nor kept, only
    written: the chunk's keys and values go to slots 0..C-1 and every later slot is emptied (EMPTY)."""
    C = tokens_PC.shape[1]
    positions_PC = start_P[:, None] + jnp.arange(C, dtype=jnp.int32)
    end_P = jnp.minimum(start_P + C, length_P)
    # Padding takes the last real position, valid for learned position tables; its keys are masked (EMPTY).
    q_pos_PC = jnp.minimum(positions_PC, length_P[:, None] - 1)
    chunk_k_pos_PC = jnp.where(positions_PC < length_P[:, None], positions_PC, kvcache.EMPTY)
    x_PCD = constrain(embed(params, tokens_PC, cfg, q_pos_PC), ("batch", "length", "embed"))
    # per kind: key positions [P, X], which slots take a chunk entry [P, S], from where [P, S], new positions
    if fresh:  # keys: the chunk's own; slots 0..C-1 take its positions, the rest are emptied
        P = tokens_PC.shape[0]
        layouts = [(chunk_k_pos_PC, None, None, jnp.concatenate(
            [chunk_k_pos_PC, jnp.full((P, c.pos.shape[1] - C), kvcache.EMPTY, jnp.int32)], axis=1))
            for c in cache.kinds]
    else:
        layouts = [jax.vmap(kvcache.chunk_layout)(jnp.take(c.pos, slot_P, axis=0, mode="clip"), start_P, end_P,
                                                  chunk_k_pos_PC) for c in cache.kinds]
    attn_mod = latent if cfg.latent else attention

    def step(x_PCD, p, kind, j, r, rows_j):
        k_pos_PX, take_PS, src_PS, _ = layouts[j]

        def attn(h_PCD, p_attn):
            return attn_mod.attention_chunk(h_PCD, p_attn, cfg, q_pos_PC, k_pos_PX, None if fresh else rows_j,
                                            take_PS, src_PS, kind.attention, cache.kinds[j].k_scale is not None)

        x_PCD, _, new = _block(x_PCD, p, cfg, attn)
        return x_PCD, new

    # Slots slot_P of each kind's cache (slot B, a padding row's, reads slot B - 1).
    names = ("k", "v", "k_scale", "v_scale")
    rows = None if fresh else tuple({name: None if getattr(c, name) is None else jnp.take(
        getattr(c, name), slot_P, axis=1, mode="clip") for name in names} for c in cache.kinds)
    with jax.named_scope("prefill_chunks"):
        x_PCD, new_rows = stack.run(cfg, params["layers"], step, x_PCD, rows)
        last_P1D = jnp.take_along_axis(x_PCD, (end_P - 1 - start_P)[:, None, None], axis=1)
        logits_PV = unembed(params, last_P1D, cfg)[:, 0]

    def put(a, x_P, axis, first=None):  # slot B (padding) is dropped; `first`: into slots 0..first-1 only
        index = (slice(None),) * axis + (slot_P,) + (() if first is None else (slice(None), slice(0, first)))
        return a.at[index].set(x_P.astype(a.dtype), mode="drop")

    kinds = []
    for c, new, layout in zip(cache.kinds, new_rows, layouts):
        arrays = {name: None if getattr(c, name) is None else constrain(
            put(getattr(c, name), new[name], 1, C if fresh else None),
            (None,) + kvcache.CACHE_AXES[:getattr(c, name).ndim - 1]) for name in names}
        kinds.append(kvcache.KindCache(pos=put(c.pos, layout[3], 0), **arrays))
    return kvcache.KVCache(tuple(kinds), put(cache.length, end_P, 0)), logits_PV


@quant.scoped
def paged_forward(params: dict, cache: paged.PagedCache, tokens_PC: jax.Array, start_P: jax.Array,
                  length_P: jax.Array, table_PM: jax.Array, cfg: ModelConfig,
                  layer_params: tuple[dict, ...] | None = None, all_logits: bool = False, hidden: bool = False
                  ) -> tuple[jax.Array, paged.PagedCache] | tuple[jax.Array, jax.Array, paged.PagedCache]:
    """Run tokens [P, C] of P sequences over the paged cache (model/paged.py), each row from position start_P[p]
    through its page table table_PM[p]: the tokens below length_P[p] are real (the rest padding: neither
    written nor attended to), their cache entries are written into the row's pages, and each attends to the
    row's keys before it. One function for every cached step of the server: a prompt's chunk (C up to the
    chunk length, after the pages of its earlier chunks or of a shared prefix), a decode step (C = 1; a row
    with length_P 0 does nothing) and a speculative verification (C = draft tokens + 1). Returns float32 logits,
    of every token [P, C, V] with `all_logits`, else of each row's last real token [P, V], and the cache.

    `layer_params` (layer_weights: the layers' weights one by one, taken apart once before a decode loop) runs
    the layers unrolled, each reading and writing its own slice of the stacked pool; else the layers go through
    stack.run (scanned groups). The table's pages must cover every real token's position (the caller allocates
    them). `hidden` also returns every token's last hidden state after the final norm [P, C, D] (what the
    multi-token prediction modules take: paged_mtp), as (logits, hidden, cache)."""
    end_P, q_pos_PC, page_PC, off_PC, flat = _paged_layout(cache, tokens_PC, start_P, length_P, table_PM)
    x_PCD = constrain(embed(params, tokens_PC, cfg, q_pos_PC), ("batch", "length", "embed"))

    def layer(carry, p, kind, j, r, _):
        x_PCD, kinds = carry

        def attn(h_PCD, p_attn):
            return paged.attention(h_PCD, p_attn, cfg, kinds[j], r, q_pos_PC, page_PC, off_PC, table_PM, end_P,
                                   kind.attention, flat, cache.kernel)

        x_PCD, _, arrays = _block(x_PCD, p, cfg, attn)
        return (x_PCD, kinds[:j] + (arrays,) + kinds[j + 1:]), None

    kinds = tuple(cache.kinds)
    P_ = len(cfg.pattern)
    with jax.named_scope("paged"):
        if layer_params is not None:
            lay = stack.layout(cfg)
            for i, p in enumerate(layer_params):
                (x_PCD, kinds), _ = layer((x_PCD, kinds), p, lay.kinds[i], i % P_, i // P_, None)
        else:
            (x_PCD, kinds), _ = stack.run(cfg, params["layers"], lambda carry, p, *rest: layer(
                carry, _matmul_weights(p, cfg), *rest), (x_PCD, kinds))
        if not (all_logits or hidden):  # a prompt chunk's call: only its last real token is normalized
            x_PCD = _last_real(x_PCD, start_P, end_P)
        h_PCD = layers.norm(x_PCD, params["final_norm"], cfg.norm, cfg.norm_eps, cfg.norm_plus_one)
        logits = _head(params, h_PCD if all_logits or not hidden else _last_real(h_PCD, start_P, end_P), cfg)
    logits = logits if all_logits else logits[:, 0]
    cache = paged.PagedCache(kinds, cache.kernel)
    return (logits, h_PCD, cache) if hidden else (logits, cache)


def _paged_layout(cache: paged.PagedCache, tokens_PC, start_P, length_P, table_PM):
    """Where tokens [P, C] from start_P (real below length_P) go in a paged pool: each row's end of real tokens
    [P], the positions its queries take [P, C], the page and offset of each token's entry [P, C] (real tokens'
    pages from the row's table; padding's past the pool, so that the write is dropped), and whether the rows
    read their pages flat (paged.attention)."""
    C = tokens_PC.shape[1]
    A = cache.page_size
    positions_PC = start_P[:, None] + jnp.arange(C, dtype=jnp.int32)
    end_P = jnp.clip(length_P, start_P, start_P + C)
    real_PC = positions_PC < end_P[:, None]
    # Padding takes the last real position (valid for learned position tables) and is masked as a key.
    q_pos_PC = jnp.maximum(jnp.minimum(positions_PC, end_P[:, None] - 1), 0)
    slot_PC = jnp.take_along_axis(table_PM, jnp.clip(positions_PC // A, 0, table_PM.shape[1] - 1), axis=1)
    page_PC = jnp.where(real_PC, slot_PC, cache.pages)
    return end_P, q_pos_PC, page_PC, positions_PC % A, C <= paged.FLAT_MAX_QUERIES


def _last_real(x_PCD, start_P, end_P):
    """Each row's entry at its last real token [P, 1, D] (the first, for a row with none)."""
    return jnp.take_along_axis(x_PCD, jnp.maximum(end_P - 1 - start_P, 0)[:, None, None], axis=1)


def mtp_pool(cfg: ModelConfig, pages: int, page_size: int, fmt: paged.PoolFormat = paged.PoolFormat()
             ) -> paged.PagedCache:
    """A paged pool (of format fmt) for the multi-token prediction modules' attention (paged_mtp): one global layer
    per module."""
    return paged.init(dataclasses.replace(cfg, n_layers=cfg.mtp_layers, layer_pattern="global"), pages, page_size,
                      fmt=fmt)


@quant.scoped
def mtp_weights(params: dict, cfg: ModelConfig, m: int = 0) -> dict:
    """Multi-token prediction module m's weights, its block's dense matmul weights in the compute dtype: taken
    apart once before a decode loop, as layer_weights takes the layers'."""
    p = jax.tree.map(lambda a: a[m], params["mtp"])
    cdt = jnp.dtype(cfg.compute_dtype)
    return {**p, "proj": layers.matmul_weight(p["proj"], (None, "embed"), cdt),
            "block": _matmul_weights(p["block"], cfg, param_specs(cfg)["mtp"]["block"])}


@quant.scoped
def paged_mtp(params: dict, module_params: dict, cache: paged.PagedCache, tokens_PC: jax.Array,
              prev_PCD: jax.Array, start_P: jax.Array, length_P: jax.Array, table_PM: jax.Array, cfg: ModelConfig,
              m: int = 0) -> tuple[jax.Array, jax.Array, paged.PagedCache]:
    """Multi-token prediction module m (module_params: mtp_weights(params, cfg, m)) over its own paged pool
    (mtp_pool), as mtp_hidden runs it in training, at positions t from start_P[p] (real below length_P[p], as in
    paged_forward): the previous depth's normalized hidden state at t (prev_PCD: the main model's, from
    paged_forward's `hidden`) with the embedding of the token after it (tokens_PC: the next tokens, as
    mtp_hidden takes them) through one block whose keys and values go to pool layer m at index t through the
    row's page table. Training runs the block at t + m + 1 over a sequence that starts there; indices and rotary
    positions from t give the same attention (rotary attention depends on the difference of positions, and
    the sequence's start needs no masked entry before it). Returns the logits after each row's last real
    position [P, V] (they predict the token at t + m + 2: the draft of speculative decoding), the module's
    normalized hidden state there [P, D] (the previous depth of the next draft), and the pool."""
    end_P, q_pos_PC, page_PC, off_PC, flat = _paged_layout(cache, tokens_PC, start_P, length_P, table_PM)
    p = module_params
    norm = lambda x, q: layers.norm(x, q, cfg.norm, cfg.norm_eps, cfg.norm_plus_one)  # noqa: E731
    cdt = jnp.dtype(cfg.compute_dtype)
    with jax.named_scope("mtp"):
        e_PCD = embed(params, tokens_PC, cfg, q_pos_PC)
        cat_PC2D = jnp.concatenate([norm(e_PCD, p["embed_norm"]), norm(prev_PCD.astype(cdt), p["hidden_norm"])],
                                   axis=-1)
        x_PCD = layers.dot("BTE,ED->BTD", cat_PC2D, p["proj"])
        arrays = cache.kinds[0]

        def attn(h_PCD, p_attn):
            return paged.attention(h_PCD, p_attn, cfg, arrays, m, q_pos_PC, page_PC, off_PC, table_PM, end_P,
                                   "global", flat, cache.kernel)

        x_PCD, _, arrays = _block(x_PCD, p["block"], cfg, attn)
        h_P1D = norm(_last_real(x_PCD, start_P, end_P), p["norm"])
        logits_PV = _head(params, h_P1D, cfg)[:, 0]
    return logits_PV, h_P1D[:, 0], paged.PagedCache((arrays,), cache.kernel)
