"""Element types of the IR: activations, caches, integer metadata and packed storage formats.

Packed formats (`mxfp4`, `nvfp4`) appear only as parameter storage: a param of type
`mxfp4[E,I,L]` has logical shape [E,I,L] and is stored as E2M1 codes plus E8M0 scales per 32 values
along the last (reduction) axis. `bits` counts scale overhead so byte costs are exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DType:
    name: str
    bits: float  # storage bits per logical element, block scales included
    kind: str  # "float" | "int" | "bool" | "packed"
    torch_dtype: torch.dtype | None  # storage dtype when a plain torch tensor holds it

    @property
    def is_float(self) -> bool:
        return self.kind == "float"

    @property
    def is_packed(self) -> bool:
        return self.kind == "packed"

    def __str__(self) -> str:
        return self.name


_ALL = [
    DType("f64", 64, "float", torch.float64),
    DType("f32", 32, "float", torch.float32),
    DType("bf16", 16, "float", torch.bfloat16),
    DType("f16", 16, "float", torch.float16),
    DType("f8e4m3", 8, "float", torch.float8_e4m3fn),
    DType("i64", 64, "int", torch.int64),
    DType("i32", 32, "int", torch.int32),
    DType("i8", 8, "int", torch.int8),
    DType("u8", 8, "int", torch.uint8),
    DType("bool", 8, "bool", torch.bool),
    DType("mxfp4", 4.25, "packed", None),  # E2M1 + one E8M0 per 32
    DType("nvfp4", 4.5, "packed", None),  # E2M1 + one E4M3 per 16 (+ one fp32 per tensor)
]
DTYPES: dict[str, DType] = {d.name: d for d in _ALL}
f64, f32, bf16, f16, f8e4m3 = (DTYPES[n] for n in ("f64", "f32", "bf16", "f16", "f8e4m3"))
i64, i32, i8, u8, boolean = (DTYPES[n] for n in ("i64", "i32", "i8", "u8", "bool"))
mxfp4, nvfp4 = DTYPES["mxfp4"], DTYPES["nvfp4"]

# Float storage types that the reference interpreter computes in its compute dtype (fp32 / fp64).
# f8e4m3 is not among them: FP8 values are part of the semantics (indexer quantisation).
WIDENED_FLOATS = frozenset({"f64", "f32", "bf16", "f16"})


def dtype(name: str | DType) -> DType:
    if isinstance(name, DType):
        return name
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(DTYPES)}")
    return DTYPES[name]


def from_torch(t: torch.dtype) -> DType:
    for d in _ALL:
        if d.torch_dtype == t:
            return d
    raise ValueError(f"torch dtype {t} has no IR dtype")
