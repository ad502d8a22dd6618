"""The batches the train and eval steps take: a loader's planned rows read into global arrays on the mesh (each
process reads its own devices' shards), the train split's batch source for the loop (LoaderBatches), and the
fixed held-out batches that every evaluation, resume and `jaxlm eval` measure.
"""

from __future__ import annotations

import collections
import concurrent.futures

import jax
import numpy as np

from jaxlm import sharding
from jaxlm.train import objectives, step as step_lib
from jaxlm.train.run import Run, batch_keys
from jaxlm.config import ConfigError
from jaxlm.data import loader as loader_lib, mixture, packing, preference, vision_data


def put_batch(mesh, x: np.ndarray, leading: int, act_rules=sharding.ACTIVATION_RULES) -> jax.Array:
    """A host array that every process holds in full -> a global array on the mesh."""
    return jax.device_put(x, sharding.batch_sharding(mesh, x.ndim, leading, act_rules))


def device_batch(run: Run, split: str, plan, read: dict | None = None) -> dict[str, jax.Array]:
    """The batch a loader planned (loader.Windows, packing.Packed or mixture.MixedPlan; [A, B] or [B] rows) as
    global arrays on the mesh. Every process reads from the shards only the rows (and, for random windows with sequence
    parallelism, the columns) of its own devices; `read` holds those already read (host_batch), if any."""
    lead = plan.shape
    sh = sharding.batch_sharding(run.mesh, len(lead) + 1, len(lead) - 1, run.act_rules)
    T, keys = run.cfg.model.block_size, batch_keys(run.cfg)
    read = {} if read is None else read
    reader = _reader(run, split, plan)

    def make(key: str) -> jax.Array:
        def shard(index) -> np.ndarray:
            at = _at(index)
            if at not in read:  # one read per device shard serves all the batch's arrays
                read[at] = reader(index)
            return read[at][key]

        return jax.make_array_from_callback(lead + (T,), sh, shard)

    out = {k: make(k) for k in keys}
    if isinstance(plan, vision_data.ImageSlots):
        out["images"] = image_batch(run, plan)
    return out


def image_batch(run: Run, plan: vision_data.ImageSlots):
    """The images of a batch's rows [A, B * K, *image] (or [B * K, ...]; image: [S, S, 3]; Qwen-VL's a dict of padded
    patches [P, Q] and grids [2]) on the mesh, each micro-batch's in the order of its image tokens (then empty
    slots), split over the devices that split the batch."""
    structs = step_lib.image_structs(run, plan.slots.shape, plan.store.fixed.shape)
    if isinstance(structs, dict):
        return {k: jax.make_array_from_callback(s.shape, s.sharding, lambda index, k=k: plan.images(index, k))
                for k, s in structs.items()}
    return jax.make_array_from_callback(structs.shape, structs.sharding, plan.images)


def host_batch(run: Run, split: str, plan, pool: concurrent.futures.Executor) -> dict:
    """What device_batch reads from the shards for this process's devices, read now (on the read-ahead thread),
    each device's rows on a thread of `pool`: on object storage each read waits on the network."""
    lead, T = plan.shape, run.cfg.model.block_size
    sh = sharding.batch_sharding(run.mesh, len(lead) + 1, len(lead) - 1, run.act_rules)
    reader = _reader(run, split, plan)
    indices = {_at(index): index for index in sh.addressable_devices_indices_map(lead + (T,)).values()}
    reads = {at: pool.submit(reader, index) for at, index in indices.items()}
    return {at: read.result() for at, read in reads.items()}


def _at(index: tuple) -> tuple:
    """A device shard's rows and columns as a hashable key."""
    return tuple((s.start, s.stop) for s in index[:-1]), index[-1].start, index[-1].stop


def _reader(run: Run, split: str, plan):
    """index -> the batch arrays of the rows and columns a device shard's `index` selects."""
    data, T, keys = run.dataset.splits[split], run.cfg.model.block_size, batch_keys(run.cfg)
    extra = {}
    if "ref_logps" in keys:
        if run.reference is None:
            raise ConfigError(f"training.objective={run.cfg.training.objective} reads the reference model's "
                              "log-probabilities, which have not been computed for this run (reference.ensure)")
        extra["reference"] = run.reference[split]
    return lambda index: plan.read(data, index[:-1], index[-1], keys, T, **extra)


class LoaderBatches:
    """The train split's batches, planned by the run's loader and placed on the mesh: what the loop steps
    through; their position (state, restore) goes into checkpoints, and `evaluate` measures the held-out
    batches. Data at a URL is read ahead (ReadAhead). An objective that makes its batches itself (reinforcement
    learning's rollouts from the state's weights, rl.RolloutBatches) is a source of the same shape."""

    def __init__(self, run: Run, frozen: dict | None = None):
        self.run, self.frozen, self.loader = run, frozen, make_loader(run)
        self._eval = None
        depth = run.cfg.data.read_ahead
        self.ahead = ReadAhead(run, self.loader, depth) if streamed(run) and depth else None

    def next(self, state: dict) -> dict[str, jax.Array]:
        if self.ahead is not None:
            return self.ahead.next()
        return device_batch(self.run, "train", self.loader.next())

    def state(self) -> dict:
        return self.loader.state() if self.ahead is None else self.ahead.state()

    def restore(self, position: dict) -> None:
        if self.ahead is not None:
            self.ahead.clear()
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


class ReadAhead:
    """The next `depth` batches of a loader planned early and read on background threads while the steps run
    (data at a URL: each read waits on the network). The data order is the loader's, and the position it gives
    for a checkpoint is the loader's after the batch last handed out, not after the plans drawn ahead of it."""

    def __init__(self, run: Run, loader, depth: int):
        self.run, self.loader, self.depth = run, loader, depth
        # The batches ahead are read at once: a read mostly waits on the network, not on this host.
        self.pool = concurrent.futures.ThreadPoolExecutor(depth, thread_name_prefix="jaxlm-read-ahead")
        self.devices = device_pool(run, depth)
        self.queue: collections.deque = collections.deque()  # (plan, its rows being read, the position after it)
        self.position: dict | None = None  # after the last batch handed out; None: the loader's own

    def next(self) -> dict[str, jax.Array]:
        while len(self.queue) <= self.depth:
            plan = self.loader.next()
            read = self.pool.submit(host_batch, self.run, "train", plan, self.devices)
            self.queue.append((plan, read, self.loader.state()))
        plan, read, self.position = self.queue.popleft()
        return device_batch(self.run, "train", plan, read.result())

    def state(self) -> dict:
        return self.loader.state() if self.position is None else self.position

    def clear(self) -> None:
        """Drop the batches read ahead (before the loader's position is restored)."""
        for _, read, _ in self.queue:
            read.cancel()
        concurrent.futures.wait([read for _, read, _ in self.queue])
        self.queue.clear()
        self.position = None


def streamed(run: Run) -> bool:
    """Whether the run reads a dataset (or a mixture's) from object storage, where every read waits on the network."""
    return any(getattr(ds, "streamed", False) for ds in getattr(run.dataset, "datasets", [run.dataset]))


def device_pool(run: Run, batches: int = 1) -> concurrent.futures.ThreadPoolExecutor:
    """Threads that read the rows of this process's devices for `batches` streamed batches at once (host_batch)."""
    threads = min(64, len(run.mesh.local_devices) * batches)
    return concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="jaxlm-rows")


def train_batches(run: Run, frozen: dict | None = None) -> LoaderBatches:
    return LoaderBatches(run, frozen)


def make_loader(run: Run, split: str = "train", grad_accum: int | None = None, seed: int | None = None):
    """The loader of a split: random windows, packed rows, or a mixture of either over several datasets; whole
    preference pairs for dpo, ipo and orpo (padded or packed, data.packing); data with images (image_loader)."""
    cfg, t = run.cfg, run.cfg.training
    A = t.grad_accum if grad_accum is None else grad_accum
    seed = cfg.seed if seed is None else seed
    mask = cfg.data.loss_mask == "on"

    def one(data):
        if run.images is not None:
            return image_loader(run, data, run.images[split], A, seed)
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


def image_loader(run: Run, data, store: vision_data.SplitImages, A: int, seed: int):
    """The loader of a split with images (data/vision_data.py): preference pairs (padded or packed), conversations
    packed (data.packing), or one conversation a row; every row within run.image_slots images."""
    cfg, B, T, K = run.cfg, run.cfg.training.batch_size, run.cfg.model.block_size, run.image_slots
    if cfg.training.objective in objectives.PREFERENCE:
        pairs = preference.PairLoader(data, T, B, A, seed, cfg.data.packing, vision_data.pair_images(store), K)
        return vision_data.WithImages(pairs, data, store, K)
    if cfg.data.packing:
        return vision_data.WithImages(vision_data.PackedConversations(data, store, T, B, A, seed, K), data, store, K)
    return vision_data.RowLoader(data, store, T, B, A, seed, K)


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
    objective's metrics averaged alike, as {split}_{name}. Streamed data is read with each batch's device
    shards at once."""
    pool = device_pool(run) if streamed(run) else None

    def batch(split: str, plan) -> dict[str, jax.Array]:
        return device_batch(run, split, plan, None if pool is None else host_batch(run, split, plan, pool))

    out = {}
    for split, batches in plans.items():
        results = jax.device_get([eval_step(params, batch(split, plan), frozen) for plan in batches])
        counts = np.array([r[2] for r in results], np.float64)
        total = max(np.sum(counts), 1e-9)
        out[split] = float(np.sum(np.array([r[0] for r in results], np.float64) * counts) / total)
        for name in results[0][1]:
            out[f"{split}_{name}"] = float(np.sum(np.array([r[1][name] for r in results], np.float64) * counts) / total)
    if pool is not None:
        pool.shutdown()
    return out
