"""Combine partial attention outputs by log-sum-exp (DESIGN §5 T4: DCP decode, issue 8).

Rank r attends over its own tokens S_r and holds o_r = Σ_{s∈S_r} softmax_r(s)·v_s (normalised over S_r)
and lse_r = log Σ_{s∈S_r} exp(score_s). Over the union S = ∪ S_r:

    m = max_r lse_r,   w_r = exp(lse_r − m),   o = Σ_r w_r·o_r / Σ_r w_r,   lse = m + log Σ_r w_r.

A rank with an empty shard has lse_r = −inf and o_r = 0 and gets weight 0. If every shard is empty
(m = −inf) the result is o = 0, lse = −inf — never NaN. Arithmetic in fp32 (or the input's wider dtype).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _weights(lse: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    return torch.exp(lse - m_safe)  # exp(−inf) = 0 for empty shards


def _finish(num: torch.Tensor, den: torch.Tensor, m: torch.Tensor, dtype):
    safe = torch.where(den > 0, den, torch.ones_like(den))
    out = torch.where(den[..., None] > 0, num / safe[..., None], torch.zeros_like(num))
    lse = torch.where(den > 0, m + torch.log(safe), torch.full_like(m, float("-inf")))
    return out.to(dtype), lse


def combine_partials(outs: torch.Tensor, lses: torch.Tensor):
    """Local combine of stacked partials: outs [W, rows, H, D], lses [W, rows, H]
    → (o [rows, H, D], lse [rows, H])."""
    if outs.shape[:-1] != lses.shape:
        raise ValueError(f"lse combine: outs {tuple(outs.shape)} do not match lses {tuple(lses.shape)}")
    acc = torch.promote_types(outs.dtype, torch.float32)
    outs, lses = outs.to(acc), lses.to(acc)
    m = lses.max(0).values
    w = _weights(lses, m[None])
    return _finish((w[..., None] * outs).sum(0), w.sum(0), m, acc)


def lse_combine(out: torch.Tensor, lse: torch.Tensor, group=None):
    """Distributed combine: this rank's partial out [rows, H, D], lse [rows, H] → the full-context
    (out, lse) on every rank, by one all-reduce(max) of lse and one all-reduce(sum) of [w·o | w]."""
    if out.shape[:-1] != lse.shape:
        raise ValueError(f"lse combine: out {tuple(out.shape)} does not match lse {tuple(lse.shape)}")
    acc = torch.promote_types(out.dtype, torch.float32)
    out, lse = out.to(acc), lse.to(acc)
    m = lse.clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    w = _weights(lse, m)
    packed = torch.cat([w[..., None] * out, w[..., None]], dim=-1).contiguous()
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    return _finish(packed[..., :-1], packed[..., -1], m, acc)
