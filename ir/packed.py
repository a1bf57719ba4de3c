"""Weights kept in a packed storage format, as loaded (never re-quantised by k31c).

`PackedMXFP4` holds routed-expert weights exactly as a compressed-tensors checkpoint stores them:
`packed` uint8 [..., K/2] (two E2M1 codes per byte, low nibble = even element) and `scales`
uint8 [..., K/32] (E8M0 exponents), K the reduction axis. The reference interpreter dequantises on
use; kernels read the bytes directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PackedMXFP4:
    packed: torch.Tensor
    scales: torch.Tensor

    def __post_init__(self):
        if self.packed.dtype != torch.uint8 or self.scales.dtype != torch.uint8:
            raise TypeError(f"PackedMXFP4 needs uint8 packed/scales, found {self.packed.dtype}/{self.scales.dtype}")
        k = self.packed.shape[-1] * 2
        if tuple(self.scales.shape[:-1]) != tuple(self.packed.shape[:-1]) or self.scales.shape[-1] * 32 != k:
            raise ValueError(f"PackedMXFP4: packed {tuple(self.packed.shape)} needs scales "
                             f"{(*self.packed.shape[:-1], k // 32)}, found {tuple(self.scales.shape)}")

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical (dequantised) shape."""
        return (*self.packed.shape[:-1], self.packed.shape[-1] * 2)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scales.numel()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        from .formats import dequantize_mxfp4

        return dequantize_mxfp4(self.packed, self.scales, dtype=dtype)

    def to(self, device) -> "PackedMXFP4":
        return PackedMXFP4(self.packed.to(device), self.scales.to(device))
