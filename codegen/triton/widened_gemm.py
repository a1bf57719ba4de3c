"""`fused.widened_linear` (passes/widening_cast_fold.py): y = cast(x, f32) @ w^T as one GEMM that reads the
bf16/f16 x and widens it in registers (`gemm(.., as_dtype=f32)`).

Widening bf16/f16 to f32 is exact and the GEMM tiles convert every x tile to their compute dtype right
after loading it, so with the same config the result equals the cast kernel + the f32 GEMM bit for bit:
the same numerics (`dot_numerics(f32, w)`), the same tiles, the same K order. What goes away is the f32
copy of x (written once, read once) and one launch: in a decode step the MoE router logits and the LM
head. Configs, tunables, heuristic and constraints are the GEMM's (gemm.py), keyed on the stored x.
"""

from __future__ import annotations

import torch

from codegen.kernel import KernelTemplate
from codegen.triton import gemm as gm

OP = "fused.widened_linear"
WIDER = {"f32": torch.float32}
NARROW = ("bf16", "f16")   # the stored dtypes of EXACT_WIDENINGS, by IR name


def widened_linear(x: torch.Tensor, w, dtype: str, config: dict) -> torch.Tensor:
    y = gm.gemm(x.reshape(-1, x.shape[-1]), w, config, as_dtype=WIDER[dtype])
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _launch(a, attrs, config):
    gm.check_invariance(attrs, config)
    return widened_linear(a.operands[0], a.operands[1], attrs["dtype"], config)


def _supports(a, attrs, target):
    x, w = a.operands
    if attrs.get("dtype") not in WIDER:
        return f"widening to {attrs.get('dtype')!r} (the GEMM reads x as {sorted(WIDER)})"
    stored = gm.dtype_name(x)
    if stored not in NARROW:
        return f"x {stored} does not widen exactly to {attrs['dtype']} (stored dtypes {NARROW})"
    return gm.supported_types(x, [w], target)


TEMPLATES = [
    KernelTemplate(
        family="widened_gemm", backend="triton", ops=(OP,), launch=_launch,
        key_dims=lambda a, attrs: gm.gemm_key(a.operands[0], [a.operands[1]], attrs), heuristic=gm.heuristic,
        tunables=gm.TUNABLES, bucket=gm.gemm_bucket, constraints=gm.constraints, supports=_supports,
        batch_invariant=True, doc="y = cast(x, f32) @ w^T with x read as bf16/f16 and widened in registers"),
]
