"""`select_kernels`: map every node of every entry function to a kernel template or to the reference
fallback, for one target. Fallbacks are listed with their reason so nothing is silently slow.

Selection is per node at compile time (which template can run this op with these dtypes on this
target); the config is chosen per shape bucket at run time (tuning record if present, else the
template's declared heuristic), see `k31c/runtime/executor.py`.

Order of the candidates: the first template (in `BACKEND_ORDER[target]`, then registry order) whose
`supports` accepts the node wins. On `cpu` the TVM templates are asked first: they run compiled llvm
code, while Triton runs in its interpreter there. A TVM template accepts a cpu node only where the CPU
bench measured it faster than the torch reference (`codegen/tvm/_build.cpu_rule`, data in
benches/results/cpu-2026-11-29/tvm.json); otherwise its reason is listed and the next template runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from ir.core import Module, Node
from ir.ops import OPS

from .kernel import KernelTemplate
from .registry import templates_for

# Ops that move no data worth a kernel: views and dtype relabels run as torch ops everywhere.
VIEW_OPS = frozenset({"reshape", "slice", "cast"})
# Backends asked first per target (others keep registry order after them).
BACKEND_ORDER = {"cpu": ("tvm",)}


@dataclass
class Choice:
    function: str
    index: int  # node index in the function
    op: str
    results: str  # the node's result names, for humans
    template: KernelTemplate | None
    reason: str = ""  # why the reference runs (fallback) or why a view

    @property
    def kernel(self) -> str:
        return self.template.family if self.template else ("view" if self.op in VIEW_OPS else "reference")


def select_kernels(module: Module, target: str, backends: tuple[str, ...] = ("triton", "tvm")) -> list[Choice]:
    out: list[Choice] = []
    for fname, fn in module.functions.items():
        for i, node in enumerate(fn.nodes):
            out.append(_choose(fname, i, node, target, backends))
    return out


def _choose(fname: str, i: int, node: Node, target: str, backends) -> Choice:
    results = ", ".join(o.ref for o in node.outputs)
    if node.op in VIEW_OPS:
        return Choice(fname, i, node.op, results, None, "view")
    reasons = []
    first = BACKEND_ORDER.get(target, ())
    for t in sorted(templates_for(node.op), key=lambda t: first.index(t.backend) if t.backend in first else len(first)):
        if t.backend not in backends:
            reasons.append(f"{t.family}: backend {t.backend} not enabled")
            continue
        op = OPS.get(node.op)
        types = [v.type for v in node.inputs]
        bound = op.bind(types) if op is not None else _bind_fused(node, types)
        try:
            why = t.supports(bound, node.attrs, target)
        except Exception as e:  # a template bug: listed as a fallback reason (and caught by tests), not a crash
            why = f"supports() raised {type(e).__name__}: {e}"
        if why is None:
            return Choice(fname, i, node.op, results, t)
        reasons.append(f"{t.family}: {why}")
    if not reasons:
        reasons.append(f"no kernel template implements {node.op}")
    return Choice(fname, i, node.op, results, None, "; ".join(reasons))


def _bind_fused(node: Node, types: list):
    """Fused ops are not registered: their templates get the operand types as a list `a.operands`."""
    from types import SimpleNamespace

    return SimpleNamespace(operands=types)


def fallback_table(choices: list[Choice]) -> str:
    rows = {}
    for c in choices:
        if c.template is None and c.op not in VIEW_OPS:
            rows.setdefault((c.op, c.reason), []).append(f"{c.function}:{c.index}")
    lines = [f"{len(v):>4} x {op:<24} reference  ({why})" for (op, why), v in sorted(rows.items())]
    return "\n".join(lines) if lines else "none: every op has a kernel"
