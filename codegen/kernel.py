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

import ast
import functools
import inspect
import io
import math
import sys
import tokenize
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
        (`codegen.triton.*` / `codegen.tvm.*` helpers such as `_paging` or `_moe_tiles`): what an artifact
        copies into kernels/<family>.py."""
        return "\n".join(inspect.getsource(m) for m in code_modules(inspect.getmodule(self.launch)))

    def code(self) -> str:
        """`source()` with docstrings, comments and blank lines removed (`code_only`, module by module): what
        tuning-record keys hash, so a change in any code the kernel runs stales its records and a documentation
        edit does not."""
        return "\n".join(code_only(inspect.getsource(m)) for m in code_modules(inspect.getmodule(self.launch)))

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


@functools.lru_cache(maxsize=512)
def code_only(source: str) -> str:
    """Python source without its docstrings (module, class and function), comments, trailing blanks and
    empty lines. Positions come from `ast` (docstring spans) and `tokenize` (comments), whose coordinates
    are the same on every Python 3.11+, so the result (and a hash of it) does not depend on the
    interpreter, unlike `ast.dump` or `ast.unparse`. Memoised by source text: every tuning-record lookup
    hashes its template's modules (`_pdl.py` is reached by all of them), and tokenizing them again was 14%
    of a CPU prefill of the tiny artifact."""
    lines = source.splitlines()
    cut: dict[int, list[tuple[int, int]]] = {}   # 0-based row -> [(start char, end char)] to blank

    def blank(r0, c0, r1, c1):   # rows 1-based, columns in characters, end exclusive
        for r in range(r0, r1 + 1):
            cut.setdefault(r - 1, []).append((c0 if r == r0 else 0, c1 if r == r1 else len(lines[r - 1])))

    def chars(row, byte_col):   # ast columns are UTF-8 byte offsets
        return len(lines[row - 1].encode()[:byte_col].decode(errors="ignore"))

    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body \
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            d = body[0]
            blank(d.lineno, chars(d.lineno, d.col_offset), d.end_lineno, chars(d.end_lineno, d.end_col_offset))
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            blank(tok.start[0], tok.start[1], tok.end[0], tok.end[1])
    out = []
    for i, line in enumerate(lines):
        for c0, c1 in sorted(cut.get(i, ()), reverse=True):
            line = line[:c0] + line[c1:]
        if line.strip():
            out.append(line.rstrip())
    return "\n".join(out)
