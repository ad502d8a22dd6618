"""Pipeline parallelism: the layer stack split into stages over the `stage` mesh axis, micro-batches flowing through
the stages on a circular schedule (circular GPipe, as MaxText runs it). `run` runs inside the forward pass
(transformer.py calls it when the mesh has more than one stage), so the train step, remat and every family need no
change, and the weights keep their one layout [L, ...]. The L layers form R * S chunks of C = L / (R * S) layers,
chunk r * S + s on stage s; at iteration t stage s runs micro-batch (t - s) mod M in repeat (t - s) // M while
0 <= t - s < R * M (`schedule`), then every stage's output moves one stage on. Each iteration is rematerialized;
with R > 1 the weights are regathered round-robin over `stage` (docs/scaling.md, "Pipeline parallelism").

Shape legend: B batch, T length, D model width, E experts, S stages, R repeats, C layers per chunk, M
micro-batches, b rows per micro-batch (B / M), I iterations of the schedule.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxlm.config import ConfigError
from jaxlm.sharding import Pipeline, constrain, constrain_param


def schedule(stages: int, microbatches: int, repeats: int) -> np.ndarray:
    """What each stage runs at each iteration, [I, S, 2] int32: (micro-batch, repeat), (-1, -1) in a bubble."""
    t_IS = np.arange(repeats * microbatches + stages - 1)[:, None] - np.arange(stages)[None, :]
    busy_IS = (t_IS >= 0) & (t_IS < repeats * microbatches)
    return np.stack([np.where(busy_IS, t_IS % microbatches, -1), np.where(busy_IS, t_IS // microbatches, -1)],
                    axis=-1).astype(np.int32)


def bubble_fraction(table_IS2: np.ndarray) -> float:
    """The fraction of stage-steps of a schedule that hold no micro-batch."""
    return float(np.mean(table_IS2[..., 0] < 0))


def resolve(pipe: Pipeline, batch: int, n_layers: int, pattern: int) -> tuple[int, int, int]:
    """(S, M, R) with M resolved, or a ConfigError naming the setting to change."""
    S, R = pipe.stages, pipe.repeats
    M = pipe.microbatches or S
    if batch % M:
        raise ConfigError(f"training.pipeline_microbatches={M} must divide the batch of {batch} sequences "
                          f"that each forward pass sees (training.batch_size)")
    if n_layers % (S * R) or (n_layers // (S * R)) % pattern:
        raise ConfigError(f"{S} pipeline stages x training.pipeline_repeats={R} must split model.n_layers="
                          f"{n_layers} into chunks of whole model.layer_pattern repeats ({pattern} layers)")
    if R > 1 and M < S:
        raise ConfigError(f"training.pipeline_microbatches={M} must be >= the {S} stages when "
                          f"training.pipeline_repeats={R} > 1 (a circular pipeline)")
    return S, M, R


def run(stack: Callable, x_BTD: jax.Array, layer_params: dict, layer_axes: dict, positions_BT: jax.Array,
        segment_ids_BT: jax.Array | None, layer_keys: jax.Array | None, pipe: Pipeline, pattern: int
        ) -> tuple[jax.Array, jax.Array]:
    """stack(x_bTD, chunk_params, positions_bT, segment_ids_bT, chunk_keys) -> (x_bTD, stats_C2E) run over
    the layers as a pipeline; returns what stack would over all L layers at once: x_BTD and stats [L, 2, E].
    layer_axes: the logical axes of each weight of layer_params (a tuple per leaf, "layers" first)."""
    B, T, D = x_BTD.shape
    L = jax.tree.leaves(layer_params)[0].shape[0]
    S, M, R = resolve(pipe, B, L, pattern)
    C, b = L // (S * R), B // M
    table_IS2 = jnp.asarray(schedule(S, M, R))

    def microbatches(a_B):  # micro-batch m = rows m, M + m, 2M + m, ...: each data shard keeps its own rows
        return jnp.asarray(a_B).reshape(b, M, *a_B.shape[1:]).swapaxes(0, 1)

    def chunks(a_L):  # [L, ...] -> [S, R, C, ...], chunk r * S + s at [s, r]
        return a_L.reshape(R, S, C, *a_L.shape[1:]).swapaxes(0, 1)

    def per_stage(a_M):  # a copy on every stage, sharded over `stage`: each stage reads its own copy locally
        return constrain(jnp.broadcast_to(a_M, (S, *a_M.shape)), ("stages", None, "batch", "length", "embed")[
            :a_M.ndim + 1])

    with jax.named_scope("pipeline"):
        # Every buffer the loop indexes by micro-batch has a stage dimension sharded over `stage`, and every
        # stage reads and writes only its own copy. A buffer shared by the stages and written by one of them
        # at a traced index is one the SPMD partitioner cannot split: XLA:TPU all-gathered such a buffer over
        # the batch axes, the whole global batch's activations on every device.
        io_SMbTD = per_stage(microbatches(x_BTD))
        positions_SMbT = per_stage(microbatches(positions_BT))
        segments_SMbT = None if segment_ids_BT is None else per_stage(microbatches(segment_ids_BT))
        params_SRC = jax.tree.map(chunks, layer_params)
        keys_SRC = None if layer_keys is None else chunks(layer_keys)
        first_S = jnp.arange(S) == 0

        def stage(x_bTD, p_RC, keys_RC, positions_MbT, segments_MbT, m, r):
            """One stage's work at one iteration: chunk (r, stage) on micro-batch m (clipped to 0 in a bubble,
            whose result is never used)."""
            m, r = jnp.maximum(m, 0), jnp.maximum(r, 0)
            # A select rather than a gather: its transpose keeps each repeat's gradient on its stage, where a
            # gather's scatter-add would be all-gathered over `stage`.
            p_C = jax.tree.map(lambda a: jax.lax.select_n(r, *a) if R > 1 else a[0], p_RC)
            keys_C = None if keys_RC is None else jax.vmap(jax.random.fold_in, (0, None))(keys_RC[r], m)
            seg_bT = None if segments_MbT is None else segments_MbT[m]
            return stack(x_bTD, p_C, positions_MbT[m], seg_bT, keys_C)

        # Rematerialized as a whole: the backward pass keeps only each iteration's stage inputs and reruns
        # the iteration's layers from them, one micro-batch's layers at a time (with model.remat deciding what
        # that rerun keeps for its own backward). Left to the layers' own remat, the loop would keep every
        # layer's input for every iteration, C x (R M + S - 1) micro-batch activations per stage. The
        # checkpoint wraps the stages only, not the iteration, whose carry holds all M micro-batches.
        stages = jax.checkpoint(jax.vmap(stage, spmd_axis_name="stage"),
                                policy=jax.checkpoint_policies.nothing_saveable)
        sharded = ("stages", "batch", "length", "embed")
        take = jax.vmap(lambda a_MbTD, m: a_MbTD[m])  # each stage's micro-batch m of its own copy
        put = jax.vmap(lambda a_MbTD, x_bTD, m: jax.lax.dynamic_update_index_in_dim(a_MbTD, x_bTD, m, 0))

        def iteration(carry, table_S2):
            state_SbTD, io_SMbTD, stats_SR = carry
            m_S, r_S = table_S2[:, 0], table_S2[:, 1]
            # Pinned in the loop so that the weights' gradients, summed over iterations, stay sharded as the
            # weights are (on their stage, and over FSDP and tensor axes).
            p_SRC = jax.tree.map(lambda a, axes: constrain_param(a, ("layers", None, None, *axes[1:])),
                                 params_SRC, layer_axes)
            # Stage 0 takes a new micro-batch, or in a later repeat the looped one, from its copy of the buffer.
            m_first_S = jnp.full((S,), jnp.maximum(m_S[0], 0))
            state_SbTD = jnp.where(first_S[:, None, None, None], take(io_SMbTD, m_first_S), state_SbTD)
            out_SbTD, stats_SC2E = stages(constrain(state_SbTD, sharded), p_SRC, keys_SRC, positions_SMbT,
                                          segments_SMbT, m_S, r_S)
            # Every stage's output moves one stage on, the last stage's to stage 0, which files it in its copy
            # of the buffer (the other stages' copies take the same writes and are never read).
            out_SbTD = constrain(jnp.roll(constrain(out_SbTD, sharded), 1, axis=0), sharded)
            busy_S = (m_S >= 0).astype(stats_SC2E.dtype)
            stats_SR = stats_SR + jax.nn.one_hot(r_S, R, dtype=stats_SC2E.dtype)[:, :, None, None, None] * (
                busy_S[:, None, None, None] * stats_SC2E)[:, None]
            m_last_S = jnp.full((S,), jnp.maximum(m_S[-1], 0))
            done_SbTD = jnp.where(m_S[-1] >= 0, out_SbTD, take(io_SMbTD, m_last_S))
            io_SMbTD = constrain(put(io_SMbTD, done_SbTD, m_last_S), ("stages", None, "batch", "length", "embed"))
            return (out_SbTD, io_SMbTD, stats_SR), None

        state_SbTD = constrain(jnp.zeros((S, b, T, D), x_BTD.dtype), sharded)
        stats_shape = jax.eval_shape(lambda: stages(state_SbTD, params_SRC, keys_SRC, positions_SMbT, segments_SMbT,
                                                    table_IS2[0, :, 0], table_IS2[0, :, 1])[1])
        stats_SR = jnp.zeros((S, R, *stats_shape.shape[1:]), stats_shape.dtype)
        (_, io_SMbTD, stats_SRC2E), _ = jax.lax.scan(iteration, (state_SbTD, io_SMbTD, stats_SR), table_IS2)
        # Stage 0's copy holds the outputs: one transfer over `stage` hands them to every stage.
        x_BTD = constrain(io_SMbTD[0].swapaxes(0, 1).reshape(B, T, D), ("batch", "length", "embed"))
        # Statistics are means over tokens: the mean over equal micro-batches is the whole batch's.
        stats_L2E = stats_SRC2E.swapaxes(0, 1).reshape(L, *stats_SRC2E.shape[3:]) / M
    return x_BTD, stats_L2E
