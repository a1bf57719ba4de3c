"""Attention-Residual mixing (SPEC §2 `mix`): `attn_res_mix` and `fused.attn_res_mix_norm` (the prefix
add, the mix and the sublayer's RMSNorm after it; signature in passes/attn_res_fusion.py).

Per token row, candidates V = [bank_1..bank_n, prefix], w = mix_norm * proj:
    [prefix = prev + part]                                (fused prefix add, stored, then read rounded)
    score_i = (V_i . w) / sqrt(mean(V_i^2) + eps)        (= rmsnorm(V_i) . w, no gain)
    alpha   = softmax_i(score);   x = sum_i alpha_i V_i
    fused:  h = x / sqrt(mean(x^2) + norm_eps) * norm_w  (x rounded to its storage dtype first, as the
                                                          unfused rms_norm would read it)
One pass over the sources: the whole row (BLOCK_D >= d) of the running sum stays in registers and the
softmax is folded online (flash style), the prefix first, then the bank in order (the first PREFETCH bank
rows are loaded up front so their memory latencies overlap; per source the two sums V.w and V.V are one
two-value reduction):
    m' = max(m, s_i), acc = acc e^{m-m'} + e^{s_i-m'} V_i, l = l e^{m-m'} + e^{s_i-m'}, x = acc / l.
Each source row is read once; x (or h) and the prefix are written once.

EARLY (PDL, `_pdl.py`; the decode step's `fused.attn_res_mix_norm` with the prefix add): the prefetched bank rows and
`prev` are read, and the bank rows scored, before the grid-dependency wait; after it only the sublayer's output
`part` is read, and one reduction (the prefix's score) and the norm's remain. Legal because in the model's graph
those rows are written by earlier attention-residual nodes (or the embedding) with at least the sublayer's
kernels between, i.e. two or more launches back, which a PDL kernel may read before its wait (`_pdl.py`); the
unfused `attn_res_mix` (whose `last` may come from the launch just before) never takes it. The scores and the
fold are the same arithmetic in the same order, so both forms give the same bits. `set_early(False)` turns it
off (benches compare).

The sources arrive as separate tensors (no stacking copy): MAX_BANK bank pointers, N_BANK (constexpr)
of them live. Math in fp32 (fp64 for fp64 inputs). Every row is reduced on its own in an order fixed by
the config, which does not depend on the row count under `batch_invariant` (the key drops it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from codegen.kernel import KernelTemplate, Tunable, pow2_bucket
from codegen.triton._pdl import launch_kwargs, pdl_enter

MAX_BANK = 15
MAX_BLOCK_D = 16384
_early_on = True


def set_early(on: bool) -> bool:
    """Allow the EARLY form (module doc) where it is legal; returns the previous setting."""
    global _early_on
    before, _early_on = _early_on, bool(on)
    return before


@triton.jit
def _score(v, w, d, eps):
    dot, ss = tl.split(tl.sum(tl.join(v * w, v * v), axis=1))  # one reduction pass for both sums
    return dot / tl.sqrt(ss / d + eps)


@triton.jit
def _mix_step(v, w, acc, m, l, d, eps, FIRST: tl.constexpr):
    return _fold(v, _score(v, w, d, eps), acc, m, l, FIRST)


@triton.jit
def _fold(v, s, acc, m, l, FIRST: tl.constexpr):
    """One source (row v, score s) into the online softmax's running (acc, m, l)."""
    if FIRST:
        acc_new = v
        m_new = s
        l_new = s * 0.0 + 1.0
    else:
        m_new = tl.maximum(m, s)
        c = tl.exp(m - m_new)
        e = tl.exp(s - m_new)
        acc_new = acc * c[:, None] + v * e[:, None]
        l_new = l * c + e
    return acc_new, m_new, l_new


@triton.jit
def _bank_step(p, offs, ok, w, acc, m, l, d, eps, CDT: tl.constexpr):
    return _mix_step(tl.load(p + offs, mask=ok, other=0.0).to(CDT), w, acc, m, l, d, eps, False)


@triton.jit
def _first_rows(b0, b1, b2, b3, offs, ok, N: tl.constexpr):
    """The first N (<= 4) bank rows as stored, loaded together; the others are zeros nothing reads."""
    z = tl.zeros(offs.shape, b0.dtype.element_ty)
    p0 = tl.load(b0 + offs, mask=ok, other=0.0) if N > 0 else z
    p1 = tl.load(b1 + offs, mask=ok, other=0.0) if N > 1 else z
    p2 = tl.load(b2 + offs, mask=ok, other=0.0) if N > 2 else z
    p3 = tl.load(b3 + offs, mask=ok, other=0.0) if N > 3 else z
    return p0, p1, p2, p3


@triton.jit
def _attn_res_kernel(b0, b1, b2, b3, b4, b5, b6, b7, b8, b9, b10, b11, b12, b13, b14,
                     last_ptr, part_ptr, prefix_ptr, proj_ptr, mnorm_ptr, g_ptr, x_ptr, h_ptr, T, d, eps, norm_eps,
                     N_BANK: tl.constexpr, PREFIX_ADD: tl.constexpr, STORE_X: tl.constexpr, NORM: tl.constexpr,
                     CDT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, PREFETCH: tl.constexpr,
                     EARLY: tl.constexpr, PDL: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < d
    ok = (rows < T)[:, None] & col_ok[None, :]
    offs = rows.to(tl.int64)[:, None] * d + cols[None, :]
    w = (tl.load(proj_ptr + cols, mask=col_ok, other=0.0).to(CDT)  # weights: before the PDL wait
         * tl.load(mnorm_ptr + cols, mask=col_ok, other=0.0).to(CDT))[None, :]
    if NORM:
        g = tl.load(g_ptr + cols, mask=col_ok, other=0.0).to(CDT)[None, :]
    # PREFETCH (<= N_BANK): the first PREFETCH bank rows are loaded before any arithmetic, so their memory latencies
    # overlap (one round trip instead of one per source: the T = 1 decode row is latency-bound); EARLY (module doc):
    # they and `prev` are read, and the bank rows scored, before the grid-dependency wait
    if EARLY:
        p0, p1, p2, p3 = _first_rows(b0, b1, b2, b3, offs, ok, PREFETCH)
        s0, s1, s2, s3 = _score(p0.to(CDT), w, d, eps), _score(p1.to(CDT), w, d, eps), \
            _score(p2.to(CDT), w, d, eps), _score(p3.to(CDT), w, d, eps)  # (those of absent rows go unused)
        v = tl.load(last_ptr + offs, mask=ok, other=0.0)
    pdl_enter(PDL)
    if not EARLY:
        p0, p1, p2, p3 = _first_rows(b0, b1, b2, b3, offs, ok, PREFETCH)
        v = tl.load(last_ptr + offs, mask=ok, other=0.0)
    if PREFIX_ADD:  # prefix = prev + part, stored, and mixed as the stored (rounded) value
        v = (v.to(CDT) + tl.load(part_ptr + offs, mask=ok, other=0.0).to(CDT)).to(prefix_ptr.dtype.element_ty)
        tl.store(prefix_ptr + offs, v, mask=ok)
    acc, m, l = _mix_step(v.to(CDT), w, 0.0, 0.0, 0.0, d, eps, True)
    if N_BANK > 0:
        if EARLY and PREFETCH > 0:
            acc, m, l = _fold(p0.to(CDT), s0, acc, m, l, False)
        elif PREFETCH > 0:
            acc, m, l = _mix_step(p0.to(CDT), w, acc, m, l, d, eps, False)
        else:
            acc, m, l = _bank_step(b0, offs, ok, w, acc, m, l, d, eps, CDT)
    if N_BANK > 1:
        if EARLY and PREFETCH > 1:
            acc, m, l = _fold(p1.to(CDT), s1, acc, m, l, False)
        elif PREFETCH > 1:
            acc, m, l = _mix_step(p1.to(CDT), w, acc, m, l, d, eps, False)
        else:
            acc, m, l = _bank_step(b1, offs, ok, w, acc, m, l, d, eps, CDT)
    if N_BANK > 2:
        if EARLY and PREFETCH > 2:
            acc, m, l = _fold(p2.to(CDT), s2, acc, m, l, False)
        elif PREFETCH > 2:
            acc, m, l = _mix_step(p2.to(CDT), w, acc, m, l, d, eps, False)
        else:
            acc, m, l = _bank_step(b2, offs, ok, w, acc, m, l, d, eps, CDT)
    if N_BANK > 3:
        if EARLY and PREFETCH > 3:
            acc, m, l = _fold(p3.to(CDT), s3, acc, m, l, False)
        elif PREFETCH > 3:
            acc, m, l = _mix_step(p3.to(CDT), w, acc, m, l, d, eps, False)
        else:
            acc, m, l = _bank_step(b3, offs, ok, w, acc, m, l, d, eps, CDT)
    if N_BANK > 4:
        acc, m, l = _bank_step(b4, offs, ok, w, acc, m, l, d, eps, CDT)
    if N_BANK > 5:
        acc, m, l = _bank_step(b5, offs, ok, w, acc, m, l, d, eps, CDT)
    if N_BANK > 6:
        acc, m, l = _bank_step(b6, offs, ok, w, acc, m, l, d, eps, CDT)
    if N_BANK > 7:
        acc, m, l = _bank_step(b7, offs, ok, w, acc, m, l, d, eps, CDT)
    if N_BANK > 8:
        acc, m, l = _bank_step(b8, offs, ok, w, acc, m, l, d, eps, CDT)
    if N_BANK > 9:
        acc, m, l = _bank_step(b9, offs, ok, w, acc, m, l, d, eps, CDT)
    if N_BANK > 10:
        acc, m, l = _bank_step(b10, offs, ok, w, acc, m, l, d, eps, CDT)
    if N_BANK > 11:
        acc, m, l = _bank_step(b11, offs, ok, w, acc, m, l, d, eps, CDT)
    if N_BANK > 12:
        acc, m, l = _bank_step(b12, offs, ok, w, acc, m, l, d, eps, CDT)
    if N_BANK > 13:
        acc, m, l = _bank_step(b13, offs, ok, w, acc, m, l, d, eps, CDT)
    if N_BANK > 14:
        acc, m, l = _bank_step(b14, offs, ok, w, acc, m, l, d, eps, CDT)
    x = (acc / l[:, None]).to(x_ptr.dtype.element_ty)
    if STORE_X:
        tl.store(x_ptr + offs, x, mask=ok)
    if NORM:
        xf = tl.where(ok, x.to(CDT), 0.0)
        h = xf / tl.sqrt(tl.sum(xf * xf, axis=1) / d + norm_eps)[:, None]
        h = h * g
        tl.store(h_ptr + offs, h.to(h_ptr.dtype.element_ty), mask=ok)


def attn_res_mix(bank, last, proj, mix_norm, eps: float, config: dict, *, part=None, norm_weight=None,
                 norm_eps: float = 0.0, early: bool = False):
    """Returns (prefix or None, x or None, h or None). The candidates are bank (0..15 tensors [..., d])
    then the prefix: `last`, or last + part when `part` is given (then the sum is returned as prefix).
    x is returned when no norm_weight is given, h = rmsnorm(x) when one is. `early`: the caller vouches that
    the bank rows and `last` were written two or more launches back (module doc, EARLY; needs `part`)."""
    if len(bank) > MAX_BANK:
        raise ValueError(f"attn_res_mix: {len(bank)} bank sources; this kernel takes at most {MAX_BANK}")
    shape, dt = last.shape, last.dtype
    for s in [*bank, *([part] if part is not None else [])]:
        if s.shape != shape or s.dtype != dt:
            raise ValueError(f"attn_res_mix: sources differ: {tuple(s.shape)} {s.dtype} vs {tuple(shape)} {dt}")
    d = shape[-1]
    if config["BLOCK_D"] < d:
        raise ValueError(f"attn_res_mix: BLOCK_D={config['BLOCK_D']} < d={d} (one-pass rows only)")
    flat = [s.reshape(-1, d).contiguous() for s in [*bank, last, *([part] if part is not None else [])]]
    T = flat[0].shape[0]
    proj, mix_norm = proj.reshape(-1).contiguous(), mix_norm.reshape(-1).contiguous()
    if proj.numel() != d or mix_norm.numel() != d:
        raise ValueError(f"attn_res_mix: proj {proj.numel()} / norm {mix_norm.numel()} values do not match d={d}")
    dev = last.device
    prefix = torch.empty(T, d, dtype=dt, device=dev) if part is not None else None
    x = torch.empty(T, d, dtype=dt, device=dev) if norm_weight is None else None
    h = torch.empty(T, d, dtype=dt, device=dev) if norm_weight is not None else None
    if T > 0:
        dummy = flat[0]
        bank_ptrs = flat[:len(bank)] + [dummy] * (MAX_BANK - len(bank))
        pick = lambda t: dummy if t is None else t  # noqa: E731
        _attn_res_kernel[(triton.cdiv(T, config["BLOCK_R"]),)](
            *bank_ptrs, flat[len(bank)], pick(flat[-1] if part is not None else None), pick(prefix), proj, mix_norm,
            pick(norm_weight), pick(x if x is not None else h), pick(h), T, d, float(eps), float(norm_eps),
            N_BANK=len(bank), PREFIX_ADD=part is not None, STORE_X=x is not None, NORM=norm_weight is not None,
            CDT=tl.float64 if dt == torch.float64 else tl.float32,
            BLOCK_R=config["BLOCK_R"], BLOCK_D=config["BLOCK_D"], PREFETCH=min(len(bank), config.get("PREFETCH", 0)),
            EARLY=bool(early and part is not None and _early_on), num_warps=config["num_warps"], **launch_kwargs())
    lead = shape[:-1]
    shp = lambda t: None if t is None else t.reshape(*lead, d)  # noqa: E731
    return shp(prefix), shp(x), shp(h)


# ---- template plumbing ---------------------------------------------------------------------------
def _key(sources, attrs) -> dict:
    rows = 1
    for dim in sources[0].shape[:-1]:
        rows *= int(dim)
    return {"T": rows, "d": int(sources[0].shape[-1]), "n": len(sources),
            "bi": int(bool(attrs.get("batch_invariant", False)))}


def _bucket(key: dict) -> dict:
    b = dict(key)
    b["T"] = 0 if b["bi"] else pow2_bucket(b["T"])
    return b


MAX_PREFETCH = 4
TUNABLES = (Tunable("BLOCK_R", (1, 2, 4, 8, 16)), Tunable("num_warps", (1, 2, 4, 8, 16, 32)),
            Tunable("PREFETCH", (0, 1, 2, 3, 4)))


def _values_per_thread(config: dict) -> int:
    return config["BLOCK_R"] * config["BLOCK_D"] // (32 * config["num_warps"])


def heuristic(key: dict, target: str) -> dict:
    """BLOCK_D = next power of two >= d; rows per program so a tile holds ~4096 values (interpreter:
    ~32768); about one warp per 512 values of the tile (at most 8 for one row a program); every bank row
    prefetched (up to MAX_PREFETCH) while the live rows (prefetched + prefix + running sum + weights) stay
    within ~160 fp32 registers a thread. On a GPU a one-token step's row (T = 1) takes 16 warps (below)."""
    bd = pow2_bucket(key["d"])
    br = max(1, min(16, (32768 if target == "cpu" else 4096) // bd))
    # one row per program (H200, d=7168, T=1): session 6, the kernel alone, 8 warps 4.01 / 4.17 µs with 1 / 2 bank
    # rows vs 16 warps 4.01 / 4.75; session 18, inside the rank decode graph (benches/bench_runtime_gpu.py
    # --sections graph_configs, 8 mixes a step, medians of 6-8 captures): 16 warps 553.2 vs 554.3 us a step alone,
    # part of the -20 us set (_moe_gemv_gluon.GLUON_T1); 4 warps 572.3, 32 warps as 16. So: 16 warps for a
    # one-token step's row of d >= 4096 on a GPU (other batches: not measured, unchanged).
    # (PREFETCH stays what 8 warps hold: the measured setting.)
    cfg = {"BLOCK_R": br, "BLOCK_D": bd, "num_warps": max(1, min(8 if br == 1 else 16, br * bd // 512))}
    vpt = max(1, _values_per_thread(cfg))
    cfg["PREFETCH"] = max(0, min(MAX_PREFETCH, key["n"] - 1, 160 // vpt - 3))
    if key.get("T") == 1 and br == 1 and bd >= 4096 and target != "cpu":
        cfg["num_warps"] = 16
    return cfg


def constraints(config: dict, key: dict, target: str) -> list[str]:
    out = []
    if config["BLOCK_D"] < key["d"]:
        out.append(f"BLOCK_D={config['BLOCK_D']} < d={key['d']}")
    if config["BLOCK_R"] * config["BLOCK_D"] > 16384:
        out.append("running-sum tile BLOCK_R*BLOCK_D > 16384 values does not fit in registers")
    if config.get("PREFETCH", 0) and (config["PREFETCH"] + 3) * _values_per_thread(config) > 192:
        out.append(f"PREFETCH={config['PREFETCH']} rows of {_values_per_thread(config)} values a thread spill")
    return out


def _supports(sources, n_bank) -> str | None:
    if n_bank > MAX_BANK:
        return f"{n_bank} bank sources; the kernel takes at most {MAX_BANK}"
    d = sources[0].shape[-1]
    if not getattr(d, "is_number", True) or int(d) > MAX_BLOCK_D:
        return f"hidden size {d} is symbolic or > {MAX_BLOCK_D} (the row is kept in registers)"
    return None


def _launch_mix(a, attrs, config):
    return attn_res_mix(a.sources[:-1], a.sources[-1], a.proj, a.norm, attrs["eps"], config)[1]


def split_fused(operands, attrs):
    """fused.attn_res_mix_norm operands -> (proj, mix_norm, norm_w, bank, last, part or None)."""
    n = int(attrs["bank"])
    want = 3 + n + (2 if attrs["prefix_add"] else 1)
    if len(operands) != want:
        raise ValueError(f"fused.attn_res_mix_norm with bank={n}, prefix_add={attrs['prefix_add']} takes {want} "
                         f"operands (proj, mix_norm, norm_w, bank.., prev, part | prefix), got {len(operands)}")
    proj, mnorm, g = operands[:3]
    bank = list(operands[3:3 + n])
    tail = operands[3 + n:]
    return proj, mnorm, g, bank, tail[0], (tail[1] if attrs["prefix_add"] else None)


def _launch_mix_norm(a, attrs, config):
    proj, mnorm, g, bank, last, part = split_fused(a.operands, attrs)
    prefix, _, h = attn_res_mix(bank, last, proj, mnorm, attrs["eps"], config, part=part, norm_weight=g,
                                norm_eps=attrs["norm_eps"], early=True)
    return (prefix, h) if part is not None else h


def _fused_sources(a, attrs):
    _, _, _, bank, last, _ = split_fused(a.operands, attrs)
    return [*bank, last]


TEMPLATES = [
    KernelTemplate(
        family="attn_res_mix", backend="triton", ops=("attn_res_mix",), launch=_launch_mix,
        key_dims=lambda a, attrs: _key(a.sources, attrs), heuristic=heuristic, tunables=TUNABLES, bucket=_bucket,
        constraints=constraints, supports=lambda a, attrs, target: _supports(a.sources, len(a.sources) - 1),
        batch_invariant=True, doc="softmax over sources of rmsnorm(V_i).w, weighted sum; one read of every source"),
    KernelTemplate(
        family="attn_res_mix_norm", backend="triton", ops=("fused.attn_res_mix_norm",), launch=_launch_mix_norm,
        key_dims=lambda a, attrs: _key(_fused_sources(a, attrs), attrs), heuristic=heuristic, tunables=TUNABLES,
        bucket=_bucket, constraints=constraints,
        supports=lambda a, attrs, target: _supports(_fused_sources(a, attrs), int(attrs["bank"])),
        batch_invariant=True, doc="prefix add + AttnRes mix + the following RMSNorm in one kernel"),
]
