"""Exact global top-k across a DCP group from interleaved token shards (DESIGN §5 T4, issue 8).

Layout. With W ranks and interleave block B, global position p lives on rank (p // B) % W at local
index i = (p // (W·B))·B + p % B; conversely rank r's local index i is global position
p(r, i) = (i // B)·W·B + r·B + i % B, which grows with i (so ties inside one rank resolve by local order).

Order. Scores are fp32; the selection is the k_eff = min(k, ctx_len) largest scores of the row, ties to
the lower global position (SPEC §5 rule 7). Scores map to int32 keys that order exactly like the floats:
key = bits if bits >= 0 else bits ^ 0x7FFFFFFF (after -0.0 → +0.0; NaN is refused).

Round 1 (always, 4 bytes per candidate). Each rank sorts its row by (key desc, local index asc) and
all-gathers its best c = ceil(1.5·k/W) keys. The candidate's id is implicit: it is slot j of rank r's
sorted list, which only rank r can map back to a position — and only rank r needs to, since DCP attends
over the selected tokens where they are stored. So a candidate costs exactly 32 bits with no loss of
precision. Every rank computes from the same gathered keys the round-1 threshold T = the k_eff-th largest
sent key (INT32_MIN if fewer were sent). A row is final after round 1 unless
  (a) some rank is *saturated*: it has more than c valid tokens and its c-th key is >= T, so unsent
      tokens of it may belong to the top-k; or
  (b) the keys equal to T that are needed are spread over >= 2 ranks and not all of them are needed,
      so the tie must be broken by global positions, which round 1 does not carry.
Final rows: take every key > T, and the needed keys == T (all of them, or the first slots of the one
rank that holds them).

Round 2 (only for flagged rows, counted). A saturated rank re-sends its full local top-k_eff; every other
rank sends its round-1 candidates with key >= T (often none). Entries are (key, global position) pairs,
8 bytes. This set contains the whole global top-k: the true threshold is >= T, a non-saturated rank has
no unsent token >= T, and a saturated rank's share of the top-k is a prefix of its local top-k. The
exact top-k of that union (ties to lower position) is the answer. Payloads have known, uneven sizes on
every rank and move by one all_to_all_single.

Static merge (`static_topk_own_positions`, used while a CUDA graph is captured: the rounds above read
sizes on the host). Each rank sends its local top-k_loc, k_loc = min(k, L) over its L local rows, as int64
composites c = (key << 32) | (2³² − 1 − p), one all-gather of W·k_loc·8 bytes per row; every rank takes
the global top-k_eff of the union. The union holds the exact top-k (a rank's share of it is a prefix of its
local order, at most k long) and c orders as (key desc, position asc), so the selection equals the rounds':
the same own_positions. More bytes (8·W·k vs 4·W·⌈1.5k/W⌉ per row), no host round trip.

Traffic counters count the payload each rank contributes, summed over ranks (the issue's
W·ceil(1.5k/W)·4 bytes per row for round 1); an all-gather delivers that payload to W−1 peers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

INT32_MIN = -(2**31)
# torch >= 2.13 deprecates all_gather_into_tensor for all_gather_single; older torch has only the former.
all_gather_concat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
KEY_BYTES = 4          # round-1 candidate: order-preserving fp32 key, id implicit in the slot
RESEND_ENTRY_BYTES = 8  # round-2 entry: key + global position (int32 each)


@dataclass
class TopKResult:
    """This rank's share of the exact global top-k and the merge's traffic counters."""
    own_positions: torch.Tensor  # [rows, k] int64: global positions held here that are selected, asc; -1 pad
    own_count: torch.Tensor      # [rows] int64: how many of the row's top-k this rank holds
    first_round_bytes: int       # sum over ranks of round-1 payload (rows · W · c · 4)
    resend_rows: int             # rows that needed round 2
    resend_bytes: int            # sum over ranks of round-2 payload
    candidates_per_rank: int     # c


def candidates_per_rank(k: int, world: int) -> int:
    """c = ceil(1.5·k / W), at least 1."""
    return max(1, math.ceil(1.5 * k / world))


def global_positions(rank: int, n_local: int, world: int, interleave: int = 1,
                     device=None) -> torch.Tensor:
    """p(r, i) = (i // B)·W·B + r·B + i % B for i in [0, n_local)."""
    i = torch.arange(n_local, dtype=torch.int64, device=device)
    return (i // interleave) * world * interleave + rank * interleave + i % interleave


def local_count(ctx_len: torch.Tensor, rank: int, world: int, interleave: int = 1) -> torch.Tensor:
    """Number of positions p < ctx_len with (p // B) % W == rank, per row."""
    span = world * interleave
    full, rem = ctx_len // span, ctx_len % span
    return full * interleave + (rem - rank * interleave).clamp(0, interleave)


def shard_scores(scores: torch.Tensor, rank: int, world: int, interleave: int = 1) -> torch.Tensor:
    """Rank `rank`'s columns of full scores [rows, n] (helper for tests and single-process use)."""
    n = scores.shape[1]
    n_local = int(local_count(torch.tensor(n), rank, world, interleave))
    return scores[:, global_positions(rank, n_local, world, interleave)]


def order_keys(scores: torch.Tensor, check_nan: bool = True) -> torch.Tensor:
    """fp32 scores → int32 keys with the same order (−0.0 equals +0.0; NaN refused, a host-side check that
    `check_nan=False` skips under CUDA-graph capture, where masked columns are −inf, never NaN)."""
    if scores.dtype != torch.float32:
        raise TypeError(f"dcp top-k expects fp32 scores, got {scores.dtype}")
    if check_nan and torch.isnan(scores).any():
        raise ValueError("dcp top-k: NaN in scores")
    bits = (scores + 0.0).contiguous().view(torch.int32)  # + 0.0 turns −0.0 into +0.0
    return torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


def _sorted_local(keys, n_valid, width):
    """Keys sorted by (key desc, local idx asc), padded with INT32_MIN to `width` columns."""
    rows, n_local = keys.shape
    col = torch.arange(n_local, device=keys.device).expand(rows, n_local)
    keys = torch.where(col < n_valid[:, None], keys, torch.full_like(keys, INT32_MIN))
    skeys, sidx = torch.sort(keys, dim=1, descending=True, stable=True)
    if n_local < width:
        pad = width - n_local
        skeys = torch.cat([skeys, skeys.new_full((rows, pad), INT32_MIN)], 1)
        sidx = torch.cat([sidx, sidx.new_full((rows, pad), -1)], 1)
    return skeys[:, :width], sidx[:, :width]


def _composite(key: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """int64 that sorts descending as (key desc, pos asc); pos must be < 2**31."""
    return (key.to(torch.int64) << 32) + ((1 << 32) - 1 - pos.to(torch.int64))


def dcp_topk(local_scores: torch.Tensor, k: int, ctx_len: torch.Tensor | None = None,
             interleave: int = 1, group=None) -> TopKResult:
    """Exact global top-k per row over a DCP group (see module docstring).

    local_scores: [rows, n_local] fp32, this rank's tokens in local order (columns >= the row's local
    count are ignored). ctx_len: [rows] global context length per row (default: every column of every
    rank valid, i.e. W·n_local interleaved positions). Returns this rank's selected global positions.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    rows, n_local = local_scores.shape
    dev = local_scores.device
    if ctx_len is None:
        ctx_len = torch.full((rows,), n_local * world, dtype=torch.int64, device=dev)
        if interleave != 1:
            raise ValueError("dcp top-k: pass ctx_len when interleave > 1")
    ctx_len = ctx_len.to(device=dev, dtype=torch.int64)
    counts = torch.stack([local_count(ctx_len, r, world, interleave) for r in range(world)])  # [W, rows]
    if (counts[rank] > n_local).any():
        raise ValueError(f"dcp top-k: rank {rank} has {n_local} columns but ctx_len needs "
                         f"{int(counts[rank].max())}")
    k_eff = ctx_len.clamp(max=k)
    c = candidates_per_rank(k, world)
    keys = order_keys(local_scores)
    skeys, sidx = _sorted_local(keys, counts[rank], max(c, k))

    # Round 1: all-gather the best c keys of every rank.
    sent = skeys[:, :c].contiguous()
    # the gather concatenates ranks on dim 0 (gloo refuses a stacked [W, rows, c] output)
    gathered = torch.empty((world * rows, c), dtype=torch.int32, device=dev)
    all_gather_concat(gathered, sent, group=group)
    gathered = gathered.view(world, rows, c)
    first_round_bytes = world * rows * c * KEY_BYTES

    valid = gathered > INT32_MIN                                       # [W, rows, c]
    flat = gathered.permute(1, 0, 2).reshape(rows, world * c)
    top_sorted = torch.sort(flat, dim=1, descending=True).values
    kidx = (k_eff - 1).clamp(min=0)
    thr = top_sorted.gather(1, kidx[:, None]).squeeze(1).to(torch.int64)
    thr = torch.where(k_eff > 0, thr, torch.full_like(thr, 2**31))      # k_eff = 0: select nothing
    thr = torch.where(thr > INT32_MIN, thr, torch.full_like(thr, INT32_MIN))  # too few sent: T = min
    g64 = gathered.to(torch.int64)
    saturated = (counts > c) & (g64[:, :, c - 1] >= thr[None])          # [W, rows]
    n_gt = ((g64 > thr[None, :, None]) & valid).sum((0, 2))
    eq = (g64 == thr[None, :, None]) & valid
    need = k_eff - n_gt
    eq_ranks = eq.any(2).sum(0)
    ambiguous = (eq.sum((0, 2)) > need) & (eq_ranks >= 2)
    flagged = saturated.any(0) | ambiguous | ((thr == INT32_MIN) & (k_eff > 0))

    # Final rows: own keys > T, plus the first `need` own keys == T (only one rank holds ties or all fit).
    own = g64[rank]
    own_eq = eq[rank]
    eq_rank_before = torch.zeros(rows, dtype=torch.int64, device=dev)  # ties == T on lower ranks
    for r in range(rank):
        eq_rank_before += eq[r].sum(1)
    take_eq = (need - eq_rank_before).clamp(min=0)
    eq_order = own_eq.cumsum(1)
    chosen = (own > thr[:, None]) & valid[rank]
    chosen |= own_eq & (eq_order <= take_eq[:, None])
    chosen &= ~flagged[:, None]
    pos_table = global_positions(rank, n_local, world, interleave, device=dev)
    slot_pos = torch.where(sidx[:, :c] >= 0, pos_table[sidx[:, :c].clamp(min=0)], -1)

    own_count = chosen.sum(1)
    big = torch.iinfo(torch.int64).max
    picked = torch.sort(torch.where(chosen, slot_pos, big), dim=1).values  # chosen positions first, asc
    own_positions = torch.full((rows, k), -1, dtype=torch.int64, device=dev)
    w = min(k, c)
    own_positions[:, :w] = torch.where(picked[:, :w] < big, picked[:, :w], -1)

    resend_rows, resend_bytes = 0, 0
    frows = torch.nonzero(flagged).flatten()
    if frows.numel():
        resend_rows = int(frows.numel())
        # Sizes every rank contributes per flagged row, computable everywhere from round-1 data.
        ge = ((g64 >= thr[None, :, None]) & valid).sum(2)                   # [W, rows]
        full = torch.minimum(k_eff[None], counts)
        sizes = torch.where(saturated, full, ge)[:, frows]                   # [W, F]
        mine = []
        for j, row in enumerate(frows.tolist()):
            m = int(sizes[rank, j])
            slot_keys = skeys[row, :m].to(torch.int64)
            slot_p = torch.where(sidx[row, :m] >= 0, pos_table[sidx[row, :m].clamp(min=0)], -1)
            mine.append(torch.stack([slot_keys, slot_p], 1))
        payload = torch.cat(mine).to(torch.int32)  # frows is non-empty, so mine is too
        per_rank = sizes.sum(1).tolist()
        recv = torch.empty((sum(per_rank), 2), dtype=torch.int32, device=dev)
        send = payload.repeat(world, 1)
        dist.all_to_all_single(recv, send, output_split_sizes=per_rank,
                               input_split_sizes=[int(per_rank[rank])] * world, group=group)
        resend_bytes = int(sum(per_rank)) * RESEND_ENTRY_BYTES
        chunks = list(torch.split(recv, per_rank))
        zero = torch.zeros(1, dtype=torch.int64, device=dev)
        offsets = [torch.cumsum(torch.cat([zero, sizes[r]]), 0).tolist() for r in range(world)]
        for j, row in enumerate(frows.tolist()):
            cand = torch.cat([chunks[r][offsets[r][j]:offsets[r][j + 1]] for r in range(world)])
            comp = _composite(cand[:, 0], cand[:, 1])
            top = torch.sort(comp, descending=True).indices[: int(k_eff[row])]
            sel_pos = cand[top, 1].to(torch.int64)
            sel_pos = sel_pos[((sel_pos // interleave) % world) == rank]
            p = torch.sort(sel_pos).values
            own_positions[row, : p.numel()] = p
            own_count[row] = p.numel()
    return TopKResult(own_positions, own_count, first_round_bytes, resend_rows, resend_bytes, c)


# ---- static merge (CUDA-graph capture: no host read, fixed shapes) ----------------------------------------------
INT64_MIN = -(2**63)
_LOW32 = (1 << 32) - 1


def static_topk_own_positions(scores: torch.Tensor, valid: torch.Tensor, k: int, ctx_len: torch.Tensor,
                              interleave: int, group=None) -> torch.Tensor:
    """The static merge (module docstring): this rank's share of the exact global top-k, [T, k] global
    positions this rank stores, ascending, −1 padded. scores [T, L] fp32 over local rows (valid marks real
    ones); ctx_len [T] global context lengths."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    T, L = scores.shape
    dev = scores.device
    pos = global_positions(rank, L, world, interleave, device=dev)
    comp = _composite(order_keys(scores, check_nan=False), pos[None, :].expand(T, L))
    comp = torch.where(valid, comp, torch.full_like(comp, INT64_MIN))
    k_loc = min(k, L)
    sent = torch.topk(comp, k_loc, dim=1).values.contiguous()           # [T, k_loc], best first
    gathered = torch.empty((world * T, k_loc), dtype=torch.int64, device=dev)
    all_gather_concat(gathered, sent, group=group)
    union = gathered.view(world, T, k_loc).permute(1, 0, 2).reshape(T, world * k_loc)
    kk = min(k, world * k_loc)
    best = torch.topk(union, kk, dim=1).values                           # global order: (score desc, pos asc)
    k_eff = ctx_len.to(device=dev, dtype=torch.int64).clamp(max=k)
    chosen = (torch.arange(kk, device=dev)[None, :] < k_eff[:, None]) & (best > INT64_MIN)
    p = _LOW32 - (best & _LOW32)
    mine = chosen & (((p // interleave) % world) == rank)
    big = torch.iinfo(torch.int64).max
    own = torch.sort(torch.where(mine, p, big), dim=1).values
    own = torch.where(own < big, own, -1)
    if kk < k:
        own = torch.cat([own, own.new_full((T, k - kk), -1)], dim=1)
    return own
