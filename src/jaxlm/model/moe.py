"""Mixture-of-experts MLP (Mixtral): a softmax router picks the top-k experts of every token, and a dropless
dispatch sorts the token copies by expert so that one grouped matmul (`jax.lax.ragged_dot`) runs each expert
on exactly the tokens it received: no capacity factor, no dropped tokens, no dense loop over experts.

When the active mesh splits the experts over devices (an `expert` axis over 1), the layer runs expert-parallel
instead (model/expert_parallel.py): the token copies travel to their experts' devices and back, dropless
too unless model.expert_capacity_factor bounds what each expert takes.

Shape legend: B batch, T length, D model width, E experts, K experts per token, F expert hidden width,
M tokens (B * T), A token copies (M * K), sorted by expert.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxlm.model import expert_parallel, layers


def route(x_MD: jax.Array, router_DE: jax.Array, k: int):
    """Router probabilities over all experts [M, E] (float32), the chosen experts [M, K] and their
    weights [M, K], renormalized to sum to 1 over the chosen ones."""
    logits_ME = layers.dot("MD,DE->ME", x_MD, router_DE)
    probs_ME = jax.nn.softmax(logits_ME.astype(jnp.float32), axis=-1)
    weights_MK, experts_MK = jax.lax.top_k(probs_ME, k)
    return probs_ME, experts_MK, weights_MK / jnp.sum(weights_MK, axis=-1, keepdims=True)


def experts(x_AD: jax.Array, p: dict, group_sizes_E: jax.Array, activation: str, glu: bool) -> jax.Array:
    """The experts' MLPs on token copies sorted by expert, group_sizes_E[e] of them for expert e of p."""
    act = layers.ACTIVATIONS[activation]
    h_AF = layers.ragged_dot(x_AD, p["up"], group_sizes_E)
    h_AF = act(layers.ragged_dot(x_AD, p["gate"], group_sizes_E)) * h_AF if glu else act(h_AF)
    return layers.ragged_dot(h_AF, p["down"], group_sizes_E)


def moe(x_BTD: jax.Array, p: dict, activation: str, glu: bool, k: int, capacity_factor: float = 0.0,
        all_to_all: str = "auto"):
    """Returns the MLP output [B, T, D] and this layer's routing statistics [3, E]: the fraction of token
    copies each expert was routed (the two factors of the load-balancing loss), its mean router probability,
    and the fraction of token copies dropped for lack of room (only expert-parallel with a capacity factor
    drops any). capacity_factor and all_to_all: model.expert_capacity_factor / model.expert_all_to_all."""
    sharded = expert_parallel.plan(x_BTD, p["up"].shape[0])
    if sharded is not None:
        return expert_parallel.moe(sharded, x_BTD, p, k, capacity_factor, all_to_all, route,
                                   lambda x_AD, q, g_E: experts(x_AD, q, g_E, activation, glu))
    B, T, D = x_BTD.shape
    E = p["router"].shape[-1]
    with jax.named_scope("router"):
        x_MD = x_BTD.reshape(B * T, D)
        probs_ME, experts_MK, weights_MK = route(x_MD, p["router"], k)
    with jax.named_scope("dispatch"):
        experts_A = experts_MK.reshape(-1)
        order_A = jnp.argsort(experts_A, stable=True)
        x_AD = jnp.take(x_MD, order_A // k, axis=0)
        group_sizes_E = jnp.bincount(experts_A, length=E).astype(jnp.int32)
    with jax.named_scope("experts"):
        y_AD = experts(x_AD, p, group_sizes_E, activation, glu)
    with jax.named_scope("combine"):
        y_AD = jnp.zeros_like(y_AD).at[order_A].set(y_AD)
        y_MD = jnp.einsum("MKD,MK->MD", y_AD.reshape(B * T, k, D).astype(jnp.float32), weights_MK)
    stats_3E = jnp.stack([group_sizes_E.astype(jnp.float32) / (B * T), jnp.mean(probs_ME, axis=0),
                          jnp.zeros((E,), jnp.float32)])
    return y_MD.reshape(B, T, D).astype(x_BTD.dtype), stats_3E


def load_balancing_loss(stats_L3E: jax.Array) -> jax.Array:
    """Switch-Transformer auxiliary loss over all layers, E * sum_e f_e * P_e, with f_e the fraction of token
    copies routed to expert e and P_e its mean router probability (pooled over layers, as Mixtral trains)."""
    E = stats_L3E.shape[-1]
    f_E, P_E = jnp.mean(stats_L3E[:, :2], axis=0)
    return E * jnp.sum(f_E * P_E)
