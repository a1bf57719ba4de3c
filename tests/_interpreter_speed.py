"""A test-session speed-up of Triton's interpreter (CPU runs), with the same semantics.

The interpreter re-patches `triton.language` before every kernel launch and before every call of a nested
`@triton.jit` function inside a program (`_patch_lang`): each time `_patch_builtin` lists the module's members
with `inspect.getmembers` and wraps every builtin in a new lambda. The nested calls run once per program, so on
the tiny model's CPU prefill this was 27% of the run (14k calls, 3M attributes set). `install()` replaces
`_patch_builtin` by one that
  - lists each patched object's builtins once, and makes each one's wrapper once, through the interpreter's own
    `_patch_attr` (so the wrapper is the interpreter's);
  - sets them through the caller's scope (which restores them after a launch) unless the object already holds
    this module's wrappers: a nested call's scope is never restored, and a launch's scope patches and restores
    an object's builtins together, so an object holds either all its originals or all its wrappers.
A name that held something other than a builtin when first listed is left alone, as the interpreter itself does.
Installed by conftest.py for the test session only; a Triton whose interpreter has another shape is left untouched.
"""

from __future__ import annotations

import inspect


class _Capture:
    """A stand-in scope that keeps the wrapper `_patch_attr` makes instead of setting it."""

    def set_attr(self, obj, name, value):
        self.value = value


def install() -> bool:
    """Replace the interpreter's `_patch_builtin` by the memoised one; False when it is not the expected shape."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_builtin", None)
    if original is None or getattr(original, "memoised", False) or not hasattr(interpreter, "_patch_attr") \
            or list(inspect.signature(original).parameters) != ["pkg", "builder", "scope"]:
        return False
    listed: dict[int, tuple] = {}   # id(pkg) -> (pkg, [(name, wrapper)]); pkg kept so its id stays its own

    def wrappers(pkg, builder):
        out = []
        for name, member in inspect.getmembers(pkg):
            if tl.core.is_builtin(member):
                capture = _Capture()
                interpreter._patch_attr(pkg, name, member, builder, capture)
                out.append((name, capture.value))
        return out

    def patch_builtin(pkg, builder, scope):
        entry = listed.get(id(pkg))
        if entry is None:
            entry = listed[id(pkg)] = (pkg, wrappers(pkg, builder))
        pairs = entry[1]
        if not pairs or getattr(pkg, pairs[0][0], None) is pairs[0][1]:
            return
        for name, wrapper in pairs:
            scope.set_attr(pkg, name, wrapper)

    patch_builtin.memoised = True
    patch_builtin.__wrapped__ = original   # the interpreter's own (tests compare the two)
    interpreter._patch_builtin = patch_builtin
    return True
