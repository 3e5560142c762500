"""Runs of like decoder layers, so that a step's program holds one copy of each kind of layer, not one per layer.

A run is `count` repeats of a period of `period` consecutive layers (period 1: identical layers, such as DeepSeek's
dense-first layers and then its MoE layers; period 2: GPT-OSS's sliding/full alternation). Its weights are stacked
per position in the period ([count, ...] each), and a step runs it as one `lax.scan` over the repeats. Layers are
alike when they have the same kind: MoE or dense MLP, full or sliding attention."""
from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence

from moejax.config import ModelConfig

MAX_PERIOD = 2  # longer periods buy nothing for the families moejax serves and make short runs likelier


@dataclasses.dataclass(frozen=True)
class LayerRun:
    first: int
    period: int
    count: int

    @property
    def layers(self) -> range:
        return range(self.first, self.first + self.period * self.count)

    def layer(self, repeat: int, member: int) -> int:
        return self.first + repeat * self.period + member

    def where(self, layer: int) -> tuple[int, int]:
        """-> (repeat, member) of `layer` in this run."""
        return divmod(layer - self.first, self.period)


def layer_kinds(cfg: ModelConfig) -> list[Hashable]:
    """Each layer's kind."""
    return [(cfg.is_moe(i), cfg.layer_types[i] if cfg.layer_types else "full") for i in range(cfg.num_layers)]


def layer_runs(kinds: Sequence[Hashable]) -> list[LayerRun]:
    """Cover the layers, in order, by runs: at each layer the period (1..MAX_PERIOD) that repeats furthest, the
    shortest on a tie; a period that does not repeat at all is single layers."""
    runs, i, n = [], 0, len(kinds)
    while i < n:
        best = LayerRun(i, 1, 1)
        for period in range(1, MAX_PERIOD + 1):
            if i + period > n:
                break
            count = 1
            while i + (count + 1) * period <= n and \
                    kinds[i + count * period: i + (count + 1) * period] == kinds[i: i + period]:
                count += 1
            if count > 1 and count * period > best.count * best.period:
                best = LayerRun(i, period, count)
        runs.append(best)
        i += best.period * best.count
    return runs
