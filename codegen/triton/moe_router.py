"""MoE router (IR op `moe_router`, SPEC §6) and token permutation into per-expert segments.

Router, one kernel, a block of BLOCK_T tokens per program (fp32 throughout):

    s      = sigmoid(logits)                 | softmax(logits) over the E experts
    c      = s + bias                         (bias only selects)
    grouped (n_group > 1, DeepSeek-V3 noaux_tc): the E experts form n_group contiguous groups of
           per = E / n_group; group score = max1 + max2 of c in the group (max1 when per = 1);
           the topk_group best groups are kept (ties: lower group id), other experts get -inf
    ids    = top-k of c, descending, ties to the lower expert id: k rounds of ONE int64 max over the keys
             (order-preserving bits of c) << 32 | (2^31-1 - expert id)
    w      = s[ids] (recomputed from the gathered logits, bitwise the same);  w /= (sum(w) + 1e-20)
             when renormalize;  w *= scaling
One token per program by default (_router_config: at T=1, 112 experts, 2.36 us on the H200).

The logits row is held as a [G_PAD, P_PAD] tile (group × position in group; one group when
n_group = 1), so grouped and plain selection share the code and padded lanes never alias an expert.

Permutation (`permute_tokens`), three small deterministic kernels, no atomics. A pair p = t·k + j is
token t's j-th routed slot; pairs are grouped by expert, ascending p inside each expert:
  1. count:   chunk c of CHUNK pairs -> chunk_counts[c, e] (one-hot column sums);
  2. scan:    chunk_base[c, e] = Σ_{c' < c} chunk_counts[c', e];  counts[e] = Σ_c chunk_counts[c, e];
  3. scatter: offsets = exclusive cumsum(counts); pair_ids[offsets[e] + chunk_base[c, e] + rank] = p,
              rank = number of earlier pairs of chunk c routed to e.
Ids outside [0, E) (experts held by another rank under EP) are dropped: they get no row.
Up to FUSED_MAX_PAIRS pairs (decode), the three steps run in ONE program (`_permute_one_program_kernel`):
two passes over the pairs in chunks, counts then ranks, the same result with two launches fewer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from codegen.kernel import KernelTemplate, Tunable, pow2_bucket
from codegen.triton._pdl import launch_kwargs, pdl_enter

NEG_INF = tl.constexpr(float("-inf"))


# ------------------------------------------------------------------------------------------ router
@triton.jit
def expert_lanes(PER: tl.constexpr, N_GROUP: tl.constexpr, G_PAD: tl.constexpr, P_PAD: tl.constexpr):
    """(eid, lane) [1, G_PAD, P_PAD]: the expert id of each (group, position) lane and whether it is real."""
    g3 = tl.arange(0, G_PAD)[None, :, None]
    p3 = tl.arange(0, P_PAD)[None, None, :]
    return g3 * PER + p3, (g3 < N_GROUP) & (p3 < PER)


@triton.jit
def _moe_router_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, T, stride_t, scaling,
                       PER: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                       G_PAD: tl.constexpr, P_PAD: tl.constexpr, TOPK: tl.constexpr, K_PAD: tl.constexpr,
                       BLOCK_T: tl.constexpr, SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr,
                       RENORM: tl.constexpr, PDL: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    eid, lane = expert_lanes(PER, N_GROUP, G_PAD, P_PAD)
    bias = tl.load(bias_ptr + eid, mask=lane & HAS_BIAS, other=0.0).to(tl.float32)  # a parameter: before the wait
    pdl_enter(PDL)  # the logits are the previous kernel's output
    route_rows(logits_ptr, bias, rows, T, stride_t, w_ptr, ids_ptr, scaling, PER, N_GROUP, TOPK_GROUP, G_PAD, P_PAD,
               TOPK, K_PAD, BLOCK_T, SOFTMAX, HAS_BIAS, RENORM)


@triton.jit
def route_rows(logits_ptr, bias, rows, T, stride_t, w_ptr, ids_ptr, scaling,
               PER: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
               G_PAD: tl.constexpr, P_PAD: tl.constexpr, TOPK: tl.constexpr, K_PAD: tl.constexpr,
               BLOCK_T: tl.constexpr, SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr):
    """The router math (module docstring) for logits rows `rows` [BLOCK_T] (< T valid) of logits_ptr (row
    stride stride_t): weights f32 and ids i64 [T, TOPK] stored; `bias` [1, G_PAD, P_PAD] as `expert_lanes`
    lays it out (ignored unless HAS_BIAS). Shared by the router kernel and the routed GEMM's epilogue."""
    g = tl.arange(0, G_PAD)
    p3 = tl.arange(0, P_PAD)[None, None, :]
    eid, lane = expert_lanes(PER, N_GROUP, G_PAD, P_PAD)
    r3 = rows[:, None, None]
    live = (r3 < T) & lane
    # through L2 (.cg): in the routed GEMM other programs of the same launch wrote these logits
    x = tl.load(logits_ptr + r3.to(tl.int64) * stride_t + eid, mask=live, other=0.0,
                cache_modifier=".cg").to(tl.float32)
    if SOFTMAX:
        mx = tl.max(tl.max(tl.where(lane, x, NEG_INF), 2), 1)
        ex = tl.where(lane, tl.exp(x - mx[:, None, None]), 0.0)
        den = tl.sum(tl.sum(ex, 2), 1)
        s = ex / den[:, None, None]
    else:
        s = tl.sigmoid(x)
    c = s
    if HAS_BIAS:
        c = s + bias
    c = tl.where(lane, c, NEG_INF)
    if N_GROUP > 1:
        m1 = tl.max(c, 2)                                            # [BT, G]
        first = tl.min(tl.where(c == m1[:, :, None], p3, P_PAD), 2)  # one instance of the max
        if PER > 1:
            gscore = m1 + tl.max(tl.where(p3 == first[:, :, None], NEG_INF, c), 2)
        else:
            gscore = m1
        gfree = (g[None, :] < N_GROUP) & (rows[:, None] >= 0)
        keep = g[None, :] < 0
        for _i in tl.static_range(TOPK_GROUP):
            gm = tl.where(gfree, gscore, NEG_INF)
            best = tl.max(gm, 1)
            gi = tl.min(tl.where(gfree & (gm == best[:, None]), g[None, :], G_PAD), 1)
            pick = g[None, :] == gi[:, None]
            keep = keep | pick
            gfree = gfree & ~pick
        c = tl.where(keep[:, :, None], c, NEG_INF)
    # one max per round: the biased score's order-preserving bits (a negative float's magnitude bits
    # flipped) in the high word, 2^31-1 - expert id in the low, so ties go to the lower id
    cb = c.to(tl.int32, bitcast=True)
    order = tl.where(cb >= 0, cb, cb ^ 0x7FFFFFFF).to(tl.int64)
    key = (order << 32) | (2147483647 - eid).to(tl.int64)
    kcol = tl.arange(0, K_PAD)[None, :]
    isel = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int32)
    free = live
    for i in tl.static_range(TOPK):
        best = tl.max(tl.max(tl.where(free, key, -9223372036854775807), 2), 1)
        j = (2147483647 - (best & 0xFFFFFFFF)).to(tl.int32)
        isel = tl.where(kcol == i, j[:, None], isel)
        free = free & (eid != j[:, None, None])
    # the selected scores, recomputed from their logits by the same formula as s (bitwise equal)
    ok = (rows[:, None] < T) & (kcol < TOPK)
    xs = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_t + isel, mask=ok, other=0.0,
                 cache_modifier=".cg").to(tl.float32)
    if SOFTMAX:
        wsel = tl.exp(xs - mx[:, None]) / den[:, None]
    else:
        wsel = tl.sigmoid(xs)
    wsel = tl.where(ok, wsel, 0.0)
    if RENORM:
        wsel = wsel / (tl.sum(wsel, 1)[:, None] + 1e-20)
    wsel = wsel * scaling
    out = rows[:, None].to(tl.int64) * TOPK + kcol
    tl.store(w_ptr + out, wsel, mask=ok)
    tl.store(ids_ptr + out, isel.to(tl.int64), mask=ok)


def router(logits: torch.Tensor, bias: torch.Tensor | None, topk: int, activation: str = "sigmoid",
           renormalize: bool = True, scaling: float = 1.0, n_group: int = 1, topk_group: int = 1,
           block_t: int | None = None, num_warps: int | None = None):
    """(weights f32 [T, topk], ids i64 [T, topk]) exactly as `ir.ref.moe.moe_router`."""
    if logits.dim() != 2:
        raise ValueError(f"router logits must be [T, E], found shape {tuple(logits.shape)}")
    if activation not in ("sigmoid", "softmax"):
        raise ValueError(f"router activation must be 'sigmoid' or 'softmax', found {activation!r}")
    T, E = logits.shape
    if not 1 <= topk <= E:
        raise ValueError(f"router topk={topk} out of range for {E} experts")
    if n_group < 1 or E % n_group or not 1 <= topk_group <= n_group or topk > topk_group * (E // n_group):
        raise ValueError(f"router grouping n_group={n_group} topk_group={topk_group} topk={topk} "
                         f"does not fit E={E} experts")
    if bias is not None and tuple(bias.shape) != (E,):
        raise ValueError(f"router bias must be [{E}], found {tuple(bias.shape)}")
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    per = E // n_group
    g_pad, p_pad = triton.next_power_of_2(n_group), triton.next_power_of_2(per)
    bt_h, warps_h = _router_config(g_pad * p_pad, T)
    bt, num_warps = block_t or bt_h, num_warps or warps_h
    w = torch.empty(T, topk, dtype=torch.float32, device=x.device)
    ids = torch.empty(T, topk, dtype=torch.int64, device=x.device)
    if T:
        _moe_router_kernel[(triton.cdiv(T, bt),)](
            x, bias if bias is not None else x, w, ids, T, x.stride(0), float(scaling),
            PER=per, N_GROUP=n_group, TOPK_GROUP=topk_group, G_PAD=g_pad, P_PAD=p_pad, TOPK=topk,
            K_PAD=triton.next_power_of_2(topk), BLOCK_T=bt, SOFTMAX=activation == "softmax",
            HAS_BIAS=bias is not None, RENORM=bool(renormalize), num_warps=num_warps, **launch_kwargs())
    return w, ids


def _router_config(lanes: int, tokens: int) -> tuple[int, int]:
    """(BLOCK_T, num_warps): one token per program, its [G_PAD, P_PAD] logits on one warp at T=1 and
    on two from T=2 on (more warps once a row exceeds 512 lanes). Measured on the H200 (graph replay,
    112 experts, bench_moe.py): T=1 top-2 2.36 us (session 5's 32 rows on 4 warps: 5.78; 2 warps 2.53);
    T=8 top-2 2.38 us (8 rows: 3.72, 32: 9.50); T=64 top-16 5.23 us (32 rows on 4 warps: 81.5: every
    one of the k rounds reduces the whole masked 32 x 128 tile)."""
    warps = 1 if tokens <= 1 else 2 if lanes <= 512 else min(4, lanes // 256)
    return 1, warps


# ------------------------------------------------------------------------------------ permutation
@triton.jit
def _count_chunks_kernel(ids_ptr, chunk_counts_ptr, P, E, E_PAD: tl.constexpr, CHUNK: tl.constexpr,
                         PDL: tl.constexpr):
    pdl_enter(PDL)
    c = tl.program_id(0)
    p = c * CHUNK + tl.arange(0, CHUNK)
    e = tl.load(ids_ptr + p, mask=p < P, other=-1).to(tl.int32)
    ev = tl.arange(0, E_PAD)
    cnt = tl.sum((e[:, None] == ev[None, :]).to(tl.int32), 0)
    tl.store(chunk_counts_ptr + c * E + ev, cnt, mask=ev < E)


@triton.jit
def _scan_chunks_kernel(chunk_counts_ptr, chunk_base_ptr, counts_ptr, NCHUNK, E,
                        BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    ev = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    emask = ev < E
    carry = tl.zeros([BLOCK_E], dtype=tl.int32)
    for c0 in range(0, NCHUNK, BLOCK_C):
        cr = c0 + tl.arange(0, BLOCK_C)
        m = (cr < NCHUNK)[:, None] & emask[None, :]
        off = cr[:, None] * E + ev[None, :]
        x = tl.load(chunk_counts_ptr + off, mask=m, other=0)
        tl.store(chunk_base_ptr + off, tl.cumsum(x, 0) - x + carry[None, :], mask=m)
        carry += tl.sum(x, 0)
    tl.store(counts_ptr + ev, carry, mask=emask)


@triton.jit
def _scatter_pairs_kernel(ids_ptr, chunk_base_ptr, counts_ptr, offsets_ptr, pair_ids_ptr, P, E,
                          E_PAD: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    c = tl.program_id(0)
    ev = tl.arange(0, E_PAD)
    emask = ev < E
    cnt = tl.load(counts_ptr + ev, mask=emask, other=0)
    incl = tl.cumsum(cnt, 0)
    start = incl - cnt
    tl.store(offsets_ptr + ev, incl - incl, mask=(ev == 0) & (c == 0))
    tl.store(offsets_ptr + 1 + ev, incl, mask=emask & (c == 0))
    base = start + tl.load(chunk_base_ptr + c * E + ev, mask=emask, other=0)
    p = c * CHUNK + tl.arange(0, CHUNK)
    e = tl.load(ids_ptr + p, mask=p < P, other=-1).to(tl.int32)
    one = (e[:, None] == ev[None, :]) & emask[None, :]
    rank = tl.cumsum(one.to(tl.int32), 0) - 1
    pos = tl.sum(tl.where(one, rank + base[None, :], 0), 1)
    tl.store(pair_ids_ptr + pos, p, mask=(p < P) & (e >= 0) & (e < E))


@triton.jit
def _permute_one_program_kernel(ids_ptr, counts_ptr, offsets_ptr, pair_ids_ptr, P, E, E_PAD: tl.constexpr,
                                CHUNK: tl.constexpr, PDL: tl.constexpr):
    """count, scan and scatter in one program: pass 1 sums the one-hot counts over chunks of CHUNK pairs;
    offsets = exclusive cumsum; pass 2 places chunk c's pairs at offsets[e] + (pairs of e in earlier
    chunks) + rank in the chunk."""
    pdl_enter(PDL)
    ev = tl.arange(0, E_PAD)
    emask = ev < E
    cnt = tl.zeros([E_PAD], dtype=tl.int32)
    for c0 in range(0, P, CHUNK):
        p = c0 + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + p, mask=p < P, other=-1).to(tl.int32)
        cnt += tl.sum(((e[:, None] == ev[None, :]) & emask[None, :]).to(tl.int32), 0)
    incl = tl.cumsum(cnt, 0)
    tl.store(counts_ptr + ev, cnt, mask=emask)
    tl.store(offsets_ptr + ev, incl - incl, mask=ev == 0)
    tl.store(offsets_ptr + 1 + ev, incl, mask=emask)
    base = incl - cnt
    for c0 in range(0, P, CHUNK):
        p = c0 + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + p, mask=p < P, other=-1).to(tl.int32)
        one = (e[:, None] == ev[None, :]) & emask[None, :]
        rank = tl.cumsum(one.to(tl.int32), 0) - 1
        pos = tl.sum(tl.where(one, rank + base[None, :], 0), 1)
        tl.store(pair_ids_ptr + pos, p, mask=(p < P) & (e >= 0) & (e < E))
        base += tl.sum(one.to(tl.int32), 0)


@dataclass
class ExpertSegments:
    """Pairs (t, j) grouped by expert: expert e owns rows offsets[e] : offsets[e+1] of `pair_ids`.

    counts i32 [E]; offsets i32 [E+1] (exclusive prefix, offsets[E] = routed pairs kept);
    pair_ids i32 [T·k] (pair p = t·k + j, ascending within an expert; rows past offsets[E] unused).
    """
    counts: torch.Tensor
    offsets: torch.Tensor
    pair_ids: torch.Tensor
    num_experts: int
    topk: int
    num_tokens: int

    @property
    def num_pairs(self) -> int:
        return self.num_tokens * self.topk


def _perm_chunk(e_pad: int) -> int:
    return max(16, min(256, 16384 // e_pad))


FUSED_MAX_PAIRS = 256      # one program up to here (H200: 3.2 vs 7.9 us at 2 pairs, 27 vs 11 us at 1024)


def permute_tokens(ids: torch.Tensor, num_experts: int, chunk: int | None = None,
                   fused: bool | None = None) -> ExpertSegments:
    """Group the routed pairs of `ids` [T, k] by expert (deterministic, no host sync): one program when
    `fused` (default: T·k <= FUSED_MAX_PAIRS), else three kernels over chunks of `chunk` pairs."""
    if ids.dim() != 2:
        raise ValueError(f"permute_tokens: ids must be [T, k], found shape {tuple(ids.shape)}")
    T, K = ids.shape
    P, E = T * K, int(num_experts)
    dev = ids.device
    flat = ids.reshape(-1)
    flat = flat if flat.is_contiguous() else flat.contiguous()
    e_pad = triton.next_power_of_2(E)
    counts = torch.empty(E, dtype=torch.int32, device=dev)
    offsets = torch.empty(E + 1, dtype=torch.int32, device=dev)
    pair_ids = torch.zeros(max(P, 1), dtype=torch.int32, device=dev)
    if fused if fused is not None else P <= FUSED_MAX_PAIRS:
        ch = chunk or min(_perm_chunk(e_pad), max(16, triton.next_power_of_2(P)))
        _permute_one_program_kernel[(1,)](flat, counts, offsets, pair_ids, P, E, E_PAD=e_pad, CHUNK=ch,
                                          num_warps=4, **launch_kwargs())
        return ExpertSegments(counts, offsets, pair_ids, E, K, T)
    ch = chunk or _perm_chunk(e_pad)
    nchunk = max(1, triton.cdiv(P, ch))
    chunk_counts = torch.empty(nchunk, E, dtype=torch.int32, device=dev)
    chunk_base = torch.empty(nchunk, E, dtype=torch.int32, device=dev)
    _count_chunks_kernel[(nchunk,)](flat, chunk_counts, P, E, E_PAD=e_pad, CHUNK=ch, **launch_kwargs())
    block_e = min(e_pad, 128)
    _scan_chunks_kernel[(triton.cdiv(E, block_e),)](chunk_counts, chunk_base, counts, nchunk, E, BLOCK_E=block_e,
                                                     BLOCK_C=max(1, min(64, 8192 // block_e)), **launch_kwargs())
    _scatter_pairs_kernel[(nchunk,)](flat, chunk_base, counts, offsets, pair_ids, P, E, E_PAD=e_pad, CHUNK=ch,
                                     **launch_kwargs())
    return ExpertSegments(counts, offsets, pair_ids, E, K, T)


# --------------------------------------------------------------------------------------- template
def _key_dims(a, attrs) -> dict:
    T, E = a.logits.shape
    return {"T": int(T), "E": int(E), "K": int(attrs["topk"]), "G": int(attrs.get("n_group", 1))}


def _bucket(key: dict) -> dict:
    return {**key, "T": pow2_bucket(key["T"])}


def _heuristic(key: dict, target=None) -> dict:
    g_pad = triton.next_power_of_2(key.get("G", 1))
    p_pad = triton.next_power_of_2(key["E"] // max(1, key.get("G", 1)))
    bt, warps = _router_config(g_pad * p_pad, key["T"])
    return {"BLOCK_T": bt, "num_warps": warps}


def _constraints(config: dict, key: dict, target=None) -> list[str]:
    lanes = triton.next_power_of_2(key.get("G", 1)) * triton.next_power_of_2(key["E"] // max(1, key.get("G", 1)))
    if config["BLOCK_T"] * lanes > 32768:
        return [f"BLOCK_T={config['BLOCK_T']} x {lanes} expert lanes exceeds 32768 values per program"]
    return []


def _supports(a, attrs, target=None):
    E = a.logits.shape[1]
    n_group, topk_group = attrs.get("n_group", 1), attrs.get("topk_group", 1)
    if attrs.get("activation", "sigmoid") not in ("sigmoid", "softmax"):
        return f"activation {attrs.get('activation')!r} is not sigmoid|softmax"
    if n_group < 1 or int(E) % n_group or attrs["topk"] > topk_group * (int(E) // n_group):
        return f"grouping n_group={n_group}, topk_group={topk_group} does not fit {E} experts (reference raises)"
    return None


def _launch(a, attrs, config=None):
    cfg = {**_heuristic(_key_dims(a, attrs)), **(config or {})}
    return router(a.logits, a.bias, attrs["topk"], attrs.get("activation", "sigmoid"),
                  attrs.get("renormalize", True), attrs.get("scaling", 1.0), attrs.get("n_group", 1),
                  attrs.get("topk_group", 1), block_t=cfg["BLOCK_T"], num_warps=cfg["num_warps"])


TEMPLATES = [KernelTemplate(
    family="moe_router", backend="triton", ops=("moe_router",), launch=_launch, key_dims=_key_dims,
    heuristic=_heuristic, tunables=(Tunable("BLOCK_T", (1, 2, 4, 8, 16, 32)), Tunable("num_warps", (1, 2, 4, 8))),
    bucket=_bucket, constraints=_constraints, supports=_supports, batch_invariant=True,
    doc="sigmoid|softmax scores, (grouped) top-k on scores + bias, renormalised weights x scaling; one kernel")]

__all__ = ["router", "permute_tokens", "ExpertSegments", "TEMPLATES"]
