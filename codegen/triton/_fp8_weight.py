"""FP8 e4m3 weights with per-channel or per-block scales: the operand type of the GEMM templates (gemm.py
re-exports it as `gemm.FP8Weight`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(eq=False)
class FP8Weight:
    """An FP8 e4m3 weight [N, K] with scales: `scale` [N] (per output channel) or [ceil(N/gn), ceil(K/gk)]
    (per block, `block=(gn, gk)`). Value = q * scale, exactly as `dequantize` computes it."""

    q: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int] | None = None

    def __post_init__(self):
        if self.q.dtype != torch.float8_e4m3fn or self.q.dim() != 2:
            raise ValueError(f"FP8Weight: q must be float8_e4m3fn [N, K], found {self.q.dtype} {tuple(self.q.shape)}")
        n, k = self.q.shape
        want = (n,) if self.block is None else (-(-n // self.block[0]), -(-k // self.block[1]))
        if tuple(self.scale.shape) != want:
            raise ValueError(f"FP8Weight: scale must be {want} for q {tuple(self.q.shape)} and block {self.block}, "
                             f"found {tuple(self.scale.shape)}")

    shape = property(lambda self: self.q.shape)
    dtype = property(lambda self: self.q.dtype)
    device = property(lambda self: self.q.device)

    def to(self, device) -> "FP8Weight":
        return FP8Weight(self.q.to(device), self.scale.to(device), self.block)

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        q = self.q.to(torch.float32)
        if self.block is None:
            return (q * self.scale.to(torch.float32)[:, None]).to(dtype)
        gn, gk = self.block
        s = self.scale.to(torch.float32).repeat_interleave(gn, 0).repeat_interleave(gk, 1)
        return (q * s[: q.shape[0], : q.shape[1]]).to(dtype)

    @staticmethod
    def quantize(w: torch.Tensor, block: tuple[int, int] | None = None) -> "FP8Weight":
        """Scales amax/448 per channel (or per block); q = e4m3(w / scale), round to nearest even."""
        w32 = w.to(torch.float32)
        if block is None:
            s = (w32.abs().amax(dim=1) / 448.0).clamp_min(1e-12)
            return FP8Weight((w32 / s[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn), s, None)
        gn, gk = block
        n, k = w32.shape
        pad = torch.zeros(-(-n // gn) * gn, -(-k // gk) * gk, dtype=torch.float32, device=w.device)
        pad[:n, :k] = w32
        s = pad.reshape(pad.shape[0] // gn, gn, pad.shape[1] // gk, gk).abs().amax(dim=(1, 3)) / 448.0
        s = s.clamp_min(1e-12)
        full = s.repeat_interleave(gn, 0).repeat_interleave(gk, 1)[:n, :k]
        return FP8Weight((w32 / full).clamp(-448, 448).to(torch.float8_e4m3fn), s, (gn, gk))
