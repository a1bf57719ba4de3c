"""What a pass is: a module-level `run(module, ctx) -> int` (the number of rewrites it made) in its own
file, whose docstring states the pattern, preconditions and postconditions. `PassContext` carries
the compile options and collects counters (pass name -> rewrites), which tests use to prove a pass
fired and `compile` reports."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


class PassError(ValueError):
    """A pass whose precondition does not hold; the message names the pass, the node and the reason."""


@dataclass
class PassContext:
    target: str = "cpu"
    batch_invariant: bool = False
    options: dict = field(default_factory=dict)
    counters: Counter = field(default_factory=Counter)

    def count(self, name: str, n: int = 1):
        self.counters[name] += n
