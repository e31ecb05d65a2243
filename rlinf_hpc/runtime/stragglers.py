"""Stragglers: a rank consistently slower than its peers in the same pipeline stage.

After each pipeline step, every stage with two or more ranks gives each rank a *relative
score*: its seconds per item divided by the median of its peers' (the stage's other ranks, so
that a pair is judged too). Per item, because load-balanced channels send fewer items to a slow
rank, so its total busy time can look normal.
A rank whose score is above ``ratio`` in at least 80% of the last ``window`` steps is a
straggler — named once (component, rank, score) in the log and in ``events.jsonl`` — and named
again only after it recovered. Like NVIDIA's straggler detector, it compares ranks doing the same
work, not against a fixed speed.

>>> detector = StragglerDetector(window=3, ratio=1.5)
>>> for step in range(3):
...     reports = detector.observe(step, {("actor", 1): 0.1, ("actor", 2): 0.1, ("actor", 3): 0.35})
>>> [(r.component, r.rank, round(r.score, 2)) for r in reports]
[('actor', 3, 3.5)]
"""

from __future__ import annotations

import statistics
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlinf_hpc.log import get_logger

log = get_logger("stragglers")


@dataclass(frozen=True)
class Straggler:
    component: str
    rank: int
    score: float  # median relative score over the window
    steps: int


class StragglerDetector:
    """``observe(step, {(component, rank): seconds per item})`` -> newly found stragglers."""

    def __init__(self, window: int, ratio: float, share: float = 0.8) -> None:
        self.window = window
        self.ratio = ratio
        self.share = share
        self._scores: dict[tuple[str, int], deque[float]] = {}
        self._named: set[tuple[str, int]] = set()

    def observe(self, step: int, per_item_s: dict[tuple[str, int], float]) -> list[Straggler]:
        by_stage: dict[str, dict[int, float]] = defaultdict(dict)
        for (component, rank), seconds in per_item_s.items():
            by_stage[component][rank] = seconds
        found = []
        for component, ranks in by_stage.items():
            if len(ranks) < 2:
                continue
            for rank, seconds in ranks.items():
                peers = statistics.median(t for r, t in ranks.items() if r != rank)
                if peers <= 0:
                    continue
                key = (component, rank)
                scores = self._scores.setdefault(key, deque(maxlen=self.window))
                scores.append(seconds / peers)
                slow = sum(score > self.ratio for score in scores)
                if len(scores) == self.window and slow >= self.share * self.window:
                    if key not in self._named:
                        self._named.add(key)
                        found.append(Straggler(component, rank, statistics.median(scores), len(scores)))
                elif slow == 0:
                    self._named.discard(key)  # recovered: may be named again later
        return found


def per_item_seconds(result: Any) -> dict[tuple[str, int], float]:
    """Seconds per item of every (component, rank) of a `StepResult`."""
    out = {}
    for stage, replies in zip(result.stages, result.per_rank, strict=True):
        for reply in replies:
            if reply.get("items"):
                out[(stage["component"], reply["rank"])] = reply["busy_s"] / reply["items"]
    return out


def make_straggler_hook(
    detector: StragglerDetector, record: Callable[..., None]
) -> Callable[[str, Any], None]:
    """The coordinator's after-step hook."""

    def after_step(pipeline: str, result: Any) -> None:
        seconds = per_item_seconds(result)
        log.debug("pipeline %s step %d: seconds per item %s", pipeline, result.step, seconds)
        for straggler in detector.observe(result.step, seconds):
            log.warning(
                "straggler: rank %d of '%s' takes %.1fx its peers' median time per item over the "
                "last %d steps of pipeline '%s' (a slow or shared device, a busy node?)",
                straggler.rank, straggler.component, straggler.score, straggler.steps, pipeline,
            )  # fmt: skip
            record("straggler", pipeline=pipeline, step=result.step, component=straggler.component,
                   straggler_rank=straggler.rank, score=round(straggler.score, 3))  # fmt: skip

    return after_step
