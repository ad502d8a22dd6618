"""Mixture-of-experts MLP: a router picks the top-k experts of every token, and a dropless dispatch sorts the token
copies by expert so that one grouped matmul (`jax.lax.ragged_dot`, or JAX's megablox Pallas kernel where
model.moe_matmul asks: `grouped_matmul`) runs each expert on exactly the tokens it received. Routers (`Router`,
from the model options): softmax or sigmoid scores, plain or group-limited top-k, the weight on the expert's
output or its input; shared experts are one dense MLP every token goes through. DeepSeek-V3's auxiliary-loss-free
balancing bias moves outside the gradient (`_balance_signal`). A mesh that splits the experts runs the layer
expert-parallel instead (model/expert_parallel.py). docs/families.md, "The options".

Shape legend: B batch, T length, D model width, E experts, K experts per token, F expert hidden width,
M tokens (B * T), A token copies (M * K), sorted by expert, n groups of experts.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxlm import runtime, sharding
from jaxlm.model import expert_parallel, layers
from jaxlm.params import ParamSpec, normal, zeros

# The balancing bias's step rides in its gradient slot this much smaller, so that global-norm clipping and the
# logged gradient norm do not see it (train/optim.py divides it back out; a power of two: exact both ways).
BALANCE_SIGNAL = 2.0 ** -40
# The name of a MoE layer's routing indices (the chosen experts, the dispatch's order, inverse and counts), which
# every remat policy but the offloading ones keeps (transformer.remat_policy): 12 bytes a token copy, against the
# router's top-k and the dispatch's sort recomputed in the backward.
ROUTING = "moe_routing"


class Router(NamedTuple):
    """A MoE layer's routing rule (hashable: static)."""
    k: int
    score: str = "softmax"
    norm_topk: bool = True
    scale: float = 1.0
    groups: int = 1
    topk_groups: int = 1
    weights_input: bool = False
    balance_rate: float = 0.0


def router_of(cfg) -> Router:
    return Router(cfg.experts_per_token, cfg.router_score, cfg.router_norm_topk, cfg.router_scale, cfg.router_groups,
                  cfg.router_topk_groups, cfg.router_weights_input, cfg.moe_bias_update_rate)


def specs(cfg, L: int) -> dict:
    """The weights of L stacked MoE layers: router [L, D, E], experts' up/gate [L, E, D, F] and down
    [L, E, F, D], and the biases and shared expert the options ask for."""
    D, E, F, dt = cfg.d_model, cfg.n_experts, cfg.expert_ff, cfg.param_dtype
    w, w_out = normal(cfg.init_std), normal(cfg.init_std / (2 * cfg.n_layers) ** 0.5)
    p = {"router": ParamSpec((L, D, E), ("layers", "embed", None), w, dt),
         "up": ParamSpec((L, E, D, F), ("layers", "experts", "embed", "mlp"), w, dt),
         "down": ParamSpec((L, E, F, D), ("layers", "experts", "mlp", "embed"), w_out, dt)}
    if cfg.glu:
        p["gate"] = ParamSpec((L, E, D, F), ("layers", "experts", "embed", "mlp"), w, dt)
    if cfg.router_bias:
        p["router_bias"] = ParamSpec((L, E), ("layers", None), zeros, dt)
    if cfg.router_balance_bias:
        p["balance_bias"] = ParamSpec((L, E), ("layers", None), zeros, "float32")
    if cfg.expert_bias or cfg.bias:
        p["up_bias"] = ParamSpec((L, E, F), ("layers", "experts", "mlp"), zeros, dt)
        p["down_bias"] = ParamSpec((L, E, D), ("layers", "experts", "embed"), zeros, dt)
        if cfg.glu:
            p["gate_bias"] = ParamSpec((L, E, F), ("layers", "experts", "mlp"), zeros, dt)
    if cfg.n_shared_experts:
        p.update(layers.mlp_specs(cfg, L, cfg.n_shared_experts * cfg.expert_ff, prefix="shared_", bias=False))
    return p


def route(x_MD: jax.Array, p: dict, router: Router):
    """Router statistics' scores over all experts [M, E] (float32: the softmax, or the sigmoids normalized to
    sum to 1), the chosen experts [M, K] and their weights [M, K]."""
    logits_ME = layers.dot("MD,DE->ME", x_MD, p["router"]).astype(jnp.float32)
    if "router_bias" in p:
        logits_ME = logits_ME + p["router_bias"].astype(jnp.float32)
    if router.score == "softmax":
        scores_ME = jax.nn.softmax(logits_ME, axis=-1)
        stats_ME = scores_ME
    else:
        scores_ME = jax.nn.sigmoid(logits_ME)
        stats_ME = scores_ME / jnp.sum(scores_ME, axis=-1, keepdims=True)
    choose_ME = scores_ME
    if "balance_bias" in p:
        choose_ME = choose_ME + jax.lax.stop_gradient(p["balance_bias"])
    if router.groups > 1:
        choose_ME = _best_groups(choose_ME, router.groups, router.topk_groups)
    experts_MK = checkpoint_name(jax.lax.top_k(jax.lax.stop_gradient(choose_ME), router.k)[1], ROUTING)
    # The chosen scores by a one-hot product (exact: one nonzero term), whose gradient is a product too, where
    # take_along_axis's is a scatter of M * K values into [M, E].
    chosen_MKE = jax.nn.one_hot(experts_MK, scores_ME.shape[-1], dtype=scores_ME.dtype)
    weights_MK = jnp.sum(scores_ME[:, None, :] * chosen_MKE, axis=-1)
    if router.norm_topk:
        weights_MK = weights_MK / (jnp.sum(weights_MK, axis=-1, keepdims=True) + (1e-20 if router.score == "sigmoid"
                                                                                    else 0.0))
    return stats_ME, experts_MK, weights_MK * router.scale


def _best_groups(scores_ME: jax.Array, n: int, topk: int) -> jax.Array:
    """Scores of the experts outside each token's `topk` best groups (by the sum of a group's two best scores)
    set to -inf: DeepSeek-V3's group-limited routing."""
    M, E = scores_ME.shape
    grouped_MnG = scores_ME.reshape(M, n, E // n)
    group_Mn = jnp.sum(jax.lax.top_k(grouped_MnG, min(2, E // n))[0], axis=-1)
    _, best_Mt = jax.lax.top_k(group_Mn, topk)
    keep_Mn = jnp.zeros((M, n), bool).at[jnp.arange(M)[:, None], best_Mt].set(True)
    return jnp.where(keep_Mn[:, :, None], grouped_MnG, -jnp.inf).reshape(M, E)


def grouped_matmul(setting: str) -> str:
    """The grouped matmul model.moe_matmul names: ragged_dot (`jax.lax.ragged_dot`, any platform) or megablox
    (JAX's Pallas kernel for TPU; Pallas interpret mode on other platforms: exact but slow, for tests). auto is
    megablox where the program runs on a TPU (the active mesh's devices: an ahead-of-time compile for one
    included), 1.10x and 1.18x ragged_dot on one v5e (benchmarks/tpu.py, section moe; docs/performance.md,
    "Mixtures of experts"), and ragged_dot elsewhere."""
    if setting != "auto":
        return setting
    ctx = sharding.active()
    return "megablox" if runtime.platform(ctx[0] if ctx is not None else None) == "tpu" else "ragged_dot"


def experts(x_AD: jax.Array, p: dict, group_sizes_E: jax.Array, act: layers.Activation,
            matmul: str = "ragged_dot", filled: bool = False, tiles: tuple[int, int, int] | None = None,
            scale_A: jax.Array | None = None) -> jax.Array:
    """The experts' MLPs on token copies sorted by expert, group_sizes_E[e] of them for expert e of p, by the
    grouped matmul `matmul` (ragged_dot or megablox). filled: the groups cover every row (the one-device
    dropless dispatch), so megablox needs no mask for rows past them; tiles: megablox's (model.moe_tiles).
    scale_A: each copy's output scaled by its router weight, applied to the hidden rows [A, F] before the down
    projection (and to its bias), where the activation's fusion does it at no extra pass: the combine is then
    a plain sum, and the weights' gradient a reduction in that fusion's backward instead of one over [A, D]."""
    if matmul == "megablox":
        ctx = sharding.active()
        dot = functools.partial(layers.megablox_dot, filled=filled, tiles=tiles,
                                interpret=runtime.platform(ctx[0] if ctx is not None else None) != "tpu")
    else:
        dot = layers.ragged_dot

    def proj(x, name, scale=None):
        y = dot(x, p[name], group_sizes_E)
        if name + "_bias" in p:  # each row gets its own expert's bias
            b = jnp.repeat(p[name + "_bias"], group_sizes_E, axis=0, total_repeat_length=x.shape[0])
            y = y + (b if scale is None else b * scale[:, None]).astype(y.dtype)
        return y

    h_AF = act(proj(x_AD, "up"), proj(x_AD, "gate") if act.glu else None)
    if scale_A is not None:
        h_AF = (h_AF * scale_A[:, None]).astype(h_AF.dtype)
    return proj(h_AF, "down", scale_A)


def moe(x_BTD: jax.Array, p: dict, act: layers.Activation, router: Router, capacity_factor: float = 0.0,
        all_to_all: str = "auto", matmul: str = "auto", tiles: tuple[int, int, int] | None = None):
    """Returns the MLP output [B, T, D] and this layer's routing statistics [3, E]: the fraction of token
    copies each expert was routed (the two factors of the load-balancing loss), its mean router score,
    and the fraction of token copies dropped for lack of room (only expert-parallel with a capacity factor
    drops any). capacity_factor, all_to_all, matmul and tiles: model.expert_capacity_factor /
    model.expert_all_to_all / model.moe_matmul / model.moe_tiles (megablox's)."""
    matmul = grouped_matmul(matmul)
    sharded = expert_parallel.plan(x_BTD, p["up"].shape[0])
    routed = {k: v for k, v in p.items() if not k.startswith("shared_")}
    if sharded is not None:
        y_BTD, stats_3E = expert_parallel.moe(sharded, x_BTD, routed, router.k, capacity_factor, all_to_all,
                                              functools.partial(route, router=router),
                                              lambda x_AD, q, g_E: experts(x_AD, q, g_E, act, matmul, tiles=tiles),
                                              router.weights_input, pallas=matmul == "megablox")
    else:
        y_BTD, stats_3E = _moe_one_device(x_BTD, routed, act, router, matmul, tiles)
    if "shared_up" in p:
        with jax.named_scope("shared_experts"):
            y_BTD = y_BTD + layers.mlp(x_BTD, p, act, prefix="shared_")
    if "balance_bias" in p:
        y_BTD = _balance_signal(y_BTD, p["balance_bias"], stats_3E[0], router.balance_rate)
    return y_BTD, stats_3E


def _moe_one_device(x_BTD, p, act, router: Router, matmul: str, tiles=None):
    B, T, D = x_BTD.shape
    k = router.k
    E = p["router"].shape[-1]
    with jax.named_scope("router"):
        x_MD = x_BTD.reshape(B * T, D)
        stats_ME, experts_MK, weights_MK = route(x_MD, p, router)
    with jax.named_scope("dispatch"):
        order_A, slot_A, group_sizes_E = (checkpoint_name(a, ROUTING) for a in sort_by_expert(experts_MK, E))
        if router.weights_input:  # each copy carries its token scaled by its weight
            xw_AD = (x_MD[:, None, :] * weights_MK[..., None].astype(x_MD.dtype)).reshape(B * T * k, D)
            x_AD, scale_A = permute(xw_AD, order_A, slot_A), None
        else:  # the weights in expert order scale the experts' hidden rows
            x_AD = copies(x_MD, order_A, slot_A, k)
            scale_A = permute(weights_MK.reshape(B * T * k, 1), order_A, slot_A)[:, 0]
    with jax.named_scope("experts"):
        y_AD = experts(x_AD, p, group_sizes_E, act, matmul, filled=True, tiles=tiles, scale_A=scale_A)
    with jax.named_scope("combine"):
        y_MD = combine(y_AD, order_A, slot_A, k)
    stats_3E = jnp.stack([group_sizes_E.astype(jnp.float32) / (B * T), jnp.mean(stats_ME, axis=0),
                          jnp.zeros((E,), jnp.float32)])
    return y_MD.reshape(B, T, D).astype(x_BTD.dtype), stats_3E


def sort_by_expert(experts_MK: jax.Array, E: int):
    """The token copies (copy a = token a // K's a % K-th choice) in order of expert: order_A[i] the copy at slot i,
    slot_A[a] the slot of copy a (its inverse), and the copies each expert received [E]. One sort of A int32
    keys; the counts by comparison and sum, not a scatter-add (XLA:TPU serializes colliding scatters)."""
    experts_A = experts_MK.reshape(-1)
    order_A = jnp.argsort(experts_A, stable=True).astype(jnp.int32)
    slot_A = jnp.zeros_like(order_A).at[order_A].set(jnp.arange(order_A.shape[0], dtype=jnp.int32),
                                                      unique_indices=True, mode="promise_in_bounds")
    group_sizes_E = jnp.sum(experts_A[:, None] == jnp.arange(E, dtype=experts_A.dtype), axis=0, dtype=jnp.int32)
    return order_A, slot_A, group_sizes_E


def _rows(x, rows_A):
    return x.at[rows_A].get(mode="promise_in_bounds")


@jax.custom_vjp
def permute(x_AD: jax.Array, to_A: jax.Array, back_A: jax.Array) -> jax.Array:
    """x_AD[to_A] for a permutation to_A whose inverse is back_A. Its gradient is a gather by the inverse, where
    autodiff's would be a scatter into zeros: one pass over the [A, D] rows each way (docs/performance.md,
    "Mixtures of experts")."""
    return _rows(x_AD, to_A)


def _permute_fwd(x_AD, to_A, back_A):
    return _rows(x_AD, to_A), back_A


def _permute_bwd(back_A, g_AD):
    return _rows(g_AD, back_A), None, None


permute.defvjp(_permute_fwd, _permute_bwd)


def _spread(x_MD, order_A, k):
    return _rows(x_MD, order_A // k)


def _gather_sum(g_AD, slot_A, k):
    g_MkD = _rows(g_AD, slot_A).reshape(-1, k, g_AD.shape[-1])
    return jnp.sum(g_MkD, axis=1, dtype=jnp.float32).astype(g_AD.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def copies(x_MD: jax.Array, order_A: jax.Array, slot_A: jax.Array, k: int) -> jax.Array:
    """The k copies of each token in expert order, x_MD[order_A // k] (sort_by_expert's order_A and slot_A). The
    gradient gathers each token's k copies back by slot_A and sums them in float32 (`combine`), where autodiff's
    would scatter-add [A, D] rows into [M, D]."""
    return _spread(x_MD, order_A, k)


def _copies_fwd(x_MD, order_A, slot_A, k):
    return _spread(x_MD, order_A, k), slot_A


def _copies_bwd(k, slot_A, g_AD):
    return _gather_sum(g_AD, slot_A, k), None, None


copies.defvjp(_copies_fwd, _copies_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def combine(y_AD: jax.Array, order_A: jax.Array, slot_A: jax.Array, k: int) -> jax.Array:
    """Each token's k copies (in expert order) gathered back by slot_A and summed in float32 [M, D]: the
    transpose of `copies`, whose forward is this one's gradient (one gather of [M, D] rows into [A, D])."""
    return _gather_sum(y_AD, slot_A, k)


def _combine_fwd(y_AD, order_A, slot_A, k):
    return _gather_sum(y_AD, slot_A, k), order_A


def _combine_bwd(k, order_A, g_MD):
    return _spread(g_MD, order_A, k), None, None


combine.defvjp(_combine_fwd, _combine_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _balance_signal(y, bias_E, load_E, rate: float):
    """y itself; the balancing bias's gradient slot (the loss has none there) receives its step,
    BALANCE_SIGNAL * rate * sign(load - mean load) from the whole batch's loads (global under jit, psum'ed when
    expert-parallel): the optimizer (train/optim.py) moves the bias by minus that over BALANCE_SIGNAL instead of
    AdamW and leaves it out of clipping, so no other weight or the gradient norm sees it (docs/families.md)."""
    return y


def _balance_signal_fwd(y, bias_E, load_E, rate):
    return y, (load_E, bias_E)


def _balance_signal_bwd(rate, res, g_y):
    load_E, bias_E = res
    step_E = BALANCE_SIGNAL * rate * jnp.sign(load_E - jnp.mean(load_E))
    return g_y, step_E.astype(bias_E.dtype), jnp.zeros_like(load_E)


_balance_signal.defvjp(_balance_signal_fwd, _balance_signal_bwd)


def load_balancing_loss(stats_L3E: jax.Array) -> jax.Array:
    """Switch-Transformer auxiliary loss over all layers, E * sum_e f_e * P_e, with f_e the fraction of token
    copies routed to expert e and P_e its mean router score (pooled over layers, as Mixtral and Qwen3-MoE
    train)."""
    E = stats_L3E.shape[-1]
    f_E, P_E = jnp.mean(stats_L3E[:, :2], axis=0)
    return E * jnp.sum(f_E * P_E)
