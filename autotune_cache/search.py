"""The search space of one (kernel template, shape key, target): enumeration, legality, pruning.

A candidate config is the template's declared heuristic with the tunables overridden:

    config = {**template.heuristic(key, target), **{t.name: v for t, v in zip(tunables, combo)}}

so derived values the heuristic fills in (e.g. BLOCK_D = next_pow2(D)) stay consistent. The space is
the product of the tunables' literal value lists, then

1. legality: `template.constraints(config, key, target)` must return no problem (shared memory,
   registers, divisibility). A constraint that raises counts as illegal with its exception text;
2. tile-padding dominance (the generic cheap cost model): a tunable named `BLOCK_X` whose key has a
   dim `X` (same name, any case) is redundant above `max(next_pow2(X), smallest legal value)`: a
   bigger tile runs the same single program over the axis with more masked lanes, so it is never
   faster. Such configs are dropped;
3. the template's own estimate, when it declares `cost(config, key, target)` (lower is faster): the
   `keep_fraction` cheapest configs are kept (at least `keep_min`).

The heuristic config is always kept, first, even when a rule above would drop it: it is the baseline
every tuned config is compared against (and what the runtime uses without a record).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass, field

from codegen.kernel import KernelTemplate, pow2_bucket

MAX_ENUMERATE = 250_000  # larger products are sampled, not enumerated (none of today's templates is)


def canonical_config(config: dict) -> tuple:
    return tuple(sorted(config.items()))


@dataclass
class SearchSpace:
    template: KernelTemplate
    key: dict
    target: str
    base: dict  # the declared heuristic config
    candidates: list[dict]  # legal and kept, the heuristic first
    product: int  # size of the full product of tunable values
    illegal: Counter = field(default_factory=Counter)  # problem text -> configs dropped
    dominated: int = 0  # dropped by the tile-padding rule
    cost_pruned: int = 0  # dropped by the template's cost estimate
    base_problems: list = field(default_factory=list)  # constraints the heuristic itself violates

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.template.tunables]

    def values(self, name: str) -> list:
        """The values of a tunable that occur in at least one kept candidate, in declared order (then a
        heuristic value outside the declared list, so the baseline can be enqueued as a trial)."""
        declared = next(t.values for t in self.template.tunables if t.name == name)
        seen = [c.get(name) for c in self.candidates]
        return [v for v in declared if v in seen] + list(dict.fromkeys(v for v in seen if v not in declared))

    def nearest(self, sampled: dict) -> dict:
        """The kept candidate closest to a sampled assignment of tunables: fewest differing tunables,
        then the smallest total distance in the declared value order."""
        if self.contains(sampled):  # a tunable the heuristic leaves to the launcher's default stays unset
            return {**self.base, **{n: v for n, v in sampled.items() if v is not None or n in self.base}}
        order = {t.name: {v: i for i, v in enumerate(t.values)} for t in self.template.tunables}

        def distance(c):
            diff = [n for n in self.names if c.get(n) != sampled.get(n)]
            return len(diff), sum(abs(order[n].get(c.get(n), 0) - order[n].get(sampled.get(n), 0)) for n in diff)

        return dict(min(self.candidates, key=distance))

    def contains(self, config: dict) -> bool:
        if not hasattr(self, "_index"):
            self._index = {canonical_config({n: c.get(n) for n in self.names}) for c in self.candidates}
        return canonical_config({n: config.get(n) for n in self.names}) in self._index

    def summary(self) -> str:
        ill = sum(self.illegal.values())
        return (f"{self.product} configs: {ill} illegal, {self.dominated} dominated by tile padding, "
                f"{self.cost_pruned} pruned by the cost estimate, {len(self.candidates)} kept")


def legality_problems(template: KernelTemplate, config: dict, key: dict, target: str) -> list[str]:
    try:
        return list(template.constraints(config, key, target))
    except Exception as e:  # a constraint that cannot evaluate this config: the config is not legal
        return [f"constraints() raised {type(e).__name__}: {e}"]


def _block_dims(template: KernelTemplate, key: dict) -> dict[str, int]:
    """Tunable name -> the key dim it tiles, for tunables spelled BLOCK_<dim>."""
    lower = {k.lower(): k for k in key}
    out = {}
    for t in template.tunables:
        if t.name.startswith("BLOCK_"):
            dim = lower.get(t.name[len("BLOCK_"):].lower())
            v = key.get(dim) if dim else None
            if isinstance(v, int) and not isinstance(v, bool) and v > 0 and all(isinstance(x, int) for x in t.values):
                out[t.name] = v
    return out


def dominated(config: dict, block_dims: dict, smallest_legal: dict) -> bool:
    for name, dim in block_dims.items():
        if config[name] > max(pow2_bucket(dim), smallest_legal.get(name, 0)):
            return True
    return False


def build_space(template: KernelTemplate, key: dict, target: str, *, keep_fraction: float = 0.5,
                keep_min: int = 16) -> SearchSpace:
    """Enumerate, check and prune the space of `template` at shape `key` on `target`."""
    base = dict(template.heuristic(key, target))
    names = [t.name for t in template.tunables]
    product = template.space_size() if template.tunables else 1
    if product > MAX_ENUMERATE:
        raise ValueError(f"{template.family}: {product} configs exceed the enumeration limit {MAX_ENUMERATE}; "
                         "split a tunable or declare fewer values")
    space = SearchSpace(template, dict(key), target, base, [], product)
    space.base_problems = legality_problems(template, base, key, target)
    legal = []
    for combo in itertools.product(*(t.values for t in template.tunables)):
        cfg = {**base, **dict(zip(names, combo))}
        problems = legality_problems(template, cfg, key, target)
        if problems:
            for p in problems:
                space.illegal[p] += 1
            continue
        legal.append(cfg)
    blocks = _block_dims(template, key)
    smallest = {n: min((c[n] for c in legal if c[n] >= pow2_bucket(d)), default=0) for n, d in blocks.items()}
    kept = [c for c in legal if not dominated(c, blocks, smallest)]
    space.dominated = len(legal) - len(kept)
    if template.cost is not None and kept:
        scored = sorted(kept, key=lambda c: _safe_cost(template, c, key, target))
        n = min(len(scored), max(keep_min, math.ceil(keep_fraction * len(scored))))
        space.cost_pruned = len(scored) - n
        kept = scored[:n]
    base_c = canonical_config({n: base.get(n) for n in names})
    space.candidates = [base] + [c for c in kept if canonical_config({n: c[n] for n in names}) != base_c]
    return space


def _safe_cost(template, config, key, target) -> float:
    try:
        return float(template.cost(config, key, target))
    except Exception:
        return math.inf  # an estimate that fails ranks last; it does not make the config illegal
