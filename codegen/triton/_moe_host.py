"""Host side of the grouped expert GEMMs (moe_grouped_gemm.py; moe_tail.py uses some of it too): operand
checks and the kernel arguments of expert weights (`_weight`, `_kernel_weight`: W_FMT code, strides,
the int16 view of packed bytes, WIDE), the storage name of an operand (`storage`), the target's compute
capability (`target_cc`), the tile-count bound of the grid (`max_tiles`) and K-step fitting (`_fit_bk`).
No kernels, not a kernel family (no TEMPLATES).

Weights (w1, w3 [E, I, l]; w2 [E, l, I]) are either float tensors (bf16/fp16/fp32, cast to z's
dtype per tile) or `PackedMXFP4` (packed u8 [E, N, K/2], low nibble = even element; scales u8
E8M0 [E, N, K/32]), read as stored and dequantised in registers (config DEQ):
  - "asm16" (bf16 activations, sm_90): the packed bytes read as int16 elements of four codes
    (_moe_tiles.E2M1_ASM16: one shift and mask per field and a bf16x2 multiply by 2^(s-1) give code c
    of two elements); K columns come out as four tiles (4j + c), the activations split alike.
  - "asm16i" (the T=64 decode default, DECODE_T64: 0.997 vs 1.012 ms with asm16): asm16 with its left shifts
    as integer multiplies (IMAD, the FMA pipe) by powers of two the compiler cannot fold
    (_moe_tiles.E2M1_ASM16I): fewer ALU-pipe instructions.
  - "asm" (bf16, sm_90): two bytes per PTX instance (_moe_tiles.E2M1_ASM), even and odd K columns.
    In both, Triton moves the layout conversion onto the packed tile (cp.async to shared memory, then
    narrow loads in the MMA operand layout): the decoded tile never passes through shared memory.
  - "bytes" / "bytes16" (any target, the interpreter): the same bit placements in Triton ops; fp32
    activations: magnitude -> bits 11..9 of an fp16 (value * 2^-14, exact), then fp32 * 2^(s-113).
  - "dot_scaled" (sm_100 on): Triton's own upcast, tl.dot_scaled(.., "e2m1", z, None, "bf16") (the
    block-scaled kind::mxf4 MMA needs fp8/fp4 activations, which would change the numerics).
  Exact for scale bytes 0..240 (fp32), 0..128 (bf16; 1..254 when some byte exceeds 128: WIDE, an extra
  multiply by 2^126); the NaN byte 255 is not propagated.
"""

from __future__ import annotations

import torch
import triton.language as tl

from codegen.triton._moe_tiles import DENSE, MX_ASM, MX_ASM16, MX_ASM16I, MX_BYTES, MX_BYTES16, MX_DOT_SCALED
from ir.packed import PackedMXFP4

DEQ_MODES = {"bytes": MX_BYTES, "dot_scaled": MX_DOT_SCALED, "asm": MX_ASM, "bytes16": MX_BYTES16, "asm16": MX_ASM16,
             "asm16i": MX_ASM16I}
_BYTE_DECODE = {"asm16": "asm", "asm16i": "asm", "bytes16": "bytes"}      # what a 16-bit-word decode falls back to
_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def target_cc(target) -> int | None:
    """Compute capability as major·10 + minor: from a target name ("h200": its triton-nvidia:sm_XX
    backend), a dict/object with `compute_capability`, or (target None) the live GPU; None for CPU."""
    if isinstance(target, str):
        try:
            from k31c.targets import get_target
            backends = get_target(target).backends
        except (ValueError, OSError):
            return None
        sms = [int(b.split("sm_")[1].rstrip("a")) for b in backends if b.startswith("triton-nvidia:sm_")]
        return sms[0] if sms else None
    cc = target.get("compute_capability") if isinstance(target, dict) else getattr(target, "compute_capability", None)
    if cc is None:
        if target is None and torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return major * 10 + minor
        return None
    if isinstance(cc, (tuple, list)):
        return int(cc[0]) * 10 + int(cc[1])
    return int(round(float(cc) * 10)) if float(cc) < 20 else int(cc)


def storage(x) -> str:
    """'mxfp4' | 'bf16' | 'f32' | 'f16' | other dtype name, for a tensor, a PackedMXFP4, a meta tensor
    standing for a packed param (uint8 of the logical shape, as the compiler binds them) or a TensorType."""
    if isinstance(x, PackedMXFP4):
        return "mxfp4"
    if isinstance(x, torch.Tensor):
        return "mxfp4" if x.dtype == torch.uint8 else {torch.bfloat16: "bf16", torch.float32: "f32",
                                                          torch.float16: "f16"}.get(x.dtype, str(x.dtype))
    return getattr(getattr(x, "dtype", None), "name", type(x).__name__)

def _weight(w, name: str, shape: tuple) -> tuple[str, torch.Tensor, torch.Tensor | None]:
    """('mxfp4', packed, scales) | ('dense', tensor, None), checking the logical shape [E, N, K]."""
    if isinstance(w, PackedMXFP4):
        fmt, q, s = "mxfp4", w.packed, w.scales
        if q.stride(-1) != 1 or s.stride(-1) != 1:
            raise ValueError(f"{name}: MXFP4 packed/scales must be contiguous along K")
    elif isinstance(w, torch.Tensor) and w.is_floating_point():
        fmt, q, s = "dense", (w if w.stride(-1) == 1 else w.contiguous()), None
    else:
        raise TypeError(f"{name}: expected a float tensor or PackedMXFP4, found {type(w).__name__}"
                        f"{'' if not isinstance(w, torch.Tensor) else ' of ' + str(w.dtype)}")
    if tuple(w.shape) != tuple(shape):
        raise ValueError(f"{name}: expected logical shape {list(shape)}, found {list(w.shape)}")
    return fmt, q, s


_WIDE_CACHE: dict = {}


def _wide_scales(s: torch.Tensor) -> bool:
    """True when some E8M0 byte exceeds 128 (a block scale above 2): the single-multiply bf16 decode
    (factor 2^(s-1)) would overflow there, so the kernel multiplies twice. Checked once per tensor
    version; while a CUDA graph is being captured an unchecked tensor is taken as wide."""
    key = (s.data_ptr(), tuple(s.shape), s._version)
    hit = _WIDE_CACHE.get(key)
    if hit is None:
        if s.is_cuda and torch.cuda.is_current_stream_capturing():
            return True
        hit = _WIDE_CACHE[key] = bool((s > 128).any())
    return hit


def _kernel_weight(fmt: str, q: torch.Tensor, s: torch.Tensor | None, deq: str, act_dtype):
    """(W_FMT code, weight arg, scale arg, (stride_e, stride_n, scale stride_e, scale stride_n), WIDE)."""
    if fmt == "dense":
        return DENSE, q, q, (q.stride(0), q.stride(1), 0, 0), False
    if deq not in DEQ_MODES:
        raise ValueError(f"DEQ must be one of {sorted(DEQ_MODES)}, found {deq!r}")
    code = DEQ_MODES[deq]
    if code in (MX_DOT_SCALED, MX_ASM, MX_ASM16, MX_ASM16I) and act_dtype != torch.bfloat16:
        raise ValueError(f"DEQ={deq} needs bf16 activations, found {act_dtype}")
    q16 = _int16_view(q) if code in (MX_BYTES16, MX_ASM16, MX_ASM16I) else q      # 16-bit words: 4 codes each
    code, q = (code, q16) if q16 is not None else (DEQ_MODES[_BYTE_DECODE[deq]], q)
    wide = act_dtype == torch.bfloat16 and code != MX_DOT_SCALED and _wide_scales(s)
    return code, q, s, (q.stride(0), q.stride(1), s.stride(0), s.stride(1)), wide


def scale_words(sl: int, code: int, s: torch.Tensor, st: tuple) -> tuple[int, torch.Tensor, tuple]:
    """(SL, scale arg, strides) for a grouped kernel: SL=2 reads the E8M0 bytes [E, N, K/32] as int32 words
    [E, N, K/128] (strides in words), so the pipeliner streams them with cp.async (_moe_tiles._top_scales);
    when the bytes cannot be viewed so (K/32 not a multiple of 4, misaligned) or the weights are dense,
    the kernel reads single bytes at the top of the step (SL=1)."""
    if sl != 2:
        return sl, s, st
    w = _int32_view(s) if code != DENSE else None
    if w is None:
        return 1, s, st
    return 2, w, (st[0], st[1], w.stride(0), w.stride(1))


def _int16_view(q: torch.Tensor) -> torch.Tensor | None:
    """Packed MXFP4 bytes [E, N, K/2] as int16 [E, N, K/4], or None when the storage is not 2-byte aligned."""
    try:
        return None if q.shape[-1] % 2 or q.data_ptr() % 2 else q.view(torch.int16)
    except RuntimeError:        # a stride or the storage offset is odd
        return None


def max_tiles(pairs: int, experts: int, bm: int) -> int:
    """Upper bound on the BM-row tiles of `pairs` routed pairs over `experts` experts:
    Σ_e ceil(c_e / BM) <= floor((P + live·(BM-1)) / BM), live <= min(E, P) experts with tokens."""
    return (pairs + min(experts, pairs) * (bm - 1)) // bm


def _fit_bk(bk: int, K: int, mx: bool) -> int:
    while bk > (32 if mx else 16) and bk > K:
        bk //= 2
    return bk


# ---- the per-pair decode path's operands (_moe_gemv.py) ----
def _int32_view(q: torch.Tensor) -> torch.Tensor | None:
    """Packed MXFP4 bytes [E, N, K/2] as int32 words [E, N, K/8], or None when not 4-byte aligned."""
    try:
        return None if q.shape[-1] % 4 or q.data_ptr() % 4 else q.view(torch.int32)
    except RuntimeError:        # a stride or the storage offset is not a multiple of 4 bytes
        return None


def _gemv_weight(w, name: str, shape: tuple, mma: str | None, act_dtype):
    """(MX, weight arg, scale arg, (stride_e, stride_n, scale stride_e, scale stride_n), W_FMT, WIDE) or None
    when the packed bytes cannot be read as int32 words. mma: None (FFMA path: int32 words) or the DEQ
    mode of _moe_host._kernel_weight whose operands the MMA step reads."""
    fmt, q, s = _weight(w, name, shape)
    if mma is not None:
        code, qa, sa, st, wide = _kernel_weight(fmt, q, s, mma, act_dtype)
        return fmt == "mxfp4", qa, sa, st, code, wide
    if fmt == "dense":
        return False, q, q, (q.stride(0), q.stride(1), 0, 0), 0, False
    q32 = _int32_view(q)
    if q32 is None:
        return None
    return True, q32, s, (q32.stride(0), q32.stride(1), s.stride(0), s.stride(1)), 0, False


def gemv_supported(w1, w2, w3) -> bool:
    """The GEMV path reads MXFP4 bytes as int32 words: every packed weight must allow that view."""
    for w in (w1, w2, w3):
        q = getattr(w, "packed", None)
        if q is not None and (q.stride(-1) != 1 or _int32_view(q) is None):
            return False
    return True


def _step(gk: int, K: int, least: int) -> int:
    """K columns per step: GK (at least `least`), halved while a half still covers K."""
    gk = max(least, int(gk))
    while gk > least and gk // 2 >= K:
        gk //= 2
    return gk
