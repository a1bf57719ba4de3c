"""Record the Triton specialisations a workload launches, without a GPU and without running a kernel.

Triton's JIT turns every launch `kernel[grid](*args, **kw)` into a specialisation: the signature
(`*bf16`, `i32`, `constexpr`, ...), the constexpr values, the attributes (`tt.divisibility=16` for
pointers aligned to 16 bytes and integers divisible by 16; an integer equal to 1 becomes a constexpr)
and the backend options (num_warps, num_stages, ...). It compiles once per specialisation, in
`JITFunction._do_compile(key, signature, device, constexprs, options, attrs, warmup)`.

`Recorder(target)` replaces, for its lifetime, the active driver with `FakeDriver` (device 0 is the
build target, e.g. `GPUTarget("cuda", 90, 32)`) and `_do_compile` with a recorder, so Triton's own
`JITFunction.run` computes each launch's specialisation exactly as it would on that device; the
"kernel" it returns launches nothing. The process must not interpret (`TRITON_INTERPRET=0`).

`RecordingExecutor` runs a compiled module with it: every kernel node calls its template's `launch`
(recorded, nothing computed) and then the op's reference, whose values are copied into the kernel's
own result tensors, so later nodes and the host-side logic of later launches see real values in the
layouts (strides, views, alignment) the device run produces. Weights are copied into fresh
allocations first (worker.device_like_weights), as the device run's copies are.

`lookup_key(jitfn, signature, constexprs, attrs, options)` is the identity of a specialisation: the same
function runs here at build time and in the live process at load time (`loader.py`), on the same
Triton version, so equal keys mean "the binary the JIT would have built".
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass, field

# options that name paths on the building machine (libdevice) are not part of the identity
_OPTION_SKIP = ("extern_libs",)


def _canon(v):
    """A JSON-able, deterministic spelling of a constexpr / attribute / option value."""
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return {"float": repr(v)}
    if isinstance(v, (list, tuple)):
        return [_canon(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _canon(x) for k, x in sorted(v.items(), key=lambda kv: str(kv[0]))}
    if hasattr(v, "cache_key") and hasattr(v, "fn"):  # a JITFunction passed as a constexpr
        return {"jit": f"{v.fn.__module__}:{v.fn.__qualname__}", "key": v.cache_key}
    if type(v).__name__ == "constexpr":
        return _canon(v.value)
    return {type(v).__name__: str(v)}  # tl.dtype and other small value types


def describe(jitfn, signature, constexprs, attrs, options) -> dict:
    """The specialisation as JSON: function, source key, signature, constexprs, attrs, options."""
    opts = {k: _canon(v) for k, v in sorted(vars(options).items()) if k not in _OPTION_SKIP}
    return {
        "function": f"{jitfn.fn.__module__}:{jitfn.fn.__qualname__}",
        "name": jitfn.fn.__name__,
        "source_key": jitfn.cache_key,
        "signature": {str(k): str(v) for k, v in signature.items()},
        "constexprs": [[_canon(list(k)), _canon(v)] for k, v in sorted(constexprs.items(), key=lambda kv: str(kv[0]))],
        "attrs": [[_canon(list(k)), _canon(v)] for k, v in sorted(attrs.items(), key=lambda kv: str(kv[0]))],
        "options": opts,
    }


def lookup_key(jitfn, signature, constexprs, attrs, options) -> str:
    """sha256 (hex, 24 chars) of `describe(...)` in canonical JSON."""
    text = json.dumps(describe(jitfn, signature, constexprs, attrs, options), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


class FakeDriver:
    """The driver Triton consults while launches are recorded: one device, the build target."""

    def __init__(self, target):
        self.target = target

    def is_active(self):
        return True

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def set_current_device(self, device):
        return None

    def get_current_stream(self, device=None):
        return 0


class _NoLaunch:
    """What the recording JIT returns instead of a compiled kernel: counts launches, runs nothing."""

    function = None
    packed_metadata = None

    def __init__(self, spec: "Specialisation"):
        self.spec = spec

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, *args, **kwargs):
        self.spec.launches += 1


@dataclass
class Specialisation:
    key: str
    description: dict
    compile_args: tuple  # (jitfn, signature, constexprs, attrs, options): what the JIT would compile
    launches: int = 0
    first_seen: str = ""


@dataclass
class Recorder:
    """Context manager: inside it, Triton launches are recorded as `Specialisation`s (by key)."""

    target: object  # triton.backends.compiler.GPUTarget
    specs: "OrderedDict[str, Specialisation]" = field(default_factory=OrderedDict)
    label: str = ""  # what is being recorded now (shown in the build report)

    def __enter__(self):
        from triton.runtime import jit as jit_mod
        from triton.runtime.driver import driver

        self._driver, self._jit = driver, jit_mod.JITFunction
        self._saved_active = driver._active
        self._saved_compile = jit_mod.JITFunction._do_compile
        driver.set_active(FakeDriver(self.target))
        recorder = self

        def _record(jitfn, key, signature, device, constexprs, options, attrs, warmup):
            kernel_cache = jitfn.device_caches[device][0]
            k = lookup_key(jitfn, signature, constexprs, attrs, options)
            spec = recorder.specs.get(k)
            if spec is None:
                spec = recorder.specs[k] = Specialisation(k, describe(jitfn, signature, constexprs, attrs, options),
                                                          (jitfn, signature, constexprs, attrs, options),
                                                          first_seen=recorder.label)
            kernel = kernel_cache[key] = _NoLaunch(spec)
            return kernel

        jit_mod.JITFunction._do_compile = _record
        return self

    def __exit__(self, *exc):
        self._jit._do_compile = self._saved_compile
        self._driver._active = self._saved_active
        for spec in self.specs.values():  # drop the no-op kernels from the JIT's in-memory caches
            jitfn = spec.compile_args[0]
            jitfn.device_caches.clear()
        return False


def recording_executor_class():
    """`Executor` subclass (built lazily: importing the executor imports the kernel families)."""
    import torch

    from ir.interpreter import Interpreter
    from k31c.runtime.executor import Executor

    class RecordingExecutor(Executor):
        """Kernel nodes: template launch (recorded, computes nothing); every node's value: the reference."""

        def __init__(self, *args, recorder: Recorder, **kwargs):
            super().__init__(*args, **kwargs)
            self.recorder = recorder

        def _dispatch(self, n, args, env):
            """Kernel nodes return the kernel's own result tensors (their strides and views are what later
            launches are specialised on) filled with the reference values."""
            like = None
            if self._kernel.get(id(n)) is not None:
                saved = self.recorder.label
                self.recorder.label = f"{saved} {n.op}"
                try:
                    like = super()._dispatch(n, args, env)
                finally:
                    self.recorder.label = saved
            ref = self._reference(n, args, env)
            if like is None:
                return ref
            out = []
            for k, r in zip(like, ref):
                if isinstance(k, torch.Tensor) and isinstance(r, torch.Tensor) and k.shape == r.shape:
                    if k is not r:
                        k.copy_(r)
                    out.append(k)
                else:
                    out.append(r)
            return out

        def _reference(self, n, args, env):
            """The reference in fp32 on upcast copies of 16-bit float operands (the CPU lacks some bf16
            kernels, e.g. triangular solves); operands updated in place (pools) are copied back."""
            up = [a.float() if isinstance(a, torch.Tensor) and a.dtype in (torch.bfloat16, torch.float16) else a
                  for a in args]
            outs = Interpreter._execute(self, n, up, env)
            for a, u in zip(args, up):
                if u is not a:
                    a.copy_(u)
            return outs

    return RecordingExecutor
