"""The batches the train and eval steps take: a loader's planned rows read into global arrays on the mesh (each
process reads its own devices' shards), the train split's batch source for the loop (LoaderBatches), and the
fixed held-out batches that every evaluation, resume and `jaxlm eval` measure.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxlm import sharding
from jaxlm.train import objectives, step as step_lib
from jaxlm.train.run import Run, batch_keys
from jaxlm.config import ConfigError
from jaxlm.data import loader as loader_lib, mixture, packing, preference


def put_batch(mesh, x: np.ndarray, leading: int, act_rules=sharding.ACTIVATION_RULES) -> jax.Array:
    """A host array that every process holds in full -> a global array on the mesh."""
    return jax.device_put(x, sharding.batch_sharding(mesh, x.ndim, leading, act_rules))


def device_batch(run: Run, split: str, plan) -> dict[str, jax.Array]:
    """The batch a loader planned (loader.Windows, packing.Packed or mixture.MixedPlan; [A, B] or [B] rows) as
    global arrays on the mesh. Every process reads from the shards only the rows (and, for random windows with sequence
    parallelism, the columns) of its own devices."""
    lead = plan.shape
    sh = sharding.batch_sharding(run.mesh, len(lead) + 1, len(lead) - 1, run.act_rules)
    data, T, keys = run.dataset.splits[split], run.cfg.model.block_size, batch_keys(run.cfg)
    extra = {}
    if "ref_logps" in keys:
        if run.reference is None:
            raise ConfigError(f"training.objective={run.cfg.training.objective} reads the reference model's "
                              "log-probabilities, which have not been computed for this run (reference.ensure)")
        extra["reference"] = run.reference[split]
    read: dict = {}

    def make(key: str) -> jax.Array:
        def shard(index) -> np.ndarray:
            at = (tuple((s.start, s.stop) for s in index[:-1]), index[-1].start, index[-1].stop)
            if at not in read:  # one read per device shard serves all the batch's arrays
                read[at] = plan.read(data, index[:-1], index[-1], keys, T, **extra)
            return read[at][key]

        return jax.make_array_from_callback(lead + (T,), sh, shard)

    return {k: make(k) for k in keys}


class LoaderBatches:
    """The train split's batches, planned by the run's loader and placed on the mesh: what the loop steps
    through; their position (state, restore) goes into checkpoints, and `evaluate` measures the held-out
    batches. An objective that makes its batches itself (reinforcement learning's rollouts from the state's
    weights, rl.RolloutBatches) is a source of the same shape."""

    def __init__(self, run: Run, frozen: dict | None = None):
        self.run, self.frozen, self.loader = run, frozen, make_loader(run)
        self._eval = None

    def next(self, state: dict) -> dict[str, jax.Array]:
        return device_batch(self.run, "train", self.loader.next())

    def state(self) -> dict:
        return self.loader.state()

    def restore(self, position: dict) -> None:
        self.loader.restore(position)

    def boundary(self, step: int) -> bool:
        """Whether the run may stop or save after `step` steps: after any."""
        return True

    def metrics(self) -> dict:
        """The host's figures of the last batch (none for data from a loader)."""
        return {}

    def evaluate(self, state: dict) -> dict:
        """train_loss and val_loss over the fixed held-out batches (and the objective's metrics, val_<name>)."""
        if self._eval is None:
            self._eval = step_lib.make_eval_step(self.run.cfg, self.run.mesh, self.run.act_rules), eval_plans(self.run)
        losses = evaluate(self._eval[0], state["params"], self.run, self._eval[1], self.frozen)
        return {"train_loss": losses.pop("train"), "val_loss": losses.pop("val"), **losses}


def train_batches(run: Run, frozen: dict | None = None) -> LoaderBatches:
    return LoaderBatches(run, frozen)


def make_loader(run: Run, split: str = "train", grad_accum: int | None = None, seed: int | None = None):
    """The loader of a split: random windows, packed rows, or a mixture of either over several datasets; whole
    preference pairs for dpo, ipo and orpo (padded or packed, data.packing)."""
    cfg, t = run.cfg, run.cfg.training
    A = t.grad_accum if grad_accum is None else grad_accum
    seed = cfg.seed if seed is None else seed
    mask = cfg.data.loss_mask == "on"

    def one(data):
        if cfg.training.objective in objectives.PREFERENCE:
            return preference.PairLoader(data, cfg.model.block_size, t.batch_size, A, seed, cfg.data.packing)
        if cfg.data.packing:
            return packing.PackedLoader(data, cfg.model.block_size, t.batch_size, A, seed, mask)
        return loader_lib.Loader(data, cfg.model.block_size, t.batch_size, A, seed)

    data = run.dataset.splits[split]
    if isinstance(data, mixture.MixedSplit):
        return mixture.MixtureLoader([one(s) for s in data.sources], run.dataset.weights,
                                     [str(ds.dir) for ds in run.dataset.datasets], seed, cfg.data.packing, mask)
    return one(data)


def eval_plans(run: Run) -> dict[str, list]:
    """Each split's held-out batches [B]: the same at every evaluation, resume and `jaxlm eval` (seed + 2)."""
    t = run.cfg.training
    out = {}
    for split in ("train", "val"):
        loader = make_loader(run, split, grad_accum=1, seed=run.cfg.seed + 2)
        out[split] = [loader.next().only_micro_batch() for _ in range(t.eval_batches)]
    return out


def evaluate(eval_step, params, run: Run, plans: dict, frozen: dict | None = None) -> dict:
    """Each split's loss over its held-out batches (eval_plans): the mean over all their units; with the
    objective's metrics averaged alike, as {split}_{name}."""
    out = {}
    for split, batches in plans.items():
        results = jax.device_get([eval_step(params, device_batch(run, split, plan), frozen) for plan in batches])
        counts = np.array([r[2] for r in results], np.float64)
        total = max(np.sum(counts), 1e-9)
        out[split] = float(np.sum(np.array([r[0] for r in results], np.float64) * counts) / total)
        for name in results[0][1]:
            out[f"{split}_{name}"] = float(np.sum(np.array([r[1][name] for r in results], np.float64) * counts) / total)
    return out
