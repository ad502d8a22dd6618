"""Engine replicas: several continuous-batching engines over the same weights on one device, each with its own
slots, KV cache and thread, behind the interface of one engine (`serve.replicas`). XLA:CPU runs a decode program's
operations one after another (about one core's worth), while calls dispatched from two threads run side by side:
on a CPU host two replicas make more tokens per second than one (docs/serve.md, "On a CPU host"). On an
accelerator one program fills the device: keep one replica there.

A new request goes to the replica with the fewest sequences (busy slots plus waiting requests), ties broken
towards the one whose cache holds more of its prompt, then the first. Each replica has serve.max_slots /
replicas slots and its share of serve.max_queue; the queue is full (429) when the chosen replica's is. The
weights are shared (one copy on device), and replicas of equal slots share their compiled programs."""

from __future__ import annotations

import math

from jaxlm.serve.engine import Engine
from jaxlm.serve.requests import Score, Sequence

COUNTERS = ("tokens_total", "requests_total", "prompt_tokens_total", "prefilled_tokens_total", "prefill_calls_total",
            "prefix_hits_total", "prefix_tokens_total", "calls_total", "preempted_total", "draft_proposed_total",
            "draft_accepted_total")


class Replicas:
    """Engines that serve as one: submit, cancel, start, stop, warm_up and the counters /metrics reads (sums
    over the replicas; time to first token of all)."""

    def __init__(self, engines: list[Engine]):
        self.engines = engines
        self.turn_hooks: list = []
        for e in engines:
            e.turn_hooks = self.turn_hooks  # one list: the app's hook runs after every replica's turns
        self.S = engines[0].S
        self.B = sum(e.B for e in engines)
        self.max_queue = sum(e.max_queue for e in engines)  # requests' sequences queue in any of them
        self.never_fits = engines[0].never_fits  # the replicas are alike

    @staticmethod
    def split(total: int, replicas: int) -> int:
        """Each replica's share of `total` (slots, queue places), rounded up."""
        return math.ceil(total / replicas)

    def _load(self, e: Engine) -> int:
        return e.busy_slots() + e.queue_depth()

    def submit(self, item: Sequence | Score) -> None:
        chosen = min(self.engines, key=lambda e: (self._load(e), -e.kv.reusable(item)))
        chosen.submit(item)  # QueueFull when its queue is full

    def cancel(self, item: Sequence | Score) -> None:
        item.cancelled = True
        for e in self.engines:  # whichever holds it frees it at its next turn
            e.wake.set()

    def warm_up(self) -> None:
        for e in self.engines:
            e.warm_up()

    def start(self) -> None:
        for e in self.engines:
            e.start()

    def stop(self) -> None:
        for e in self.engines:
            e.stop()

    @property
    def running(self) -> bool:
        return all(e.running for e in self.engines)

    @property
    def error(self) -> str | None:
        return next((e.error for e in self.engines if e.error), None)

    def busy_slots(self) -> int:
        return sum(e.busy_slots() for e in self.engines)

    def queue_depth(self) -> int:
        return sum(e.queue_depth() for e in self.engines)

    def pages_used(self) -> int:
        return sum(e.pages_used() for e in self.engines)

    def pages_total(self) -> int:
        return sum(e.pages_total() for e in self.engines)

    def tokens_per_s(self, window_s: float = 10.0) -> float:
        return sum(e.tokens_per_s(window_s) for e in self.engines)

    @property
    def ttft_s(self) -> list[float]:
        return [t for e in self.engines for t in list(e.ttft_s)]

    def __getattr__(self, name: str):
        if name in COUNTERS:
            return sum(getattr(e, name) for e in self.engines)
        raise AttributeError(name)
