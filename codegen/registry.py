"""Which kernel templates exist. Every module of `codegen/triton/` and `codegen/tvm/` that defines
`TEMPLATES: list[KernelTemplate]` is a kernel family (one family per file). `templates_for(op)` lists
the templates implementing an IR op; `codegen/select.py` picks one per node and target."""

from __future__ import annotations

import importlib
import pkgutil

from .kernel import KernelTemplate

BACKEND_PACKAGES = ("codegen.triton", "codegen.tvm")

_TEMPLATES: list[KernelTemplate] | None = None


def family_modules() -> list[str]:
    out = []
    for pkg_name in BACKEND_PACKAGES:
        try:
            pkg = importlib.import_module(pkg_name)
        except ImportError:
            continue
        out += [f"{pkg_name}.{m.name}" for m in pkgutil.iter_modules(pkg.__path__) if not m.name.startswith("_")]
    return sorted(out)


def all_templates() -> list[KernelTemplate]:
    global _TEMPLATES
    if _TEMPLATES is None:
        out: list[KernelTemplate] = []
        for name in family_modules():
            out += getattr(importlib.import_module(name), "TEMPLATES", [])
        fams = [t.family for t in out]
        dup = sorted({f for f in fams if fams.count(f) > 1})
        if dup:
            raise ValueError(f"kernel families registered twice: {dup}")
        _TEMPLATES = out
    return _TEMPLATES


def templates_for(op: str) -> list[KernelTemplate]:
    return [t for t in all_templates() if op in t.ops]
