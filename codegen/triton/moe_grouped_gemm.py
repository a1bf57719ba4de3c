"""Grouped expert GEMMs for IR op `moe_experts` (SPEC §6), MXFP4 weights read exactly as loaded.

    y[t] = Σ_j w[t,j] · W2_e act(W1_e z_t, W3_e z_t),   e = ids[t,j]
    act = SiTU-GLU  β1·tanh(a/β1)·sigmoid(a) · β2·tanh(u/β2)   (β2 absent: · u)   | SwiGLU silu(a)·u

Pipeline (no host sync, deterministic, no atomics):
  1. `permute_tokens` (moe_router.py): routed pairs p = t·k + j grouped by expert.
  2. gate-up kernel: a tile = BM consecutive pairs of one expert × BN columns of I; w1 and w3 tiles are
     read in the same K loop (two accumulators) and act(a, u) is applied in the epilogue;
     h [T·k, I] is written in expert-sorted row order.
  3. down kernel: the same tiling over h and W2_e; per-pair outputs o [T·k, ℓ] stored at row p.
  4. combine kernel (moe_tail.py): y[t] = Σ_j w[t,j]·o[t·k+j] in slot order, fp32 (pairs whose id
     is outside [0, E), i.e. held by another EP rank, contribute 0).
Tiles exist only for experts with tokens: program `tid` finds its expert from the per-expert tile
counts ceil(count_e / BM) (a cumsum over E in registers); programs past the last tile exit at once,
so experts with no tokens launch no work. No split-K: every output element's reduction runs over
K in BK steps in one program, so with a config fixed independently of T (`batch_invariant`) a
token's result does not depend on the batch. Tiles are computed transposed (weights × tokens, see
_moe_tiles.py): on sm_90 a decode tile of 16 tokens still runs on wgmma (M = BN weight rows).

Weights (w1, w3 [E, I, ℓ]; w2 [E, ℓ, I]) are either float tensors (bf16/fp16/fp32, cast to z's
dtype per tile) or `PackedMXFP4` (packed u8 [E, N, K/2], low nibble = even element; scales u8
E8M0 [E, N, K/32]), read as stored and dequantised in registers (config DEQ):
  - "asm" (bf16 activations, sm_90): two bytes per PTX instance (_moe_tiles.E2M1_ASM): a byte
    permute, shifts and masks put each code's sign and e e m bits into a bf16x2 register (the E2M1
    value · 2^-126) and one bf16x2 multiply applies the block factor 2^(s-1): 2.25 instructions per
    weight element. Triton moves the layout conversion onto the packed bytes (cp.async to shared
    memory, then 16-bit loads in the wgmma operand layout), so the decoded tile never leaves registers.
  - "bytes" (any target, the interpreter): the same bit placement in Triton ops on int32 lanes;
    fp32 activations: magnitude -> bits 11..9 of an fp16 (value · 2^-14, exact), then fp32 · 2^(s-113).
  - "dot_scaled": `tl.dot_scaled(packed, scales, "e2m1", z, None, "bf16", fast_math=True)`: Triton's
    own upcast (sm_100 lowers it to tcgen05 kind::f16; the block-scaled kind::mxf4 MMA needs fp8/fp4
    activations, which would change the numerics). The heuristic takes it from sm_100 on.
  Each byte's two codes become the even and odd K columns of the tile, dotted against the even and
  odd activation columns (no interleave). Exact for scale bytes 0..240 (fp32), 0..128 (bf16; 1..254
  when some byte exceeds 128: WIDE, an extra multiply by 2^126); the NaN byte 255 is not propagated.
H200, bf16, E=112, top-16, ℓ=3584, I=3072 (benches/results/h200-2026-11-29/moe.json): decode T=64
reads 1.9 GB of MXFP4 weights of the 108 live experts in 1.34 ms (1.42 TB/s, 31% of the 4.61 TB/s
read ceiling; "bytes" 1.51 ms, "dot_scaled" 2.14 ms; the same tiling on bf16 weights streams 7.1 GB
at 4.27 TB/s, 93%); the decode, ~3.9 instructions per weight element with the loop, leaves the SMs
issue-bound at low IPC, each tile waiting on its register-operand wgmma. Prefill T=8192: 328 TFLOP/s
MXFP4 (47% of the 694 TFLOP/s bf16 matmul, 26% of fp8's 1270), 472 TFLOP/s on bf16 weights.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from codegen.kernel import KernelTemplate, Tunable, pow2_bucket
from codegen.triton._moe_tiles import (DENSE, MX_ASM, MX_BYTES, MX_DOT_SCALED, _glu, _load_bt, _locate_tile,
                                      _mma_step_t, _swizzle)
from codegen.triton.moe_router import ExpertSegments, permute_tokens
from ir.packed import PackedMXFP4

DEQ_MODES = {"bytes": MX_BYTES, "dot_scaled": MX_DOT_SCALED, "asm": MX_ASM}


@triton.jit
def _moe_gate_up_kernel(z_ptr, pair_ptr, counts_ptr, offsets_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, h_ptr,
                        E, ELL, INTER, stride_z, stride_we, stride_wn, stride_se, stride_sn, stride_h,
                        beta1, beta2, N_TILES, TOPK: tl.constexpr, E_PAD: tl.constexpr, W_FMT: tl.constexpr,
                        ACT: tl.constexpr, HAS_BETA2: tl.constexpr, IEEE: tl.constexpr, DT: tl.constexpr,
                        WIDE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        GROUP_M: tl.constexpr):
    tid, nb = _swizzle(tl.program_id(0), N_TILES, tl.cdiv(INTER, BN), GROUP_M)
    total, e, row0, m0, rows = _locate_tile(counts_ptr, offsets_ptr, tid, E, E_PAD, BM)
    if tid >= total:
        return
    rm = m0 + tl.arange(0, BM)
    row_ok = rm < rows
    pos = row0 + rm
    tok = tl.load(pair_ptr + pos, mask=row_ok, other=0) // TOPK
    rn = nb * BN + tl.arange(0, BN)
    n_ok = rn < INTER
    rows_ptr = z_ptr + tok.to(tl.int64)[:, None] * stride_z
    wbase = e.to(tl.int64) * stride_we
    sbase = e.to(tl.int64) * stride_se
    acc1 = tl.zeros([BN, BM], dtype=tl.float32)
    acc3 = tl.zeros([BN, BM], dtype=tl.float32)
    for k0 in range(0, ELL, BK):
        b, b_odd = _load_bt(rows_ptr, row_ok, k0, ELL, W_FMT, DT, BK)
        acc1 = _mma_step_t(acc1, b, b_odd, w1_ptr, s1_ptr, wbase, sbase, rn, n_ok, k0, ELL, stride_wn, stride_sn,
                           BN, BK, W_FMT, IEEE, DT, WIDE)
        acc3 = _mma_step_t(acc3, b, b_odd, w3_ptr, s3_ptr, wbase, sbase, rn, n_ok, k0, ELL, stride_wn, stride_sn,
                           BN, BK, W_FMT, IEEE, DT, WIDE)
    h = _glu(acc1, acc3, beta1, beta2, ACT, HAS_BETA2)                                   # [BN, BM]
    tl.store(h_ptr + pos.to(tl.int64)[None, :] * stride_h + rn[:, None], h.to(DT),
             mask=n_ok[:, None] & row_ok[None, :])


@triton.jit
def _moe_down_kernel(h_ptr, pair_ptr, counts_ptr, offsets_ptr, w2_ptr, s2_ptr, o_ptr,
                     E, ELL, INTER, stride_h, stride_we, stride_wn, stride_se, stride_sn, stride_o, N_TILES,
                     E_PAD: tl.constexpr, W_FMT: tl.constexpr, IEEE: tl.constexpr, DT: tl.constexpr,
                     WIDE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     GROUP_M: tl.constexpr):
    tid, nb = _swizzle(tl.program_id(0), N_TILES, tl.cdiv(ELL, BN), GROUP_M)
    total, e, row0, m0, rows = _locate_tile(counts_ptr, offsets_ptr, tid, E, E_PAD, BM)
    if tid >= total:
        return
    rm = m0 + tl.arange(0, BM)
    row_ok = rm < rows
    pos = row0 + rm
    pair = tl.load(pair_ptr + pos, mask=row_ok, other=0)
    rn = nb * BN + tl.arange(0, BN)
    n_ok = rn < ELL
    rows_ptr = h_ptr + pos.to(tl.int64)[:, None] * stride_h
    wbase = e.to(tl.int64) * stride_we
    sbase = e.to(tl.int64) * stride_se
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    for k0 in range(0, INTER, BK):
        b, b_odd = _load_bt(rows_ptr, row_ok, k0, INTER, W_FMT, DT, BK)
        acc = _mma_step_t(acc, b, b_odd, w2_ptr, s2_ptr, wbase, sbase, rn, n_ok, k0, INTER, stride_wn, stride_sn,
                          BN, BK, W_FMT, IEEE, DT, WIDE)
    tl.store(o_ptr + pair.to(tl.int64)[None, :] * stride_o + rn[:, None], acc.to(o_ptr.dtype.element_ty),
             mask=n_ok[:, None] & row_ok[None, :])


# ------------------------------------------------------------------------------------------ host
_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


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
    if code in (MX_DOT_SCALED, MX_ASM) and act_dtype != torch.bfloat16:
        raise ValueError(f"DEQ={deq} needs bf16 activations, found {act_dtype}")
    wide = act_dtype == torch.bfloat16 and code != MX_DOT_SCALED and _wide_scales(s)
    return code, q, s, (q.stride(0), q.stride(1), s.stride(0), s.stride(1)), wide


def expert_pair_outputs(z: torch.Tensor, ids: torch.Tensor, w1, w2, w3, act: str, beta1: float | None = None,
                        beta2: float | None = None, config: dict | None = None,
                        segments: ExpertSegments | None = None) -> tuple[torch.Tensor, ExpertSegments]:
    """o [T·k, ℓ] (z's dtype): o[t·k+j] = W2_e act(W1_e z_t, W3_e z_t), e = ids[t,j]; rows of pairs
    whose expert is outside [0, E) are left unwritten (the combine skips them)."""
    if act not in ("situ", "silu"):
        raise ValueError(f"expert activation must be 'situ' or 'silu', found {act!r}")
    if z.dim() != 2 or ids.dim() != 2 or ids.shape[0] != z.shape[0]:
        raise ValueError(f"experts: z must be [T, l] and ids [T, k], found {tuple(z.shape)} and {tuple(ids.shape)}")
    if z.dtype not in _TL:
        raise ValueError(f"experts: z dtype {z.dtype} is not bf16/fp16/fp32")
    T, ell = z.shape
    E, inter = int(w1.shape[0]), int(w1.shape[1])
    f1, q1, s1 = _weight(w1, "w1", (E, inter, ell))
    f3, q3, s3 = _weight(w3, "w3", (E, inter, ell))
    f2, q2, s2 = _weight(w2, "w2", (E, ell, inter))
    if f1 != f3 or (s1 is None and q1.stride() != q3.stride()) or (s1 is not None and (
            q1.stride() != q3.stride() or s1.stride() != s3.stride())):
        raise ValueError("experts: w1 and w3 must share storage format and strides (read in one pass)")
    K = ids.shape[1]
    cfg = {**heuristic(_key(T, E, K, ell, inter, f1 == "mxfp4", z.dtype, config or {}), None), **(config or {})}
    z = z if z.stride(-1) == 1 else z.contiguous()
    seg = segments or permute_tokens(ids, E)
    P = T * K
    dt = _TL[z.dtype]
    h = torch.empty(max(P, 1), inter, dtype=z.dtype, device=z.device)
    o = torch.empty(max(P, 1), ell, dtype=z.dtype, device=z.device)
    if P == 0:
        return o[:0], seg
    e_pad = triton.next_power_of_2(E)
    bm = cfg["BM"]
    max_tiles = triton.cdiv(P, bm) + min(E, P)
    ieee = z.dtype == torch.float32
    launch = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    c1, a1, b1, st1, wide1 = _kernel_weight(f1, q1, s1, cfg["DEQ"], z.dtype)
    _, a3, b3, _, wide3 = _kernel_weight(f3, q3, s3, cfg["DEQ"], z.dtype)
    _moe_gate_up_kernel[(max_tiles * triton.cdiv(inter, cfg["BN"]),)](
        z, seg.pair_ids, seg.counts, seg.offsets, a1, a3, b1, b3, h, E, ell, inter, z.stride(0), *st1, h.stride(0),
        1.0 if beta1 is None else float(beta1), 1.0 if beta2 is None else float(beta2), max_tiles,
        TOPK=K, E_PAD=e_pad, W_FMT=c1, ACT=0 if act == "situ" else 1, HAS_BETA2=act == "situ" and beta2 is not None,
        IEEE=ieee, DT=dt, WIDE=wide1 or wide3, BM=bm, BN=cfg["BN"], BK=cfg["BK"], GROUP_M=cfg["GROUP_M"], **launch)
    c2, a2, b2, st2, wide2 = _kernel_weight(f2, q2, s2, cfg["DEQ"], z.dtype)
    _moe_down_kernel[(max_tiles * triton.cdiv(ell, cfg["BN2"]),)](
        h, seg.pair_ids, seg.counts, seg.offsets, a2, b2, o, E, ell, inter, h.stride(0), *st2, o.stride(0), max_tiles,
        E_PAD=e_pad, W_FMT=c2, IEEE=ieee, DT=dt, WIDE=wide2, BM=bm, BN=cfg["BN2"], BK=cfg["BK2"],
        GROUP_M=cfg["GROUP_M"], **launch)
    return o, seg


def moe_experts(z, weights, ids, w1, w2, w3, act: str, beta1=None, beta2=None, config: dict | None = None):
    """Drop-in for `ir.ref.moe.moe_experts`: y f32 [T, ℓ]."""
    from codegen.triton.moe_tail import combine  # the weighted combine lives with the tail (no import cycle)

    o, seg = expert_pair_outputs(z, ids, w1, w2, w3, act, beta1, beta2, config)
    return combine(o, weights, ids, seg.num_experts)


# --------------------------------------------------------------------------------------- template
BATCH_INVARIANT_CONFIG = {"BM": 64, "BN": 64, "BK": 64, "BN2": 64, "BK2": 64, "num_warps": 4, "num_stages": 3,
                          "GROUP_M": 8}


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


def _key(T, E, K, ell, inter, mx: bool, dtype, attrs) -> dict:
    return {"T": int(T), "E": int(E), "K": int(K), "L": int(ell), "I": int(inter), "MX": int(mx),
            "BF16": int(dtype == torch.bfloat16), "BI": int(bool(attrs.get("batch_invariant", False)))}


def key_dims(a, attrs) -> dict:
    T, ell = a.z.shape
    E, inter = a.w1.shape[0], a.w1.shape[1]
    return _key(T, E, a.ids.shape[1], ell, inter, storage(a.w1) == "mxfp4",
                torch.bfloat16 if storage(a.z) == "bf16" else torch.float32, attrs)


def bucket(key: dict) -> dict:
    """T to a power of two; in batch-invariant mode T is dropped: one config serves every batch."""
    return {**key, "T": 0 if key.get("BI") else pow2_bucket(key["T"])}


def _fit_bk(bk: int, K: int, mx: bool) -> int:
    while bk > (32 if mx else 16) and bk > K:
        bk //= 2
    return bk


def heuristic(key: dict, target=None) -> dict:
    """Tiles by tokens per expert (decode: one BM=16 tile of tokens per expert against 128 weight rows;
    prefill: 128 tokens × 64 weight rows), measured best on H200 (benches/bench_moe.py sweeps); in batch-invariant mode one fixed tiling. DEQ for MXFP4
    weights with bf16 activations: the PTX decode on sm_90 (wgmma takes the decoded tile from
    registers), tl.dot_scaled from sm_100 on; the pure-Triton decode elsewhere."""
    if key.get("BI"):
        cfg = dict(BATCH_INVARIANT_CONFIG)
    else:
        per_expert = key["T"] * key["K"] / max(1, key["E"])
        if per_expert <= 16:    # decode: weight-bandwidth bound, one tile of tokens per expert
            cfg = {"BM": 16, "BN": 128, "BK": 64, "BN2": 128, "BK2": 64, "num_warps": 4, "num_stages": 4}
        elif per_expert <= 96:
            cfg = {"BM": 64, "BN": 128, "BK": 64, "BN2": 128, "BK2": 64, "num_warps": 4, "num_stages": 3}
        else:                   # prefill: tensor-core bound
            cfg = {"BM": 128, "BN": 64, "BK": 64, "BN2": 128, "BK2": 64, "num_warps": 4, "num_stages": 3}
        cfg["GROUP_M"] = 8
    cc = target_cc(target)
    if key["MX"] and key["BF16"] and cc is not None and cc >= 90:
        cfg["DEQ"] = "asm" if cc < 100 else "dot_scaled"     # sm_100's tcgen05 takes no register operand
    else:
        cfg["DEQ"] = "bytes"
    cfg["BK"] = _fit_bk(cfg["BK"], key["L"], key["MX"])
    cfg["BK2"] = _fit_bk(cfg["BK2"], key["I"], key["MX"])
    return cfg


def constraints(config: dict, key: dict, target=None) -> list[str]:
    out = []
    mx = key["MX"]
    for bk in ("BK", "BK2"):
        if mx and config[bk] % 32:
            out.append(f"{bk}={config[bk]} must be a multiple of the MXFP4 block (32)")
    if config["DEQ"] in ("dot_scaled", "asm"):
        cc = target_cc(target)
        if not (mx and key["BF16"]):
            out.append(f"DEQ={config['DEQ']} needs MXFP4 weights and bf16 activations")
        if cc is None or cc < 90:
            out.append(f"DEQ={config['DEQ']} needs a CUDA target of compute capability >= 9.0, found {cc}")
    if key.get("BI") and any(config[k] != v for k, v in BATCH_INVARIANT_CONFIG.items()):
        out.append("batch_invariant: tiles are fixed to BATCH_INVARIANT_CONFIG")
    # per stage: the activation tile (twice for MXFP4: as loaded and split into even/odd columns) and the
    # w1, w3 tiles (MXFP4 half a byte per element, bf16 weights two)
    stage = config["BM"] * config["BK"] * 2 * (2 if mx else 1) + config["BN"] * config["BK"] * (1 if mx else 4)
    smem = config["num_stages"] * stage
    if smem > 220 * 1024:
        out.append(f"gate-up pipeline needs ~{smem // 1024} KiB of shared memory (> 220)")
    return out


def supports(a, attrs, target=None):
    """Operands may be tensors / PackedMXFP4 (run time) or TensorTypes (compile time)."""
    if attrs.get("act") not in ("situ", "silu"):
        return f"activation {attrs.get('act')!r} is not situ|silu"
    if storage(a.z) not in ("bf16", "f32", "f16"):
        return f"z is {storage(a.z)}, not bf16/f16/f32"
    kinds = {n: storage(getattr(a, n)) for n in ("w1", "w2", "w3")}
    bad = {n: k for n, k in kinds.items() if k not in ("mxfp4", "bf16", "f32", "f16")}
    if bad:
        return f"expert weights {bad} are neither float nor mxfp4"
    if (kinds["w1"] == "mxfp4") != (kinds["w3"] == "mxfp4"):
        return "w1 and w3 must share a storage format (they are read in one pass)"
    return None


def launch(a, attrs, config=None):
    cfg = dict(config or {})
    if attrs.get("batch_invariant"):
        cfg.setdefault("batch_invariant", True)
    cfg = {**heuristic(key_dims(a, {**attrs, **cfg}), None), **{k: v for k, v in cfg.items() if k != "batch_invariant"}}
    return moe_experts(a.z, a.weights, a.ids, a.w1, a.w2, a.w3, attrs["act"], attrs.get("beta1"), attrs.get("beta2"), cfg)


TEMPLATES = [KernelTemplate(
    family="moe_grouped_gemm", backend="triton", ops=("moe_experts",), launch=launch, key_dims=key_dims,
    heuristic=heuristic, bucket=bucket, constraints=constraints, supports=supports, batch_invariant=True,
    tunables=(Tunable("BM", (16, 32, 64, 128)), Tunable("BN", (32, 64, 128)), Tunable("BK", (32, 64, 128, 256)),
              Tunable("BN2", (32, 64, 128, 256)), Tunable("BK2", (32, 64, 128, 256)), Tunable("num_warps", (4, 8)),
              Tunable("num_stages", (2, 3, 4, 5)), Tunable("GROUP_M", (1, 4, 8, 16)),
              Tunable("DEQ", ("asm", "bytes", "dot_scaled"))),
    doc="grouped expert GEMMs: permutation, gate+up with fused SiTU-GLU/SwiGLU, down, fp32 slot-order combine; "
        "MXFP4 dequantised in registers (or tl.dot_scaled)")]
