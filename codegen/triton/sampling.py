"""Token sampling on the device: greedy, temperature and top-p (nucleus), one uniform random number
per row supplied by the caller (so a request's draw depends only on its own generator). Not an IR op:
the runtime calls `sample_tokens` on the logits. Semantics of `k31c/runtime/sampling.py`:

  temperature 0: the first index of max(logits).
  otherwise: z = logits / T, p = softmax(z); order tokens by z descending, ties by lower index (the
  stable sort); the nucleus is the smallest prefix of that order whose mass reaches top_p, i.e. token
  j is kept iff the mass strictly before it is < top_p; the sample is the first kept token j (index
  order) whose inclusive cumulative kept mass exceeds u * (kept mass): an inverse-CDF draw, which has
  the distribution of the runtime's multinomial over the nucleus.

One program per row, the row streamed in BLOCK_V chunks (never sorted):
  pass 1   online max/sum: m = max z, Z = sum e^{z-m}; first argmax; a NaN/inf flag.
  search   over the order-preserving int keys of z (key(f) = bits(f) ^ (sign ? 0x7FFFFFFF : 0)): the
           cutoff key k* = the smallest key with M(k) = sum_{key_j > k} e_j < top_p Z; each pass
           evaluates M at 16 keys and keeps one sixteenth of the interval (<= 9 passes); every key
           above k* is kept; of the n ties at k*, the first
           c = min(n, ceil((top_p Z - M(k*)) / e*)) in index order are kept.  (Skipped when top_p >= 1.)
  draw     scan in index order with an inclusive cumulative sum until it exceeds u * kept mass.
All in fp32 (the runtime sorts in fp64: the two can differ only where fp32 rounding moves a token
across the nucleus boundary or the draw point). A row with NaN/inf logits gets id -1; `sample_tokens`
raises FloatingPointError for it, as the runtime's Sampler does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _key_of(z):
    b = z.to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF).to(tl.int64)


@triton.jit
def _mass_above(row_ptr, V, k, m, inv_t, BLOCK_V: tl.constexpr):
    """(sum of e^{z-m} over tokens with key > k, count of tokens with key == k)."""
    mass = tl.zeros((), tl.float32)
    ties = tl.zeros((), tl.int32)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        ok = offs < V
        z = tl.load(row_ptr + offs, mask=ok, other=0.0).to(tl.float32) * inv_t + 0.0
        key = _key_of(z)
        mass += tl.sum(tl.where(ok & (key > k), tl.exp(z - m), 0.0), axis=0)
        ties += tl.sum((ok & (key == k)).to(tl.int32), axis=0)
    return mass, ties


@triton.jit
def _narrow(row_ptr, V, lo, hi, target, m, inv_t, BLOCK_V: tl.constexpr, WAYS: tl.constexpr):
    """One pass of a WAYS-way search: M(k) at WAYS keys splitting (lo, hi]; returns the sub-interval
    (lo', hi'] with M(lo') >= target > M(hi'). BLOCK_V here is small: the tile is [BLOCK_V, WAYS]."""
    i = tl.arange(0, WAYS)
    th = lo + ((hi - lo) * (i + 1).to(tl.int64)) // WAYS  # th[WAYS-1] == hi
    mass = tl.zeros((WAYS,), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        ok = offs < V
        z = tl.load(row_ptr + offs, mask=ok, other=0.0).to(tl.float32) * inv_t + 0.0
        e = tl.where(ok, tl.exp(z - m), 0.0)
        above = _key_of(z)[:, None] > th[None, :]
        mass += tl.sum(tl.where(above, e[:, None], 0.0), axis=0)
    first = tl.min(tl.where(mass < target, i, WAYS - 1), axis=0)
    new_hi = tl.sum(tl.where(i == first, th, 0), axis=0)
    new_lo = tl.where(first > 0, tl.sum(tl.where(i == first - 1, th, 0), axis=0), lo)
    return new_lo, new_hi


@triton.jit
def _sample_kernel(logits_ptr, temp_ptr, top_p_ptr, u_ptr, out_ptr, V, stride_row, BLOCK_V: tl.constexpr,
                   NARROW_V: tl.constexpr):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    t = tl.load(temp_ptr + row).to(tl.float32)
    top_p = tl.load(top_p_ptr + row).to(tl.float32)
    u = tl.load(u_ptr + row).to(tl.float32)
    greedy = t <= 0.0
    inv_t = tl.where(greedy, 1.0, 1.0 / tl.where(greedy, 1.0, t))
    # pass 1: max, first argmax, online sum, finiteness
    m = tl.full((), -float("inf"), tl.float32)
    lmax = tl.full((), -float("inf"), tl.float32)
    best = tl.zeros((), tl.int32)
    zsum = tl.zeros((), tl.float32)
    bad = tl.zeros((), tl.int32)
    kmin = _key_of(tl.full((), float("inf"), tl.float32))
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        ok = offs < V
        raw = tl.load(row_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        bad += tl.sum((ok & ((raw != raw) | (tl.abs(raw) == float("inf")))).to(tl.int32), axis=0)
        lv = tl.where(ok, raw, -float("inf"))
        cmax = tl.max(lv, axis=0)
        cidx = tl.min(tl.where(lv == cmax, offs, V), axis=0)
        best = tl.where(cmax > lmax, cidx, best)
        lmax = tl.maximum(lmax, cmax)
        z = raw * inv_t + 0.0
        zm = tl.maximum(m, tl.max(tl.where(ok, z, -float("inf")), axis=0))
        zsum = zsum * tl.exp(m - zm) + tl.sum(tl.where(ok, tl.exp(z - zm), 0.0), axis=0)
        m = zm
        kmin = tl.minimum(kmin, tl.min(tl.where(ok, _key_of(z), kmin), axis=0))
    choice = best
    if (bad == 0) & (t > 0.0):
        # nucleus cutoff: M(lo) >= top_p Z > M(hi), M(k) non-increasing, hi = key(max z) has M = 0
        lo = kmin - 1
        hi = _key_of(m)
        target = top_p * zsum
        cut_mass = tl.zeros((), tl.float32)
        n_ties = tl.zeros((), tl.int32)
        if top_p < 1.0:
            while hi - lo > 1:
                lo, hi = _narrow(row_ptr, V, lo, hi, target, m, inv_t, NARROW_V, 16)
            cut_mass, n_ties = _mass_above(row_ptr, V, hi, m, inv_t, BLOCK_V)
        else:
            hi = kmin - 1  # everything is above the cutoff
            cut_mass = zsum
            n_ties = tl.zeros((), tl.int32)
        # the value at the cutoff key, and how many of its ties are kept
        zb = tl.where(hi >= 0, hi, hi ^ 0x7FFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)
        e_cut = tl.exp(zb - m)
        keep_ties = tl.minimum(n_ties, tl.maximum(1, tl.ceil((target - cut_mass) / e_cut).to(tl.int32)))
        keep_ties = tl.where(top_p < 1.0, keep_ties, 0)
        kept_mass = cut_mass + keep_ties.to(tl.float32) * e_cut
        goal = u * kept_mass
        run = tl.zeros((), tl.float32)
        ties_seen = tl.zeros((), tl.int32)
        found = tl.zeros((), tl.int32)
        last_kept = tl.full((), -1, tl.int32)
        for v0 in range(0, V, BLOCK_V):
            if found == 0:
                offs = v0 + tl.arange(0, BLOCK_V)
                ok = offs < V
                z = tl.load(row_ptr + offs, mask=ok, other=0.0).to(tl.float32) * inv_t + 0.0
                key = _key_of(z)
                tie = ok & (key == hi)
                tie_rank = ties_seen + tl.cumsum(tie.to(tl.int32), axis=0) - 1
                kept = ok & ((key > hi) | (tie & (tie_rank < keep_ties)))
                e = tl.where(kept, tl.exp(z - m), 0.0)
                cum = run + tl.cumsum(e, axis=0)
                hit = kept & (cum > goal)
                first = tl.min(tl.where(hit, offs, V), axis=0)
                last_kept = tl.maximum(last_kept, tl.max(tl.where(kept, offs, -1), axis=0))
                choice = tl.where(first < V, first, choice)
                found = tl.where(first < V, 1, found)
                run += tl.sum(e, axis=0)
                ties_seen += tl.sum(tie.to(tl.int32), axis=0)
        # rounding can leave the goal past the last kept token: take that token
        choice = tl.where(found == 1, choice, tl.where(last_kept >= 0, last_kept, best))
    choice = tl.where(bad > 0, -1, choice)
    tl.store(out_ptr + row, choice.to(tl.int64))


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor,
                  *, block_v: int | None = None, check: bool = True, out: torch.Tensor | None = None) -> torch.Tensor:
    """ids int64 [R] for logits [R, V]; temperature, top_p, uniforms [R] (uniforms in [0, 1)).
    check=True raises FloatingPointError for rows with NaN/inf logits (one device sync). `out`: a contiguous
    int64 [R] tensor on the logits' device to write the ids into (e.g. a runtime's token feed)."""
    if logits.dim() != 2:
        raise ValueError(f"sample_tokens: logits must be [R, V], found {tuple(logits.shape)}")
    R, V = logits.shape
    for name, t in (("temperature", temperature), ("top_p", top_p), ("uniforms", uniforms)):
        if tuple(t.shape) != (R,):
            raise ValueError(f"sample_tokens: {name} must be [{R}], found {tuple(t.shape)}")
    if check:
        if bool((temperature < 0).any()) or not bool(((top_p > 0) & (top_p <= 1)).all()):
            raise ValueError("sample_tokens: temperature must be >= 0 and top_p in (0, 1]")
        if not bool(((uniforms >= 0) & (uniforms < 1)).all()):
            raise ValueError("sample_tokens: uniforms must lie in [0, 1)")
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    if out is None:
        out = torch.empty(R, dtype=torch.int64, device=logits.device)
    elif tuple(out.shape) != (R,) or out.dtype != torch.int64 or out.device != logits.device or not out.is_contiguous():
        raise ValueError(f"sample_tokens: out must be a contiguous int64 [{R}] tensor on {logits.device}, found "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")
    if R == 0:
        return out
    bv = block_v or min(2048, triton.next_power_of_2(V))
    f32 = lambda t: t.to(device=logits.device, dtype=torch.float32).contiguous()  # noqa: E731
    _sample_kernel[(R,)](x, f32(temperature), f32(top_p), f32(uniforms), out, V, x.stride(0), BLOCK_V=bv,
                         NARROW_V=max(16, bv // 8), num_warps=8 if bv >= 2048 else 4)
    if check and bool((out < 0).any()):
        rows = (out < 0).nonzero().flatten().tolist()
        raise FloatingPointError(f"logits contain NaN or inf in rows {rows[:8]}; refusing to sample")
    return out


TEMPLATES: list = []  # not an IR op: the runtime calls sample_tokens directly
