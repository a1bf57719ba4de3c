"""A kernel module rebuilt with parts taken out, for the ablation benches (mla_ablation.py, moe_ablation.py): the
module's own source with text edits applied, each edit guarded by a bit of a constexpr the edits add (ABL), imported
from a temporary file (Triton reads a kernel's source from its file). An edit whose text is not found exactly once
stops the bench with its name, so an ablation never runs against a kernel it no longer describes."""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile


def guard(block: str, bit: int, other: str = "pass", indent: int = 8) -> str:
    """`block` (indented `indent` spaces) run only when ABL lacks `bit`, else `other`."""
    pad = " " * indent
    body = "\n".join("    " + line for line in block.splitlines())
    return f"{pad}if ABL & {bit} == 0:\n{body}\n{pad}else:\n{pad}    {other}"


def ablated_module(module, edits: dict, tag: str):
    """`module`'s source with `edits` ({name: (text, replacement)}) applied, imported as a new module (registered as
    `<module's file name>_ablated`, so that another ablated module can import from it)."""
    src = open(module.__file__).read()
    for name, (old, new) in edits.items():
        if src.count(old) != 1:
            raise SystemExit(f"{tag}: edit {name!r} finds its text {src.count(old)} times in {module.__file__} "
                             f"(expected once): update the bench's edits to the kernel")
        src = src.replace(old, new)
    name = os.path.splitext(os.path.basename(module.__file__))[0] + "_ablated"
    path = os.path.join(tempfile.mkdtemp(prefix=tag + "_"), name + ".py")
    open(path, "w").write(src)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class AblatedLaunch:
    """Stands in for a module's kernel: `kernel[grid](...)` launches the ablated kernel with the current bits."""

    def __init__(self, kernel):
        self.kernel, self.abl, self.__name__ = kernel, 0, kernel.__name__

    @property
    def device_caches(self):    # the ablated kernel's compiled variants (benches read registers / SASS from them)
        return self.kernel.device_caches

    def __getitem__(self, grid):
        return lambda *a, **kw: self.kernel[grid](*a, ABL=self.abl, **kw)
