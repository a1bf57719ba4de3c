"""Shared plumbing of the TVM families: the host `llvm` target, the lazy in-process build cache, the
dtype names, and the CPU selection rule.

Build cache: `build(name, key, make)` compiles `make()` (a TIR PrimFunc) once per (name, key) in this
process and returns the callable; key holds the shape dims, dtypes, flags and config the PrimFunc was
specialised for, so every distinct specialisation is built exactly once and nothing is built until a
kernel is launched.

CPU rule (`cpu_rule(family, target)`): a TVM template runs a node on `--target cpu` when the measured
preference file (`PREFERENCE_FILE`, written by `benches/bench_tvm_cpu.py`) says the family beat the torch
reference (eager) there: `preference[family].prefer` is true, i.e. the geometric mean of its speedups over
the k31-tiny shapes is > 1. Otherwise `supports` returns the reason (with the measured ratio) and the
node keeps its other template. `K31C_TVM=all` selects every TVM template that can run a node (tests use
it to run the whole model through TVM); `K31C_TVM=off` selects none.
"""

from __future__ import annotations

import functools
import json
import os
import threading

import torch

# TVM's pool workers spin after a parallel kernel; on a small CPU shared with torch's own threads that
# spinning slows the torch ops running between kernels: workers sleep at once unless the user says otherwise.
os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", "0")

try:
    import tvm
    from tvm.target import codegen as _codegen

    HAVE_TVM = True
except ImportError:  # the families then export no templates
    tvm = None
    HAVE_TVM = False

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PREFERENCE_FILE = os.path.join(ROOT, "benches", "results", "cpu-2026-11-29", "tvm.json")
DTYPES = {torch.float32: "float32", torch.float64: "float64"}

_CACHE: dict = {}
_LOCK = threading.Lock()
builds = 0  # compiles done in this process (tests read it to check the cache)


@functools.lru_cache(maxsize=1)
def host_target():
    """`llvm` for the CPU this process runs on (its own -mcpu, so AVX2/AVX-512 are used where present)."""
    return tvm.target.Target({"kind": "llvm", "mcpu": _codegen.llvm_get_system_cpu()})


def build(name: str, key: tuple, make):
    """The compiled kernel for (name, key), built from `make()` on first use in this process."""
    global builds
    full = (name, key)
    fn = _CACHE.get(full)
    if fn is None:
        with _LOCK:
            fn = _CACHE.get(full)
            if fn is None:
                func = make().with_attr("global_symbol", "main")
                fn = tvm.compile(tvm.IRModule({"main": func}), target=host_target())["main"]
                _CACHE[full] = fn
                builds += 1
    return fn


ALIGN = 64  # bytes: TVM's llvm code assumes buffer data this aligned (aligned vector loads)


def aligned(t: torch.Tensor) -> torch.Tensor:
    """t as a dense tensor whose data is ALIGN-byte aligned: a view of a packed GEMM's output (rows at an
    offset) is copied, since TVM's vector loads on a misaligned address fault."""
    if t.is_contiguous() and t.data_ptr() % ALIGN == 0:
        return t
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)  # fresh allocations are 64-byte aligned
    return out.copy_(t)


def dtype_of(t: torch.Tensor, what: str) -> str:
    """TIR dtype name of a run-time float tensor (fp32/fp64: the CPU path computes in fp32)."""
    if t.dtype not in DTYPES:
        raise ValueError(f"TVM kernel: {what} is {t.dtype}; the CPU kernels take float32 or float64 "
                         f"(run the interpreter with compute dtype float32)")
    return DTYPES[t.dtype]


def type_name(x) -> str:
    """'f32' | 'bf16' | 'mxfp4' | ... for a compile-time TensorType, a tensor or a PackedMXFP4."""
    from ir.packed import PackedMXFP4

    if isinstance(x, PackedMXFP4):
        return "mxfp4"
    if isinstance(x, torch.Tensor):
        return {torch.float32: "f32", torch.float64: "f64", torch.bfloat16: "bf16", torch.float16: "f16",
                torch.uint8: "mxfp4"}.get(x.dtype, str(x.dtype))
    return getattr(getattr(x, "dtype", None), "name", type(x).__name__)


def static_int(d) -> int | None:
    """A dimension as an int, or None when it is symbolic."""
    try:
        return int(d)
    except TypeError:
        return None


# ---- the CPU selection rule ------------------------------------------------------------------------
@functools.lru_cache(maxsize=4)
def _preference(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f).get("preference", {})
    except (OSError, ValueError):
        return None


def cpu_rule(family: str, target: str) -> str | None:
    """None when the TVM template `family` should run on `target`, else the reason it does not."""
    if not HAVE_TVM:
        return "apache-tvm is not installed (pip install apache-tvm==0.27.0.post1)"
    if str(target) != "cpu":
        return f"TVM kernels are built for the host CPU (llvm) only, not target {target}"
    mode = os.environ.get("K31C_TVM", "measured")
    if mode == "all":
        return None
    if mode == "off":
        return "TVM disabled by K31C_TVM=off"
    path = os.environ.get("K31C_TVM_PREFERENCE", PREFERENCE_FILE)
    pref = _preference(path)
    if pref is None:
        return f"no CPU measurement file {os.path.relpath(path, ROOT)} (run benches/bench_tvm_cpu.py)"
    entry = pref.get(family)
    if entry is None:
        return f"{family} was not measured in {os.path.relpath(path, ROOT)}"
    if not entry.get("prefer"):
        return (f"measured slower than the torch reference on cpu (speedup {entry.get('speedup', float('nan')):.2f}x,"
                f" {os.path.relpath(path, ROOT)})")
    return None


def largest_divisor(n: int, candidates) -> int:
    """The largest candidate dividing n (candidates include 1)."""
    return max(c for c in candidates if n % c == 0)
