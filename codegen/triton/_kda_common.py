"""Pieces shared by the KDA kernel families (`kda_prefill.py`, `kda_decode.py`): the forget-gate math
(SPEC §3.4, both variants) as a Triton function, the standalone gate kernel behind the `kda_gate`
template, the chunk tables of the chunked prefill (cut every 64 tokens from each request's start,
and also at requested checkpoint positions), its small tile helpers (64-row chunks as four 16-row
sub-blocks) and the phase-1 row-block products of its intra-chunk kernel (`_row_block`, `_diag_exact`);
the fused decode's tile helpers (conv taps, causal conv + SiLU over token groups, conv tails, the gated
RMSNorm store) and host helpers (its operand names and binding, `supports`, split-V arrival counters, the
gate GEMM, operand row views).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 64
BC = tl.constexpr(16)  # sub-block rows of the chunked prefill
_SAFE_SPAN = tl.constexpr(60.0)  # max |decay within a sub-block| for the factorised diagonal block


@triton.jit
def kda_gate_math(x, a, lower_bound, GATE: tl.constexpr):
    """x = f + dt_bias, a = exp(A_log[h]) (fp32). GATE 1: lower_bound*sigmoid(a x); 2: -a*softplus(x)
    (torch threshold 20; log1p(e) by its series for small e so tiny gates keep their precision)."""
    if GATE == 1:
        return lower_bound * tl.sigmoid(a * x)
    else:
        e = tl.exp(-tl.abs(x))
        l1p = tl.where(e < 1e-3, e * (1.0 - e * (0.5 - e / 3.0)), tl.log(1.0 + e))
        return -a * tl.where(x > 20.0, x, tl.maximum(x, 0.0) + l1p)


@triton.jit
def _kda_gate_kernel(f, s_f, alog, dtb, g, n, lower_bound, P: tl.constexpr, D: tl.constexpr,
                     BLOCK: tl.constexpr, GATE: tl.constexpr, HAS_BIAS: tl.constexpr):
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = idx < n
    t, c = idx // P, idx % P
    x = tl.load(f + t * s_f + c, mask=m, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(dtb + c, mask=m, other=0.0).to(tl.float32)
    a = tl.exp(tl.load(alog + c // D, mask=m, other=0.0).to(tl.float32))
    tl.store(g + idx, kda_gate_math(x, a, lower_bound, GATE), mask=m)


def kda_gate(f, A_log, dt_bias, lower_bound, block: int = 1024):
    """g [T, H, D] fp32 = kda_gate(f [T, H*D], A_log [H], dt_bias [H*D] | None) (see `ir.ref.kda`)."""
    T, P = f.shape
    H = A_log.numel()
    f2 = f if f.stride(1) == 1 else f.contiguous()
    g = torch.empty(T, H, P // H, device=f.device, dtype=torch.float32)
    n = T * P
    dtb = dt_bias if dt_bias is not None else A_log
    _kda_gate_kernel[(max(1, triton.cdiv(n, block)),)](
        f2, f2.stride(0), A_log, dtb, g, n, float(lower_bound) if lower_bound is not None else 0.0,
        P=P, D=P // H, BLOCK=block, GATE=1 if lower_bound is not None else 2, HAS_BIAS=dt_bias is not None)
    return g


@triton.jit
def _chunk_table_kernel(cu, start, length, req_chunks, R, n_max, RB: tl.constexpr, CB: tl.constexpr,
                        CHUNK: tl.constexpr):
    """One program: req_chunks = [0, cumsum(ceil(len_r / 64))], then every request's chunks (start, length)
    and length 0 for the unused tail of the n_max entries."""
    r = tl.arange(0, RB)
    lo = tl.load(cu + r, mask=r < R, other=0)
    hi = tl.load(cu + r + 1, mask=r < R, other=0)
    n_r = (hi - lo + CHUNK - 1) // CHUNK
    ends = tl.cumsum(n_r, axis=0)
    tl.store(req_chunks + r + 1, ends.to(tl.int32), mask=r < R)
    tl.store(req_chunks + r, 0, mask=r == 0)
    total = tl.sum(n_r, axis=0)
    c = tl.arange(0, CB)
    for rr in range(0, R):
        a = tl.load(cu + rr)
        b = tl.load(cu + rr + 1)
        first = tl.sum(tl.where(r == rr, ends - n_r, 0), axis=0)
        for c0 in range(0, (b - a + CHUNK - 1) // CHUNK, CB):
            s = a + (c0 + c) * CHUNK
            m = s < b
            tl.store(start + first + c0 + c, s.to(tl.int32), mask=m)
            tl.store(length + first + c0 + c, tl.minimum(b - s, CHUNK).to(tl.int32), mask=m)
    for c0 in range(total, n_max, CB):
        tl.store(length + c0 + c, 0, mask=c0 + c < n_max)
        tl.store(start + c0 + c, 0, mask=c0 + c < n_max)


def device_chunk_table(cu: torch.Tensor, n_tokens: int):
    """Chunks cut every 64 tokens from each request's start, built on the device by one kernel (no host
    sync): (chunk_start[N], chunk_len[N] (0 for the unused tail of the upper bound N), req_chunks[R+1])."""
    R = cu.numel() - 1
    n_max = max(1, (n_tokens + (CHUNK - 1) * R) // CHUNK)  # >= sum_r ceil(len_r / 64)
    buf = torch.empty(2 * n_max + R + 1, dtype=torch.int32, device=cu.device)
    start, length, req_chunks = buf[:n_max], buf[n_max:2 * n_max], buf[2 * n_max:]
    _chunk_table_kernel[(1,)](cu, start, length, req_chunks, R, n_max, RB=triton.next_power_of_2(max(R, 1)),
                              CB=256 if n_max > 64 else 64, CHUNK=CHUNK)
    return start, length, req_chunks


def host_chunk_table(cu: list[int], positions: list[list[int]], device):
    """Chunks cut at every requested checkpoint position too; ck_index[c] = checkpoint written after
    chunk c (-1: none). Returns the table and, per request, the checkpoint row of each position."""
    starts, lens, ck, req_chunks, rows_of = [], [], [], [0], []
    n_ck = 0
    for r in range(len(cu) - 1):
        n = cu[r + 1] - cu[r]
        pos = [int(p) for p in positions[r]]
        bad = [p for p in pos if not 0 < p <= n]
        if bad:
            raise ValueError(f"kda_prefill: checkpoint positions {bad} of request {r} not in 1..{n} "
                             f"(position 0 is the initial state: read the pool row)")
        cut_row = {}
        seg = 0
        for cut in sorted(set(pos)):
            for s in range(seg, cut, CHUNK):
                starts.append(cu[r] + s)
                lens.append(min(CHUNK, cut - s))
                ck.append(-1)
            ck[-1], cut_row[cut] = n_ck, n_ck
            n_ck, seg = n_ck + 1, cut
        for s in range(seg, n, CHUNK):
            starts.append(cu[r] + s)
            lens.append(min(CHUNK, n - s))
            ck.append(-1)
        req_chunks.append(len(starts))
        rows_of.append([cut_row[p] for p in pos])
    t = lambda x: torch.tensor(x or [0], dtype=torch.int32, device=device)  # noqa: E731
    return t(starts), t(lens), t(req_chunks), t(ck), n_ck, rows_of


# ---- tile helpers of the fused decode (`kda_decode.py`)
@triton.jit
def _conv_silu(x, s_x, cst, C3, cw, bos, t0, nt, ch, KW: tl.constexpr, MAXT: tl.constexpr):
    """silu(causal depthwise conv) of tokens t0..t0+MAXT-1 (rows >= nt are 0) for channels ch, one tap at a time
    (weights loaded where used); the context before the request's first new token comes from its conv-state row
    `cst`."""
    tt = tl.arange(0, MAXT)
    acc = tl.zeros([MAXT, ch.shape[0]], dtype=tl.float32)
    for j in tl.static_range(KW):
        src = t0 + tt - (KW - 1) + j
        ok = tt < nt
        xv = tl.load(x + (bos + src)[:, None] * s_x + ch[None, :], mask=(ok & (src >= 0))[:, None], other=0.0)
        sv = tl.load(cst + (src + KW - 1)[:, None] * C3 + ch[None, :], mask=(ok & (src < 0))[:, None], other=0.0)
        acc += (xv.to(tl.float32) + sv.to(tl.float32)) * tl.load(cw + ch * KW + j).to(tl.float32)[None, :]
    return acc * tl.sigmoid(acc)


@triton.jit
def _conv_weights(cw, ch, KW: tl.constexpr, KWP: tl.constexpr):
    """Depthwise conv taps of channels ch as a [KWP, len(ch)] fp32 tile (rows >= K are 0): weights, so
    they are loaded before the grid-dependency wait."""
    j = tl.arange(0, KWP)
    return tl.load(cw + ch[None, :] * KW + j[:, None], mask=(j < KW)[:, None], other=0.0).to(tl.float32)


@triton.jit
def _conv_silu_w(x, s_x, cst, C3, wt, bos, t0, nt, ch, KW: tl.constexpr, MAXT: tl.constexpr):
    """`_conv_silu` with the taps given (wt from `_conv_weights`, loaded before the PDL wait) and all K taps of
    the inputs loaded as one [MAXT, KWP, len(ch)] tile."""
    tt = tl.arange(0, MAXT)[:, None, None]
    j = tl.arange(0, wt.shape[0])[None, :, None]
    c = ch[None, None, :]
    src = t0 + tt - (KW - 1) + j
    ok = (tt < nt) & (j < KW)
    xv = tl.load(x + (bos + src) * s_x + c, mask=ok & (src >= 0), other=0.0).to(tl.float32)
    sv = tl.load(cst + (src + KW - 1) * C3 + c, mask=ok & (src < 0), other=0.0).to(tl.float32)
    acc = tl.sum((xv + sv) * wt[None, :, :], axis=1)
    return acc * tl.sigmoid(acc)


@triton.jit
def _tail(x, s_x, cst, C3, bos, src0, ch, KW: tl.constexpr, KWP: tl.constexpr):
    """Context rows src0 .. src0+K-2 (inputs, or conv-state rows for src < 0): [KWP, len(ch)]."""
    j = tl.arange(0, KWP)
    src = src0 + j
    ok = j < KW - 1
    xv = tl.load(x + (bos + src)[:, None] * s_x + ch[None, :], mask=(ok & (src >= 0))[:, None], other=0.0)
    sv = tl.load(cst + (src + KW - 1)[:, None] * C3 + ch[None, :], mask=(ok & (src < 0))[:, None], other=0.0)
    return xv.to(tl.float32) + sv.to(tl.float32)


@triton.jit
def _put_tail(dst, C3, ch, val, KW: tl.constexpr, KWP: tl.constexpr):
    j = tl.arange(0, KWP)
    tl.store(dst + j[:, None] * C3 + ch[None, :], val.to(dst.dtype.element_ty), mask=(j < KW - 1)[:, None])


@triton.jit
def _row(x2, t):
    """Row t of a [MAXT, n] tile."""
    return tl.sum(tl.where((tl.arange(0, x2.shape[0]) == t)[:, None], x2, 0.0), axis=0)


@triton.jit
def _gated_rms_store(o2, rows, rm, z, nw, out, ch, norm_eps, D: tl.constexpr, P: tl.constexpr):
    """out = rmsnorm(o2) * o_norm_w * sigmoid(z) for the [MAXT, D] outputs of one head (z: the gate
    projection's tile, nw: o_norm_w or ones, both loaded ahead by the caller)."""
    y = o2 / tl.sqrt(tl.sum(o2 * o2, axis=1) / D + norm_eps)[:, None] * tl.sigmoid(z) * nw[None, :]
    tl.store(out + rows[:, None] * P + ch[None, :], y.to(out.dtype.element_ty), mask=rm)


# ---- host helpers of the fused decode (`kda_decode.py`)
FUSED_OP = "fused.kda_decode"
OPERANDS = ("q", "k", "v", "q_conv", "k_conv", "v_conv", "conv_state", "f_a", "f_b", "A_log", "dt_bias", "b",
            "state", "gate", "o_norm_w", "state_slot", "cu_seqlens")


def fused_operands(a) -> dict:
    """Bound operands of the fused node: `a.operands` (list, as codegen binds fused ops) or names."""
    ops = getattr(a, "operands", None)
    if ops is None:
        return {n: getattr(a, n) for n in OPERANDS}
    if len(ops) != len(OPERANDS):
        raise ValueError(f"{FUSED_OP} takes {len(OPERANDS)} operands ({', '.join(OPERANDS)}), got {len(ops)}")
    return dict(zip(OPERANDS, ops))


def supports(a, attrs, target):
    """The fused decode template's `supports`: static power-of-two head dims in 16..256, scale and norm_eps."""
    o = fused_operands(a)
    try:
        H, P = int(o["A_log"].shape[0]), int(o["q"].shape[1])
    except TypeError:
        return "head count and projection width must be static"
    D = P // H
    if P != H * D or D < 16 or D > 256 or D & (D - 1):
        return f"head dim must be a power of two in 16..256, got width {P} for {H} heads"
    missing = [x for x in ("scale", "norm_eps") if x not in attrs]
    return f"attrs {missing} are required" if missing else None


_COUNTERS: dict = {}  # device -> int32 arrival counters of the split-V programs, zero between launches


def _counters(device, n: int) -> torch.Tensor:
    """Per-(request, head) arrival counters, zero after each launch: one buffer per device serves launches on
    one stream in order. Made by the first split launch: run one before capturing a CUDA graph (warm-up does)."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


def _gate_gemm(f_a: torch.Tensor, f_b: torch.Tensor) -> torch.Tensor:
    """f = f_a f_b^T [T, P] in fp32 (bf16 operands, fp32 accumulation and output on CUDA)."""
    if f_a.is_cuda and f_a.dtype in (torch.bfloat16, torch.float16) and f_b.dtype == f_a.dtype:
        try:
            return torch.mm(f_a, f_b.t(), out_dtype=torch.float32)
        except (TypeError, RuntimeError):  # torch without mm(out_dtype=): fp32 operands
            pass
    return f_a.float() @ f_b.float().t()


def _rows(x: torch.Tensor, T: int, width: int, what: str) -> torch.Tensor:
    if x.shape[0] != T or x.numel() != T * width:
        raise ValueError(f"kda_decode: {what} has shape {tuple(x.shape)}, expected [{T}, {width}]")
    x = x.reshape(T, width)
    return x if x.stride(1) == 1 else x.contiguous()
