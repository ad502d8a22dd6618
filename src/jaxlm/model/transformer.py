"""The one forward pass shared by every family: the weights' declaration, embed, a scanned stack of pre-norm
blocks, norm, logits; the remat policies; the attention logits that MuonClip watches.

Families differ only through named ModelConfig options (norm kind, biases, post-norms, soft-caps, local or
global attention per layer, dense or mixture-of-experts MLP); there is no per-family code path. The loss
(model/loss.py), the cached steps of generation (model/decode.py) and multi-token prediction (model/mtp.py)
run the same blocks.

Shape legend: B batch, T length, D model width, V vocab, L layers, N heads, K kv heads, H head width,
F MLP hidden width, E experts, P layers per repeat of cfg.layer_pattern.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxlm.config import ConfigError, ModelConfig
from jaxlm.model import (attention, latent, layers, moe, pipeline, quant, stack, vision, vision_llama4, vision_qwen,
                         vision_qwen3)
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
    if cfg.vision is not None:
        specs["vision"] = tower(cfg).specs(cfg)
    return specs


def tower(cfg: ModelConfig):
    """The module of the model's vision tower (model.vision.kind): its specs, as_input, images_in and describe."""
    return {"llama4": vision_llama4, "qwen2_5": vision_qwen, "qwen3": vision_qwen3}.get(cfg.vision.kind, vision)


def images_as_input(images, cfg: ModelConfig, token_rows=None):
    """A caller's images as the forward pass takes them (the tower's as_input: float32 arrays; Qwen-VL's patch grids
    checked against the image tokens of `token_rows`); None for none. A model without a tower gets them as one
    array, which with_images refuses in one line."""
    if images is None:
        return None
    return vision.as_input(images, cfg) if cfg.vision is None else tower(cfg).as_input(images, cfg, token_rows)


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


def _no_int32_dots(policy):
    """`policy` except for matmuls with int32 results (int8 training's accumulators), which it never keeps."""
    def keep(prim, *args, **params):
        if prim is jax.lax.dot_general_p and params.get("preferred_element_type") == jnp.int32:
            return False
        return policy(prim, *args, **params)
    return keep


def remat_policy(cfg: ModelConfig):
    """The layers' checkpoint policy for model.remat (None for none). int8 training also keeps each layer's int8
    weights (quant.QUANT_WEIGHT, 1 byte a block weight), so that the recomputed forward does not quantize them
    again, and the policies that keep matmul outputs (minimal, save_dots) keep each int8 matmul's result at the
    compute dtype (quant.QUANT_OUT, 2 bytes an element) in place of its int32 accumulator (4), and its int8 input
    and scales (quant.QUANT_IN, 1 byte an element), so that the recomputed forward does not quantize the input
    again. A model with experts keeps each MoE layer's routing indices (moe.ROUTING: the chosen experts, the
    dispatch's order and counts, about 12 bytes a token copy), so that the recomputed forward sorts nothing again.
    The policies that offload to the host are left as they are."""
    if cfg.remat == "none":
        return None
    policy = REMAT_POLICIES[cfg.remat]
    if cfg.remat.startswith("offload"):
        return policy
    names = [moe.ROUTING] if cfg.n_experts else []
    if cfg.quantization == "int8":
        names.append(quant.QUANT_WEIGHT)
        if cfg.remat in ("minimal", "save_dots"):
            policy, names = _no_int32_dots(policy), [*names, quant.QUANT_OUT, quant.QUANT_IN]
    return _cp.save_from_both_policies(policy, _cp.save_only_these_names(*names)) if names else policy


def block(x_BTD: jax.Array, p: dict, cfg: ModelConfig, positions_BT: jax.Array, key: jax.Array | None,
          kind: str = "global", segment_ids_BT: jax.Array | None = None, reach_BT: jax.Array | None = None,
          mrope_BT3: jax.Array | None = None):
    """One pre-norm block of attention kind `kind`; returns the new residual stream and the MoE routing
    statistics [3, E] (zeros for a dense MLP in a model with experts; [3, 0] in a model without). reach_BT: the
    last position each token sees (a prompt with images, model/vision.py), None = its own; mrope_BT3: the rotary
    positions of a prompt with Qwen-VL images (model/vision_qwen.py), None = positions_BT."""
    keys = jax.random.split(key, 3) if key is not None else (None, None, None)
    # Every use below reads the named copy, so a policy that offloads it leaves no device copy for the backward.
    x_BTD = checkpoint_name(x_BTD, "decoder_layer_input")
    attn = lambda h, q: (attention_with_kv(h, q, cfg, positions_BT, keys[0], kind,  # noqa: E731
                                           segment_ids_BT, reach_BT, mrope_BT3)[0], None)
    x_BTD, stats_3E, _ = block_around(x_BTD, p, cfg, attn, keys[1:])
    return x_BTD, stats_3E


def attention_with_kv(h_BTD, p_attn, cfg: ModelConfig, positions_BT, key=None, kind: str = "global",
                      segment_ids_BT=None, reach_BT=None, mrope_BT3=None):
    """A layer's uncached self-attention (latent or ordinary): output, keys and values. reach_BT and mrope_BT3 (a
    prompt with images) take ordinary attention, the one whose mask and rotary take them (with_images refuses
    latent attention)."""
    if reach_BT is None and mrope_BT3 is None:
        attn_mod = latent if cfg.latent else attention
        return attn_mod.attention_with_kv(h_BTD, p_attn, cfg, positions_BT, key, kind, segment_ids_BT)
    return attention.attention_with_kv(h_BTD, p_attn, cfg, positions_BT, key, kind, segment_ids_BT, reach_BT,
                                       mrope_BT3)


def _mlp(x_BTD, p, cfg: ModelConfig, norm_in, norm_out=None):
    """A layer's MLP of the normalized residual stream, norm_out(mlp(norm_in(x))), mixture of experts when its
    weights have a router: output and routing statistics."""
    act = layers.activation_of(cfg)
    post = norm_out or (lambda h: h)
    if "router" in p:
        h_BTD, stats_3E = moe.moe(norm_in(x_BTD), p, act, moe.router_of(cfg), cfg.expert_capacity_factor,
                                  cfg.expert_all_to_all, cfg.moe_matmul, cfg.megablox_tiles)
        return post(h_BTD), stats_3E
    C, T = cfg.mlp_chunk_tokens, x_BTD.shape[1]
    if 0 < C < T and T % C == 0:
        return _chunked_mlp(x_BTD, p, act, C, norm_in, post), jnp.zeros((3, cfg.n_experts), jnp.float32)
    return post(layers.mlp(norm_in(x_BTD), p, act)), jnp.zeros((3, cfg.n_experts), jnp.float32)


def _chunked_mlp(x_BTD, p, act, C: int, norm_in, norm_out):
    """norm_out(mlp(norm_in(x))) C positions at a time (model.mlp_chunk_tokens; n = T / C chunks), each chunk
    rematerialized, so a long sequence's [B, T, F] activations are never all alive. The norms (per position) run
    inside the chunks too: their float32 intermediates and the input's gradient exist a chunk at a time, never as
    float32 [B, T, D] arrays. A 4-bit base is dequantized once for all the chunks, not once a chunk."""
    B, T, D = x_BTD.shape
    p = {k: layers.dequantized(w, x_BTD.dtype) for k, w in p.items()}

    def one(i_x):  # an adapter's dropout draws a mask of its own for each chunk
        i, x_BCD = i_x
        q = {k: dataclasses.replace(w, key=jax.random.fold_in(w.key, i))
             if isinstance(w, layers.LoraWeight) and w.key is not None else w for k, w in p.items()}
        return norm_out(layers.mlp(norm_in(x_BCD), q, act))

    x_nBCD = x_BTD.reshape(B, T // C, C, D).swapaxes(0, 1)
    out_nBCD = jax.lax.map(jax.checkpoint(one, policy=_cp.nothing_saveable), (jnp.arange(T // C), x_nBCD))
    return out_nBCD.swapaxes(0, 1).reshape(B, T, -1)


def block_around(x_BTD, p, cfg: ModelConfig, attn, keys=(None, None)):
    """The block around an attention function attn(h_BTD, p_attn) -> (out_BTD, extra); also returns extra
    (what a cached attention hands back: keys and values, or the updated layer cache)."""
    norm = lambda x, q: layers.norm(x, q, cfg.norm, cfg.norm_eps, cfg.norm_plus_one)  # noqa: E731
    with jax.named_scope("attn_block"):
        h_BTD, extra = attn(norm(x_BTD, p["attn_norm"]), p["attn"])
        if cfg.post_norms:
            h_BTD = norm(h_BTD, p["attn_post_norm"])
        x_BTD = x_BTD + layers.dropout(h_BTD, cfg.dropout, keys[0])
    with jax.named_scope("mlp_block"):
        h_BTD, stats_3E = _mlp(x_BTD, p["mlp"], cfg, lambda x: norm(x, p["mlp_norm"]),
                               (lambda h: norm(h, p["mlp_post_norm"])) if cfg.post_norms else None)
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
        return head(params, x_BTD, cfg)


def head(params, h_BTD, cfg: ModelConfig):
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


# The dense matmul weights of a layer, by block: what cast_matmul_weights casts and pins (the experts' own
# up/gate/down are left to moe.py).
MATMUL_WEIGHTS = {"attn": ("q", "k", "v", "o", "q_a", "q_b", "kv_a", "k_rope", "k_b", "v_b"),
                  "mlp": ("up", "gate", "down", "shared_up", "shared_gate", "shared_down")}
EXPERT_WEIGHTS = ("up", "gate", "down")


def cast_matmul_weights(p: dict, cfg: ModelConfig, specs: dict | None = None) -> dict:
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
                segment_ids_BT: jax.Array | None, layer_keys: jax.Array | None, reach_BT: jax.Array | None = None,
                mrope_BT3: jax.Array | None = None, deepstack_SBTD: jax.Array | None = None
                ) -> tuple[jax.Array, jax.Array]:
    """Run the n layers stacked in layer_params (all of them, or a pipeline stage's n, a multiple of
    len(cfg.pattern)): the new residual stream and the layers' routing statistics [n, 3, E] in layer order.
    deepstack_SBTD (Qwen3-VL images): added to the output of layer s for s < S (add_deepstack)."""
    n = jax.tree.leaves(layer_params["attn_norm"])[0].shape[0]
    P = len(cfg.pattern)
    bodies = {}

    def body(kind: stack.Kind, scanned: bool):
        if (kind, scanned) not in bodies:
            fn = lambda x, p, k: block(x, cast_matmul_weights(p, cfg), cfg, positions_BT, k,  # noqa: E731
                                       kind.attention, segment_ids_BT, reach_BT, mrope_BT3)
            if cfg.remat != "none":
                fn = jax.checkpoint(fn, policy=remat_policy(cfg), prevent_cse=not scanned)
            bodies[kind, scanned] = fn
        return bodies[kind, scanned]

    def step(x_BTD, p, kind, j, r, key):
        x_BTD, stats_3E = body(kind, scanned=not isinstance(r, int))(x_BTD, p, key)
        return add_deepstack(x_BTD, deepstack_SBTD, r * P + j), stats_3E

    keys = None if layer_keys is None else tuple(layer_keys[j::P] for j in range(P))
    x_BTD, stats = stack.run(cfg, layer_params, step, x_BTD, keys, scan=cfg.scan_layers, n_layers=n,
                             remat=remat_policy(cfg))
    return x_BTD, stack.in_layer_order(stats, n)


def add_deepstack(x_BTD, deepstack_SBTD, i):
    """Layer i's output plus its deepstack addend (Qwen3-VL: model/vision_qwen3.py) when i < S; i may be traced
    (inside the scan). Without deepstack (None, or S = 0) x_BTD unchanged: text-only programs are untouched."""
    if deepstack_SBTD is None or deepstack_SBTD.shape[0] == 0:
        return x_BTD
    S = deepstack_SBTD.shape[0]
    if isinstance(i, int):
        return x_BTD + deepstack_SBTD[i].astype(x_BTD.dtype) if i < S else x_BTD
    addend_BTD = jax.lax.dynamic_index_in_dim(deepstack_SBTD, jnp.minimum(i, S - 1), keepdims=False)
    return x_BTD + jnp.where(i < S, addend_BTD, 0).astype(x_BTD.dtype)


@quant.scoped
def forward_with_aux(params: dict, tokens_BT: jax.Array, cfg: ModelConfig, key: jax.Array | None = None,
                     positions_BT: jax.Array | None = None, segment_ids_BT: jax.Array | None = None,
                     images: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Logits [B, T, V] in float32 and the auxiliary (load-balancing) loss, 0 for dense models.

    positions_BT default to 0..T-1 in every row; segment_ids_BT (int32, None = one segment per row) mark the
    documents packed into a row: attention never crosses a segment, and positions restart at each one. images
    (a model with a vision tower): the preprocessed images [I, S, S, 3] of the batch in the order their image
    tokens appear, row after row; their soft tokens replace those tokens (model/vision.py)."""
    x_BTD, aux = hidden_with_aux(params, tokens_BT, cfg, key, positions_BT, segment_ids_BT, images)
    return unembed(params, x_BTD, cfg), aux


@quant.scoped
def hidden_with_aux(params: dict, tokens_BT: jax.Array, cfg: ModelConfig, key: jax.Array | None = None,
                    positions_BT: jax.Array | None = None, segment_ids_BT: jax.Array | None = None,
                    images: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The residual stream after the last block [B, T, D] (before the final norm) and the auxiliary loss."""
    x_BTD, stats_L3E = hidden_with_stats(params, tokens_BT, cfg, key, positions_BT, segment_ids_BT, images)
    return x_BTD, aux_loss(stats_L3E, cfg)


def default_positions(tokens_BT, positions_BT):
    """positions_BT, or 0..T-1 in every row when None."""
    B, T = tokens_BT.shape
    return jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)) if positions_BT is None else positions_BT


def with_images(params, x_BTD, tokens_BT, positions_BT, images, cfg: ModelConfig):
    """The embeddings with the images' soft tokens in place of their image tokens, the reach of every token
    (Gemma 3: model/vision.py; Llama 4 attends causally over its image tokens, its images the prompt's tiles), the
    M-RoPE positions [B, T, 3] (Qwen-VL: model/vision_qwen.py) and the deepstack addends [S, B, T, D] (Qwen3-VL:
    model/vision_qwen3.py); without images, the embeddings, None (causal), None (positions_BT) and None."""
    if images is None:
        return x_BTD, None, None, None
    if cfg.vision is None or cfg.latent:
        raise ConfigError("images need a model with a vision tower (model.vision) and ordinary attention")
    return tower(cfg).images_in(params["vision"], x_BTD, tokens_BT, positions_BT, images, cfg)


def hidden_with_stats(params, tokens_BT, cfg: ModelConfig, key, positions_BT, segment_ids_BT, images=None):
    """The residual stream after the last block and the MoE layers' routing statistics [L_moe, 3, E]."""
    positions_BT = default_positions(tokens_BT, positions_BT)
    if cfg.dropout == 0.0:
        key = None
    x_BTD, reach_BT, mrope_BT3, deepstack_SBTD = with_images(params, embed(params, tokens_BT, cfg, positions_BT),
                                                             tokens_BT, positions_BT, images, cfg)
    if key is not None:
        key, sub = jax.random.split(key)
        x_BTD = layers.dropout(x_BTD, cfg.dropout, sub)
    x_BTD = constrain(x_BTD, ("batch", "length", "embed"))

    layer_keys = jax.random.split(key, cfg.n_layers) if key is not None else None
    run = lambda x, p, pos, seg, keys: layer_stack(x, p, cfg, pos, seg, keys, reach_BT, mrope_BT3,  # noqa: E731
                                                   deepstack_SBTD)
    if (pipe := pipeline_settings()) is not None:
        if images is not None:
            raise ConfigError("images are not supported with pipeline stages (mesh stage axis over 1); set "
                              "mesh.ici_stage / mesh.dcn_stage to 1")
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


def aux_loss(stats_L3E, cfg: ModelConfig) -> jax.Array:
    """The load-balancing loss of the MoE layers' routing statistics [L_moe, 3, E] (0 without MoE layers)."""
    return moe.load_balancing_loss(stats_L3E) if stats_L3E.shape[0] else jnp.zeros((), jnp.float32)


def forward(params: dict, tokens_BT: jax.Array, cfg: ModelConfig, key: jax.Array | None = None,
            positions_BT: jax.Array | None = None, segment_ids_BT: jax.Array | None = None,
            images: jax.Array | None = None) -> jax.Array:
    """Logits [B, T, V] in float32. `key` enables dropout (training); None is deterministic. images:
    forward_with_aux."""
    return forward_with_aux(params, tokens_BT, cfg, key, positions_BT, segment_ids_BT, images)[0]


@quant.scoped
def attention_logit_max(params: dict, tokens_BT: jax.Array, cfg: ModelConfig, positions_BT: jax.Array | None = None,
                        segment_ids_BT: jax.Array | None = None) -> jax.Array:
    """The largest attention logit of every layer's query heads over the batch [L, N] (before soft-capping), from
    a forward pass without dropout or output layer: what MuonClip's QK-clip watches (clip_qk)."""
    positions_BT = default_positions(tokens_BT, positions_BT)
    x_BTD = constrain(embed(params, tokens_BT, cfg, positions_BT), ("batch", "length", "embed"))
    attn_mod = latent if cfg.latent else attention

    def step(x_BTD, p, kind, j, r, _):
        def attn(h_BTD, p_attn):
            return attn_mod.attention_with_logit_max(h_BTD, p_attn, cfg, positions_BT, kind.attention, segment_ids_BT)

        x_BTD, _, top_N = block_around(x_BTD, cast_matmul_weights(p, cfg), cfg, attn)
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
