"""The training loss and what objectives take from the model: next-token cross-entropy (all at once, or a chunk
of the sequence at a time: model.loss_chunk_tokens), the multi-token prediction modules' loss, the
load-balancing term, and each target's log-probability and entropy (`token_logprobs`).

Shape legend: B batch, T length, D model width, V vocab, C positions per chunk, n chunks, E experts.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxlm.config import ModelConfig
from jaxlm.model import quant
from jaxlm.model.mtp import mtp_hidden
from jaxlm.model.transformer import aux_loss, default_positions, head, hidden_with_aux, hidden_with_stats, unembed


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
    weights_BT = None if weights_BT is None else weights_BT.astype(jnp.float32)
    head_p = _head_params(params, cfg)
    if logits_of is None and head_p is not None:
        if weights_BT is None:
            weights_BT = jnp.ones(targets_BT.shape, jnp.float32)
        return _loss_sum_with_gradients(head_p, x_BTD, targets_BT, weights_BT, cfg)
    losses_BT = by_chunks(token_losses, params, x_BTD, targets_BT, cfg, logits_of)
    return _weighted_sum(losses_BT, weights_BT)


def _head_params(params: dict, cfg: ModelConfig) -> dict | None:
    """The weights `unembed` reads (final norm, output projection), or None where one of them is not a plain
    floating-point array (a quantized or adapted weight takes the rematerialized path, by_chunks)."""
    out = {"embed": {"tokens": params["embed"]["tokens"]}} if cfg.tie_embeddings else {"lm_head": params["lm_head"]}
    head_p = {"final_norm": params["final_norm"], **out}
    leaves = jax.tree.leaves(head_p, is_leaf=lambda a: not isinstance(a, dict))
    plain = all(isinstance(a, jax.Array) and jnp.issubdtype(a.dtype, jnp.floating) for a in leaves)
    return head_p if plain else None


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _loss_sum_with_gradients(head_p, x_BTD, targets_BT, weights_BT, cfg: ModelConfig):
    """sum(token_losses(unembed(head_p, x)) * weights), cfg.loss_chunk_tokens positions at a time. The loss is
    the last thing the step computes, so its gradient is known in the forward up to the one scalar that the
    backward hands back: each chunk's gradients are taken while its logits exist (vjp with the chunk's weights as
    the cotangent), and the backward only scales them. Against by_chunks' rematerialization this saves one
    [B, C, D] x [D, V] matmul and one pass of exp over the [B, C, V] logits per chunk (docs/performance.md)."""
    return _losses_and_gradients(head_p, x_BTD, targets_BT, weights_BT, cfg, grads=False)[0]


def _losses_and_gradients(head_p, x_BTD, targets_BT, weights_BT, cfg: ModelConfig, grads: bool = True,
                          head_grads: bool = True):
    """The weighted loss sum and, with `grads`, its gradients with respect to head_p (float32; None without
    `head_grads`: a frozen output layer, as under LoRA) and x_BTD."""
    B, T, D = x_BTD.shape
    C = min(cfg.loss_chunk_tokens, T)
    pad = -T % C
    padded = (jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2)) for a in (x_BTD, targets_BT, weights_BT))
    chunks = tuple(a.reshape(B, (T + pad) // C, C, *a.shape[2:]).swapaxes(0, 1) for a in padded)

    def chunk(dp_sum, xs):
        x_BCD, targets_BC, weights_BC = xs
        if not grads:
            return dp_sum, (token_losses(unembed(head_p, x_BCD, cfg), targets_BC), None)
        if not head_grads:
            losses_BC, vjp = jax.vjp(lambda x: token_losses(unembed(head_p, x, cfg), targets_BC), x_BCD)
            return dp_sum, (losses_BC, vjp(weights_BC)[0])
        losses_BC, vjp = jax.vjp(lambda p, x: token_losses(unembed(p, x, cfg), targets_BC), head_p, x_BCD)
        dp, dx_BCD = vjp(weights_BC)  # padded positions weigh 0
        return jax.tree.map(lambda s, d: s + d.astype(jnp.float32), dp_sum, dp), (losses_BC, dx_BCD)

    zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), head_p) if grads and head_grads else None
    with jax.named_scope("chunked_loss"):
        dp, (losses_nBC, dx_nBCD) = jax.lax.scan(chunk, zeros, chunks)
    losses_BT = losses_nBC.swapaxes(0, 1).reshape(B, T + pad)[:, :T]
    dx_BTD = dx_nBCD.swapaxes(0, 1).reshape(B, T + pad, D)[:, :T] if grads else None
    # Summed as cross_entropy_sum sums, so that the loss is the one by_chunks gives.
    return _weighted_sum(losses_BT, weights_BT), dp, dx_BTD


def _loss_sum_fwd(head_p, x_BTD, targets_BT, weights_BT, cfg):
    # symbolic_zeros: each leaf comes with whether it is differentiated; a frozen head's gradient is not taken.
    head_grads = any(a.perturbed for a in jax.tree.leaves(head_p))
    head_p, x_BTD, targets_BT, weights_BT = jax.custom_derivatives.custom_vjp_primal_tree_values(
        (head_p, x_BTD, targets_BT, weights_BT))
    loss, dp, dx_BTD = _losses_and_gradients(head_p, x_BTD, targets_BT, weights_BT, cfg, head_grads=head_grads)
    return loss, (dp, dx_BTD, head_p, weights_BT)


def _loss_sum_bwd(cfg, res, g):
    dp, dx_BTD, head_p, weights_BT = res
    if dp is not None:
        dp = jax.tree.map(lambda d, p: (d * g).astype(p.dtype), dp, head_p)
    return dp, (dx_BTD * g).astype(dx_BTD.dtype), None, jnp.zeros_like(weights_BT)


_loss_sum_with_gradients.defvjp(_loss_sum_fwd, _loss_sum_bwd, symbolic_zeros=True)


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
                                        lambda x: head(params, x, cfg))
    return total / cfg.mtp_layers, stats_M3E


@quant.scoped
def token_logprobs(params: dict, tokens_BT: jax.Array, targets_BT: jax.Array, cfg: ModelConfig,
                   key: jax.Array | None = None, positions_BT: jax.Array | None = None,
                   segment_ids_BT: jax.Array | None = None, temperature: float = 1.0, images: jax.Array | None = None
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each target's log-probability [B, T] under softmax(logits / temperature), each position's entropy of that
    distribution [B, T], and the auxiliary (load-balancing) loss: what objectives that score whole replies
    (preference tuning, reinforcement learning) take from the model. Sequences longer than cfg.loss_chunk_tokens
    are computed a chunk at a time (by_chunks), so the [B, T, V] logits never exist at once. images: the batch's
    preprocessed images, as transformer.forward takes them."""
    x_BTD, aux = hidden_with_aux(params, tokens_BT, cfg, key, positions_BT, segment_ids_BT, images)

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
            normalizer: jax.Array | None = None, images: jax.Array | None = None) -> jax.Array:
    """Cross-entropy, plus the weighted load-balancing loss for mixture-of-experts models and the weighted
    multi-token prediction loss (model.mtp_layers); for sequences longer than cfg.loss_chunk_tokens tokens the
    logits are computed a chunk of the sequence at a time (never all at once).

    Each token's loss counts with its weight (weights_BT: 1 trained, 0 masked such as prompts or padding; None =
    all 1) and the weighted sum is divided by `normalizer` (default: the sum of the weights here). A step that
    accumulates micro-batches passes the weight of the whole step over the number of micro-batches, so that
    the mean over micro-batches is exactly the mean over every counted token of the step. images: the batch's
    preprocessed images, as transformer.forward takes them."""
    return loss_terms(params, tokens_BT, targets_BT, cfg, key, positions_BT, segment_ids_BT, weights_BT,
                      normalizer, images)[0]


@quant.scoped
def loss_terms(params: dict, tokens_BT: jax.Array, targets_BT: jax.Array, cfg: ModelConfig,
               key: jax.Array | None = None, positions_BT: jax.Array | None = None,
               segment_ids_BT: jax.Array | None = None, weights_BT: jax.Array | None = None,
               normalizer: jax.Array | None = None, images: jax.Array | None = None
               ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`loss_fn`'s loss and its terms, for the logs: cross_entropy; with experts load_balancing (before
    router_aux_loss_coef); with MTP modules mtp (their mean cross-entropy, before mtp_loss_weight)."""
    positions_BT = default_positions(tokens_BT, positions_BT)
    x_BTD, stats_L3E = hidden_with_stats(params, tokens_BT, cfg, key, positions_BT, segment_ids_BT, images)
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
        terms["load_balancing"] = aux_loss(stats_L3E, cfg)
        loss = loss + cfg.router_aux_loss_coef * terms["load_balancing"]
    return loss, terms
