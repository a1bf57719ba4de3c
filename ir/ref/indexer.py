"""Literal torch reference semantics of the DSA lightning indexer scores and top-k (SPEC §5).

Inputs are already rotated, quantised and dequantised (``ir.formats`` does the FP8 / MXFP4
round trip); this module does steps 6-7: I(t,s) = sum_j w_j(t) ReLU(q_j(t) . k(s)) over the
causal context and the deterministic top-k.  Context rule as in ``ir.ref.mla``: token i
(request token_req[i], position token_pos[i]) sees positions 0..token_pos[i], whose keys live
at the pool rows the paged block table gives (``ir.ref.paging``).
"""

from __future__ import annotations

import torch

from .paging import cache_rows, read_rows

__all__ = ["indexer_topk", "indexer_dense_scores", "indexer_scores_padded"]

_BLOCK_ELEMS = 1 << 26


def indexer_scores_padded(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor,
                          token_pos: torch.Tensor, token_req: torch.Tensor,
                          block_table: torch.Tensor, block_size: int):
    """(scores [B, L], valid [B, L]) with L = max(token_pos)+1; column s is position s.

    scores[i, s] = sum_j w[i, j] * relu(q[i, j] . keys[row(r_i, s)]) for s <= token_pos[i]; keys is a
    flat pool [N, DI] or a block view [NB, block_size, DI] (``ir.ref.paging``);
    invalid (non-causal) entries are -inf.  Computed in q's dtype.
    """
    B, HI, DI = q.shape
    dt, dev = q.dtype, q.device
    tp = token_pos.to(device=dev, dtype=torch.int64)
    L = int(tp.max().item()) + 1 if B else 0
    pos = torch.arange(L, device=dev, dtype=torch.int64)
    valid = pos.unsqueeze(0) <= tp.unsqueeze(1)
    req = token_req.to(device=dev, dtype=torch.int64)
    w = w.to(dt)
    scores = q.new_full((B, L), float("-inf"))
    bs = max(1, _BLOCK_ELEMS // max(1, L * (DI + HI)))
    for s in range(0, B, bs):
        e = min(B, s + bs)
        rows = cache_rows(block_table, block_size, req[s:e].unsqueeze(1), torch.where(valid[s:e], pos, 0))  # [b, L]
        kk = read_rows(keys, rows, block_size).to(dt)                     # [b, L, DI]
        logits = torch.relu(torch.einsum("bjd,bld->bjl", q[s:e], kk))     # [b, HI, L]
        sc = torch.einsum("bj,bjl->bl", w[s:e], logits)
        scores[s:e] = sc.masked_fill(~valid[s:e], float("-inf"))
    return scores, valid


def indexer_dense_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor,
                         token_pos: torch.Tensor, token_req: torch.Tensor,
                         block_table: torch.Tensor, block_size: int) -> list[torch.Tensor]:
    """Per token, the full score vector I(t, 0..token_pos) (length token_pos+1)."""
    scores, _ = indexer_scores_padded(q, w, keys, token_pos, token_req, block_table, block_size)
    return [scores[i, : int(p) + 1] for i, p in enumerate(token_pos.tolist())]


def indexer_topk(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, token_pos: torch.Tensor,
                 token_req: torch.Tensor, block_table: torch.Tensor, block_size: int, topk: int):
    """Sel(t) = top-k of I(t, .) over the causal context, k = min(topk, pos+1).

    Ties are broken by the LOWER position: a stable descending sort over scores laid out by
    ascending position.  Returns (selection int64 [B, topk], scores [B, topk]): selected
    positions sorted ascending with their scores, padded at the end with -1 / -inf when the
    context is shorter than topk (then every causal position is selected).
    """
    if topk < 1:
        raise ValueError("topk must be >= 1")
    scores, valid = indexer_scores_padded(q, w, keys, token_pos, token_req, block_table, block_size)
    B, L = scores.shape
    dev = scores.device
    if L < topk:
        scores = torch.cat([scores, scores.new_full((B, topk - L), float("-inf"))], dim=1)
        valid = torch.cat([valid, valid.new_zeros(B, topk - L)], dim=1)
    # Sort key: valid entries first (by score, descending), invalid last.  Scores of valid
    # entries are finite, but order on validity explicitly so -inf padding never competes.
    key = scores.masked_fill(~valid, float("-inf"))
    _, order = torch.sort(key, dim=1, descending=True, stable=True)
    # stable sort on validity too (valid first) keeps the score order inside the valid group
    vsorted = valid.gather(1, order)
    _, vorder = torch.sort((~vsorted).to(torch.int8), dim=1, stable=True)
    order = order.gather(1, vorder)[:, :topk]                # positions, best first
    chosen_valid = valid.gather(1, order)
    big = torch.iinfo(torch.int64).max
    sel = torch.where(chosen_valid, order, torch.full_like(order, big))
    sel, perm = torch.sort(sel, dim=1)                        # ascending, padding last
    chosen_valid = chosen_valid.gather(1, perm)
    out_scores = scores.gather(1, sel.clamp(max=scores.shape[1] - 1))
    out_scores = out_scores.masked_fill(~chosen_valid, float("-inf"))
    sel = sel.masked_fill(~chosen_valid, -1)
    return sel.to(device=dev), out_scores
