"""The kernel-template contract every backend family implements (Triton, TVM, torch fallback).

A template implements one or more IR ops (plain or fused) as a drop-in replacement of the op's
reference: `launch(a, attrs, config)` takes the same bound operands (`a.x`, `a.w`, …, torch tensors
on the device) and attributes as `OpDef.reference` and returns the same results. Everything the tuner
and the compiler need is declared as data next to the kernel:

- `tunables`: the search space as literal lists (`Tunable("BLOCK_N", (32, 64, 128))`);
- `key_dims(a, attrs) -> dict`: the concrete shape dims that key a tuning record;
- `bucket(key) -> dict`: dynamic dims bucketed (powers of two, context buckets) so caches stay finite;
- `heuristic(key, target) -> config`: the declared default config;
- `constraints(config, key, target) -> [problem]`: legality (shared memory, divisibility, ...);
- `supports(a, attrs, target) -> None | reason`: whether this template can run this node at all;
  called at compile time with `a` bound to the operands' `TensorType`s (dtype + symbolic shape, no
  data) and `target` a target name ("cpu", "h200", ...);
- `cost(config, key, target) -> float` (optional): a cheap relative estimate of a config's run time
  (lower is better, any unit) that the tuner uses to prune the space before measuring
  (`autotune_cache/search.py`); None means the tuner's generic tile-padding model.

Fused ops (created by passes, e.g. `fused.kda_decode`) have no registered OpDef: their templates
receive `a = SimpleNamespace(operands=[...])`, the node's operands in the order the creating pass
documents, and the node's attrs; they return the node's results in order.

At run time `launch` receives `attrs` extended with `batch_invariant: bool` when the artifact was
compiled with `--batch-invariant` (then the config must not depend on the batch size, and no
reduction may be split by it).

`kernel_name(config, key)` spells every specialisation (FlashInfer style), e.g.
`kda_decode_H32_D128_BV64_w4`.
"""

from __future__ import annotations

import inspect
import sys
import math
from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class Tunable:
    name: str
    values: tuple

    def __post_init__(self):
        if not self.values:
            raise ValueError(f"tunable {self.name} has no values")


def pow2_bucket(n: int, lo: int = 1) -> int:
    """Smallest power of two >= n (and >= lo)."""
    return max(lo, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


@dataclass
class KernelTemplate:
    family: str
    backend: str  # "triton" | "tvm" | "torch"
    ops: tuple[str, ...]
    launch: Callable  # (a, attrs, config) -> result | tuple
    key_dims: Callable  # (a, attrs) -> dict[str, int]
    heuristic: Callable  # (key, target) -> dict
    tunables: tuple[Tunable, ...] = ()
    bucket: Callable = field(default=lambda key: dict(key))
    constraints: Callable = field(default=lambda config, key, target: [])
    supports: Callable = field(default=lambda a, attrs, target: None)
    batch_invariant: bool = False  # True when no config splits a reduction by batch size
    cost: Callable | None = None  # (config, key, target) -> relative estimate, lower is faster (pruning only)
    doc: str = ""

    def kernel_name(self, config: dict, key: dict) -> str:
        parts = [self.family] + [f"{k}{v}" for k, v in sorted(key.items())] + [f"{k}{v}" for k, v in sorted(config.items())]
        return "_".join(str(p) for p in parts)

    def source(self) -> str:
        """Source text of the module defining the template and of every project module its code reaches
        (`codegen.triton.*` / `codegen.tvm.*` helpers such as `_paging` or `_moe_tiles`), hashed into tuning-record keys: a change in
        any code the kernel runs stales its records."""
        return "\n".join(inspect.getsource(m) for m in code_modules(inspect.getmodule(self.launch)))

    def space_size(self) -> int:
        return math.prod(len(t.values) for t in self.tunables)


def code_modules(module, prefix: tuple = ("codegen.triton.", "codegen.tvm.")) -> list:
    """`module` first, then the kernel-backend modules (under `prefix`) it references (directly or through another such
    module: imported modules, functions, classes and Triton JIT functions), sorted by name."""
    seen, stack = {module.__name__: module}, [module]
    while stack:
        for value in vars(stack.pop()).values():
            owner = getattr(value, "fn", value)  # a Triton JIT / interpreted function wraps the Python one
            dep = value if inspect.ismodule(value) else sys.modules.get(getattr(owner, "__module__", None) or "")
            if dep is not None and dep.__name__.startswith(prefix) and dep.__name__ not in seen \
                    and getattr(dep, "__file__", None):
                seen[dep.__name__] = dep
                stack.append(dep)
    return [module] + sorted((m for n, m in seen.items() if n != module.__name__), key=lambda m: m.__name__)
