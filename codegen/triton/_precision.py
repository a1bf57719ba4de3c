"""Dot-product input precisions per backend: the kernels name the numerics they need, this picks the
`tl.dot(input_precision=...)` string the compiling backend accepts for it.

    fast_fp32()     fp32 operands, tensor-core speed: "tf32" on NVIDIA; AMD (gfx950) has no TF32 and
                    accepts only "ieee" / "bf16x3" / "bf16x6", so "ieee" (exact fp32 MFMA).
    precise_fp32()  fp32 operands, ~fp32 accuracy: "tf32x3" on NVIDIA, "ieee" on AMD.
    low_bits()      16-bit operands (bf16 / fp16 / fp8): the precision is not used by the dot on any
                    backend, "ieee" is the spelling every backend accepts.

The backend is the one Triton compiles for at the call: the live driver, or the build target that
ahead-of-time compilation (`codegen.aot.record`) installs as the active driver. Under the interpreter
every dot is computed in fp32 and "ieee" is returned.
"""

from __future__ import annotations

import os

import triton


def backend() -> str:
    """'cuda', 'hip' or 'interpreter'."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("0", ""):
        return "interpreter"
    return triton.runtime.driver.active.get_current_target().backend


def fast_fp32(on: str | None = None) -> str:
    """`on`: the backend to spell for (default: the one compiling now)."""
    return "tf32" if (on or backend()) == "cuda" else "ieee"


def precise_fp32(on: str | None = None) -> str:
    return "tf32x3" if (on or backend()) == "cuda" else "ieee"


def low_bits() -> str:
    return "ieee"
