"""Exact encode/decode of the number formats of SPEC §7 (and the indexer quantisation of §5 step 4).

Everything is plain torch and works on any device; no numpy in the hot path.  Rounding is exact:
E2M1 uses comparisons against the representable midpoints, power-of-two exponents are taken from the
float's bits with ``torch.frexp`` (never a floating ``log2``), and powers of two are built from bit
patterns, so scaling by them is exact.

Conventions
-----------
* E2M1 code: bits ``s e e m``; codes 0..7 -> 0, .5, 1, 1.5, 2, 3, 4, 6; code 8 is -0.0.
* Two codes per byte, low nibble = even element (compressed-tensors and gpt-oss agree on this).
* E8M0 byte b -> 2^(b-127); b = 255 is NaN (OCP MX v1.0).
* Quantisers raise ``ValueError`` on NaN (and, where a scale is derived from the amax, on inf).
  Decoders are pure bit maps: a NaN scale byte decodes to NaN and is not checked.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "E2M1_VALUES", "encode_e2m1", "decode_e2m1", "pack_nibbles", "unpack_nibbles",
    "encode_e8m0", "decode_e8m0", "quantize_mxfp4", "quantize_mxfp4_pow2", "dequantize_mxfp4",
    "dequantize_mxfp4_gptoss", "gptoss_to_compressed", "quantize_nvfp4", "dequantize_nvfp4",
    "encode_fp8_e4m3", "decode_fp8_e4m3", "quantize_fp8_pow2", "dequantize_fp8",
    "FP8_E4M3_MAX", "E2M1_MAX", "E8M0_MIN_EXP", "FormatInfo", "STORAGE_FORMATS",
]

E2M1_MAX = 6.0
FP8_E4M3_MAX = 448.0
E8M0_MIN_EXP = -127  # byte 0; also the exponent chosen for an all-zero MXFP4 block
MXFP4_BLOCK = 32
NVFP4_BLOCK = 16

_POS = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
E2M1_VALUES: Tensor = torch.tensor(_POS + [-v for v in _POS], dtype=torch.float32)
"""float32 [16]: value of each E2M1 code (index 8 holds -0.0)."""

# Midpoints between neighbouring magnitudes with the tie direction that lands on the even code
# (mantissa bit 0): '>' means the tie stays below, '>=' means the tie goes up.
_THRESHOLDS = [(0.25, False), (0.75, True), (1.25, False), (1.75, True),
               (2.5, False), (3.5, True), (5.0, False)]

_VALUES_CACHE: dict[torch.device, Tensor] = {}


def _values_on(device: torch.device) -> Tensor:
    t = _VALUES_CACHE.get(device)
    if t is None:
        t = _VALUES_CACHE[device] = E2M1_VALUES.to(device)
    return t


# ---------------------------------------------------------------------------------------- checks

def _check_not_nan(x: Tensor, what: str, finite: bool = False) -> None:
    bad = ~torch.isfinite(x) if finite else torch.isnan(x)
    if bool(bad.any()):
        kind = "non-finite (NaN/inf)" if finite else "NaN"
        raise ValueError(f"{what}: input tensor of shape {tuple(x.shape)} contains "
                         f"{int(bad.sum())} {kind} value(s)")


def _check_u8(t: Tensor, what: str) -> None:
    if t.dtype != torch.uint8:
        raise ValueError(f"{what}: expected dtype torch.uint8, found {t.dtype}")


def _check_last_dim(x: Tensor, multiple: int, what: str) -> int:
    if x.dim() == 0 or x.shape[-1] % multiple != 0:
        found = "a 0-d tensor" if x.dim() == 0 else f"{x.shape[-1]} (shape {tuple(x.shape)})"
        raise ValueError(f"{what}: last dim must be a multiple of {multiple}, found {found}")
    return x.shape[-1]


def _work_float(x: Tensor) -> Tensor:
    """float64 stays float64 (exactness); every other dtype is widened exactly to float32."""
    return x if x.dtype == torch.float64 else x.to(torch.float32)


# -------------------------------------------------------------------------------- exact 2^e, log2

def _pow2_f32(e: Tensor) -> Tensor:
    """Exact float32 2^e for integer e in [-127, 127] (2^-127 is the subnormal 0x00400000)."""
    e = e.to(torch.int32)
    bits = torch.where(e <= -127, torch.full_like(e, 0x00400000), (e + 127) << 23)
    return bits.view(torch.float32)


def _pow2_f64(e: Tensor) -> Tensor:
    """Exact float64 2^e for integer e in [-1022, 1023]."""
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)


def _ceil_log2_ratio(amax: Tensor, divisor: float) -> Tensor:
    """Smallest integer e with amax <= divisor * 2^e, i.e. ceil(log2(amax / divisor)), as int32.

    The exponent comes from ``torch.frexp`` of the float64 ratio (mantissa m in [0.5, 1): the ratio
    is 2^(e-1) exactly when m == 0.5, otherwise it lies strictly inside (2^(e-1), 2^e)).  A final
    comparison against divisor * 2^e, both sides exact in float64, makes the result exact even if the
    division rounded across a power of two.  amax must be finite and > 0.
    """
    a = amax.to(torch.float64)
    m, e = torch.frexp(a / divisor)
    e = e.to(torch.int64) - (m == 0.5).to(torch.int64)
    e = e + (a > divisor * _pow2_f64(e)).to(torch.int64)
    e = e - (a <= divisor * _pow2_f64(e - 1)).to(torch.int64)
    return e.to(torch.int32)


# ------------------------------------------------------------------------------------------ E2M1

def encode_e2m1(x: Tensor) -> Tensor:
    """Round to the nearest E2M1 value, ties to the even code; saturate at +-6 (inf too).

    Returns uint8 codes 0..15 (bit 3 = sign, taken from the sign bit, so -0.0 and small negatives
    that round to zero give code 8).  Raises ValueError on NaN.
    """
    x = _work_float(x)
    _check_not_nan(x, "encode_e2m1")
    a = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for t, tie_up in _THRESHOLDS:
        code += (a >= t if tie_up else a > t).to(torch.uint8)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def decode_e2m1(codes: Tensor) -> Tensor:
    """uint8 codes 0..15 -> float32 values (code 8 -> -0.0).  Codes above 15 raise ValueError."""
    _check_u8(codes, "decode_e2m1")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError(f"decode_e2m1: codes must be in 0..15, found max {int(codes.max())}")
    return _values_on(codes.device)[codes.long()]


def pack_nibbles(codes: Tensor) -> Tensor:
    """uint8 codes [..., n] (n even) -> bytes [..., n/2]; low nibble = element 2j, high = 2j+1."""
    _check_u8(codes, "pack_nibbles")
    _check_last_dim(codes, 2, "pack_nibbles")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError(f"pack_nibbles: codes must be in 0..15, found max {int(codes.max())}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: Tensor) -> Tensor:
    """uint8 bytes [..., m] -> codes [..., 2m] (element 2j = low nibble of byte j)."""
    _check_u8(packed, "unpack_nibbles")
    lo, hi = packed & 0x0F, packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


# ------------------------------------------------------------------------------------------ E8M0

def encode_e8m0(exponent: Tensor) -> Tensor:
    """Unbiased integer exponent e in [-127, 127] -> E8M0 byte e + 127 (uint8).  Out of range raises."""
    e = exponent.to(torch.int32)
    if e.numel() and (int(e.min()) < -127 or int(e.max()) > 127):
        raise ValueError(f"encode_e8m0: exponent must be in [-127, 127], found "
                         f"[{int(e.min())}, {int(e.max())}]")
    return (e + 127).to(torch.uint8)


def decode_e8m0(scales: Tensor) -> Tensor:
    """E8M0 bytes -> float32 2^(b-127), exact (b = 0 gives the subnormal 2^-127; b = 255 gives NaN)."""
    _check_u8(scales, "decode_e8m0")
    b = scales.to(torch.int32)
    out = _pow2_f32(b - 127)
    return torch.where(b == 255, torch.full_like(out, float("nan")), out)


# ----------------------------------------------------------------------------------------- MXFP4

def quantize_mxfp4(x: Tensor) -> tuple[Tensor, Tensor]:
    """MXFP4 along the last (reduction) axis: x [..., K] -> (packed u8 [..., K/2], scales u8 [..., K/32]).

    Per block of 32: s = 2^e with e = ceil(log2(amax / 6)) (rounded up, so |x / s| <= 6 and nothing
    clips), clamped below at -127 (E8M0 byte 0).  An all-zero block gets e = -127 (byte 0), the limit
    of amax -> 0.  Values are E2M1(x / s) (division by a power of two is exact).  Also the indexer's
    MXFP4 key quantiser (SPEC §5.4).  Raises ValueError for K % 32 != 0, NaN/inf, or e > 127.
    """
    K = _check_last_dim(x, MXFP4_BLOCK, "quantize_mxfp4")
    x = _work_float(x)
    _check_not_nan(x, "quantize_mxfp4", finite=True)
    xb = x.reshape(*x.shape[:-1], K // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = xb.abs().amax(dim=-1)
    e = torch.where(amax > 0, _ceil_log2_ratio(amax, E2M1_MAX),
                    torch.full(amax.shape, E8M0_MIN_EXP, dtype=torch.int32, device=x.device))
    e = e.clamp_min(E8M0_MIN_EXP)
    scales = encode_e8m0(e)
    s = _pow2_f32(e).to(x.dtype)
    codes = encode_e2m1(xb / s[..., None]).reshape(x.shape)
    return pack_nibbles(codes), scales


quantize_mxfp4_pow2 = quantize_mxfp4
"""Indexer MXFP4 key quantisation (SPEC §5.4) is exactly :func:`quantize_mxfp4`."""


def dequantize_mxfp4(packed: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """(packed u8 [..., K/2], scales u8 [..., K/32]) -> [..., K] = E2M1 * 2^(s-127), computed in float32."""
    _check_u8(packed, "dequantize_mxfp4 packed")
    _check_u8(scales, "dequantize_mxfp4 scales")
    if packed.dim() == 0 or scales.shape[:-1] != packed.shape[:-1] or \
            2 * packed.shape[-1] != MXFP4_BLOCK * scales.shape[-1]:
        K = 2 * packed.shape[-1] if packed.dim() else 0
        raise ValueError(f"dequantize_mxfp4: packed {tuple(packed.shape)} (K={K}) needs scales of shape "
                         f"{tuple(packed.shape[:-1]) + (K / MXFP4_BLOCK,)}, found {tuple(scales.shape)}")
    v = decode_e2m1(unpack_nibbles(packed))
    v = v.reshape(*scales.shape, MXFP4_BLOCK) * decode_e8m0(scales)[..., None]
    return v.reshape(*packed.shape[:-1], 2 * packed.shape[-1]).to(dtype)


def gptoss_to_compressed(blocks: Tensor, scales: Tensor) -> tuple[Tensor, Tensor]:
    """gpt-oss (``*_blocks`` u8 [..., G, 16], ``*_scales`` u8 [..., G]) -> compressed-tensors
    (packed [..., 32G/2], scales [..., G]).  Both use low nibble = even element, so bytes are kept."""
    _check_u8(blocks, "gptoss_to_compressed blocks")
    _check_u8(scales, "gptoss_to_compressed scales")
    if blocks.dim() < 2 or blocks.shape[-1] != MXFP4_BLOCK // 2 or scales.shape != blocks.shape[:-1]:
        raise ValueError(f"gptoss_to_compressed: expected blocks [..., G, 16] and scales [..., G], found "
                         f"blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)}")
    return blocks.reshape(*blocks.shape[:-2], blocks.shape[-2] * blocks.shape[-1]), scales


def dequantize_mxfp4_gptoss(blocks: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Dequantise the gpt-oss MXFP4 layout to [..., K] with K = 32 * G."""
    return dequantize_mxfp4(*gptoss_to_compressed(blocks, scales), dtype=dtype)


# ----------------------------------------------------------------------------------------- NVFP4

def quantize_nvfp4(x: Tensor, tensor_scale: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """NVFP4 along the last axis: x [..., K] -> (packed u8 [..., K/2], block_scales float8_e4m3fn
    [..., K/16], tensor_scale float32 0-d).

    tensor_scale = amax(x) / (448 * 6) (1.0 if amax is 0), or the given fixed scale (a cache written a
    token at a time keeps one scale per layer); block_scale = e4m3(amax_block / 6 /
    tensor_scale) (round to nearest, saturating); values = E2M1(x / (block_scale * tensor_scale)) with
    the product in float32, clipping at +-6 where the block scale rounded down.  A block whose scale
    rounds to 0 (amax_block below ~2^-10 of the tensor's scale range) encodes as zeros.
    """
    K = _check_last_dim(x, NVFP4_BLOCK, "quantize_nvfp4")
    x = x.to(torch.float32)
    _check_not_nan(x, "quantize_nvfp4", finite=True)
    gmax = x.abs().amax() if x.numel() else torch.zeros((), device=x.device)
    ts = torch.where(gmax > 0, gmax / (FP8_E4M3_MAX * E2M1_MAX), torch.ones_like(gmax))
    if tensor_scale is not None:
        ts = torch.full_like(gmax, float(tensor_scale))
    xb = x.reshape(*x.shape[:-1], K // NVFP4_BLOCK, NVFP4_BLOCK)
    bs = encode_fp8_e4m3(xb.abs().amax(dim=-1) / E2M1_MAX / ts)
    denom = (bs.to(torch.float32) * ts)[..., None]
    q = torch.where(denom > 0, xb / torch.where(denom > 0, denom, torch.ones_like(denom)),
                    torch.zeros_like(xb))
    return pack_nibbles(encode_e2m1(q).reshape(x.shape)), bs, ts.to(torch.float32)


def dequantize_nvfp4(packed: Tensor, block_scales: Tensor, tensor_scale: Tensor,
                     dtype: torch.dtype = torch.float32) -> Tensor:
    """(packed [..., K/2], block_scales e4m3 [..., K/16], tensor_scale) -> [..., K] =
    E2M1 * (float32(block_scale) * tensor_scale), the same float32 product the quantiser divides by."""
    _check_u8(packed, "dequantize_nvfp4 packed")
    if block_scales.dtype != torch.float8_e4m3fn:
        raise ValueError(f"dequantize_nvfp4: expected block_scales dtype torch.float8_e4m3fn, "
                         f"found {block_scales.dtype}")
    if packed.dim() == 0 or block_scales.shape[:-1] != packed.shape[:-1] or \
            2 * packed.shape[-1] != NVFP4_BLOCK * block_scales.shape[-1]:
        K = 2 * packed.shape[-1] if packed.dim() else 0
        raise ValueError(f"dequantize_nvfp4: packed {tuple(packed.shape)} (K={K}) needs block_scales of "
                         f"shape {tuple(packed.shape[:-1]) + (K / NVFP4_BLOCK,)}, "
                         f"found {tuple(block_scales.shape)}")
    ts = torch.as_tensor(tensor_scale, dtype=torch.float32, device=packed.device)
    v = decode_e2m1(unpack_nibbles(packed)).reshape(*block_scales.shape, NVFP4_BLOCK)
    v = v * (block_scales.to(torch.float32) * ts)[..., None]
    return v.reshape(*packed.shape[:-1], 2 * packed.shape[-1]).to(dtype)


# -------------------------------------------------------------------------------------- FP8 E4M3

def encode_fp8_e4m3(x: Tensor) -> Tensor:
    """x -> torch.float8_e4m3fn, round to nearest even, saturating to +-448 (inf too); NaN raises.

    (Clamp first: depending on torch version/backend a plain cast of |x| > 448 may give NaN.  float64 inputs are rounded by
    torch via float32; every other dtype converts exactly.)
    """
    x = _work_float(x)
    _check_not_nan(x, "encode_fp8_e4m3")
    return x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def decode_fp8_e4m3(q: Tensor) -> Tensor:
    """float8_e4m3fn -> float32 (exact)."""
    if q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"decode_fp8_e4m3: expected dtype torch.float8_e4m3fn, found {q.dtype}")
    return q.to(torch.float32)


def quantize_fp8_pow2(x: Tensor, amax_floor: float = 1e-4) -> tuple[Tensor, Tensor]:
    """Indexer FP8 quantisation (SPEC §5.4), one scale per row of the last axis.

    x [..., D] -> (q float8_e4m3fn [..., D], scale float32 [...]) with
    scale = 2^ceil(log2(max(amax, amax_floor) / 448)), the exponent taken exactly via frexp (an exact
    power-of-two ratio gives that power itself); q = e4m3(x / scale), so |q| <= 448 always.
    NaN/inf raise ValueError.
    """
    if x.dim() == 0:
        raise ValueError("quantize_fp8_pow2: expected a tensor [..., D], found a 0-d tensor")
    if not amax_floor > 0:
        raise ValueError(f"quantize_fp8_pow2: amax_floor must be > 0, found {amax_floor}")
    x = x.to(torch.float32)
    _check_not_nan(x, "quantize_fp8_pow2", finite=True)
    amax = x.abs().amax(dim=-1).clamp_min(amax_floor)
    scale = _pow2_f32(_ceil_log2_ratio(amax, FP8_E4M3_MAX).clamp(-127, 127))
    return encode_fp8_e4m3(x / scale[..., None]), scale


def dequantize_fp8(q: Tensor, scale: Tensor) -> Tensor:
    """q float8_e4m3fn [..., D], scale [...] -> float32 q * scale[..., None]."""
    return decode_fp8_e4m3(q) * scale.to(torch.float32)[..., None]


# ------------------------------------------------------------------------------- storage catalogue

@dataclass(frozen=True)
class FormatInfo:
    """A storage format: ``bits_per_value`` includes per-block scales (not a per-tensor scale);
    ``block`` is the scale block length along the reduction axis, None when unblocked."""
    name: str
    bits_per_value: float
    block: int | None = None


STORAGE_FORMATS: dict[str, FormatInfo] = {
    "bf16": FormatInfo("bf16", 16.0),
    "f32": FormatInfo("f32", 32.0),
    "fp8_e4m3": FormatInfo("fp8_e4m3", 8.0),
    "mxfp4": FormatInfo("mxfp4", 4.0 + 8.0 / MXFP4_BLOCK, MXFP4_BLOCK),  # 4.25, E8M0 per 32
    "nvfp4": FormatInfo("nvfp4", 4.0 + 8.0 / NVFP4_BLOCK, NVFP4_BLOCK),  # 4.5 + one fp32 per tensor
}


# ------------------------------------------------------------------------------ NVFP4 MLA latent rows

def quantize_latent_nvfp4(latent: Tensor, kv: int, tensor_scale: float = 1.0, pe_scale: float = 1.0) -> Tensor:
    """MLA latent rows [..., kv + dr] -> u8 rows [..., kv/2 + kv/16 + dr] (SPEC §7: 352 B at kv 512, dr 64):
    c_KV as NVFP4 codes with the fixed per-layer tensor scale, then its E4M3 block scales, then k_pe / pe_scale
    in FP8 e4m3 (saturating). A cache written a token at a time keeps its per-layer scales fixed."""
    x = latent.to(torch.float32)
    packed, bs, _ = quantize_nvfp4(x[..., :kv], tensor_scale=tensor_scale)
    kpe = encode_fp8_e4m3(x[..., kv:] / pe_scale)
    return torch.cat([packed, bs.view(torch.uint8), kpe.view(torch.uint8)], dim=-1).contiguous()


def dequantize_latent_nvfp4(rows: Tensor, kv: int, tensor_scale: float = 1.0, pe_scale: float = 1.0) -> Tensor:
    """Inverse reading of `quantize_latent_nvfp4`: u8 rows -> fp32 [..., kv + dr]."""
    _check_u8(rows, "dequantize_latent_nvfp4 rows")
    h, s = kv // 2, kv // 16
    c = dequantize_nvfp4(rows[..., :h].contiguous(), rows[..., h:h + s].contiguous().view(torch.float8_e4m3fn),
                         torch.tensor(tensor_scale, dtype=torch.float32))
    kpe = rows[..., h + s:].contiguous().view(torch.float8_e4m3fn).to(torch.float32) * pe_scale
    return torch.cat([c, kpe], dim=-1)
