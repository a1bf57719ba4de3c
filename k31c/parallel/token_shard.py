"""Token-sharded prefill layout changes (DESIGN §5 T3, issue 8).

Causal balance: request i of length L_i is cut into 2·TP pieces with boundaries b_j = (j·L_i) // (2·TP),
j = 0..2·TP; rank r takes pieces r and 2·TP−1−r (an early, cheap piece and a late, expensive one).
Tokens are numbered in the flattened ragged batch (request i occupies offsets[i] .. offsets[i] + L_i);
rank r's tokens, in order, are for each request piece r then piece 2·TP−1−r.

heads_to_tokens: rank r holds x [N, H/TP, D] (every token, its head block r) and receives
y [n_r, H, D] (its n_r tokens, every head; head block s came from rank s) — one all_to_all_single with
uneven splits. tokens_to_heads is its inverse; the round trip is the identity.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def causal_balance_pieces(seq_lens: list[int], tp: int, rank: int) -> list[tuple[int, int, int]]:
    """(request, start, end) token ranges of `rank`, request-local, in the order the rank stores them."""
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} outside tp={tp}")
    cuts = 2 * tp
    pieces = []
    for req, n in enumerate(seq_lens):
        for j in (rank, cuts - 1 - rank):
            pieces.append((req, (j * n) // cuts, ((j + 1) * n) // cuts))
    return pieces


def causal_balance_indices(seq_lens: list[int], tp: int) -> list[torch.Tensor]:
    """Per rank, the flattened-batch indices of its tokens (int64), in rank order of storage.
    Together they are a permutation of range(sum(seq_lens))."""
    offsets = [0]
    for n in seq_lens:
        offsets.append(offsets[-1] + n)
    out = []
    for r in range(tp):
        parts = [torch.arange(offsets[q] + a, offsets[q] + b, dtype=torch.int64)
                 for q, a, b in causal_balance_pieces(seq_lens, tp, r)]
        out.append(torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64))
    return out


def _check(x: torch.Tensor, n_tokens: int, what: str):
    if x.dim() < 2 or x.shape[0] != n_tokens:
        raise ValueError(f"{what}: expected [{n_tokens}, heads, ...], got {tuple(x.shape)}")


def heads_to_tokens(x: torch.Tensor, seq_lens: list[int], group=None) -> torch.Tensor:
    """x [N, H/TP, *rest] (all tokens, this rank's heads)
    → [n_r, H, *rest] (this rank's tokens, all heads)."""
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    idx = [i.to(x.device) for i in causal_balance_indices(seq_lens, tp)]
    _check(x, sum(seq_lens), "heads_to_tokens")
    send = torch.cat([x[i] for i in idx]).contiguous()
    n_r = idx[rank].numel()
    recv = x.new_empty((tp * n_r,) + tuple(x.shape[1:]))
    dist.all_to_all_single(recv, send, output_split_sizes=[n_r] * tp,
                           input_split_sizes=[i.numel() for i in idx], group=group)
    hl = x.shape[1]
    rest = tuple(x.shape[2:])
    return recv.view((tp, n_r, hl) + rest).transpose(0, 1).reshape((n_r, tp * hl) + rest)


def tokens_to_heads(y: torch.Tensor, seq_lens: list[int], group=None) -> torch.Tensor:
    """Inverse of heads_to_tokens: y [n_r, H, *rest] → [N, H/TP, *rest] in flattened-batch order."""
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    idx = [i.to(y.device) for i in causal_balance_indices(seq_lens, tp)]
    n_r = idx[rank].numel()
    _check(y, n_r, "tokens_to_heads")
    if y.shape[1] % tp:
        raise ValueError(f"tokens_to_heads: {y.shape[1]} heads not divisible by tp={tp}")
    hl = y.shape[1] // tp
    rest = tuple(y.shape[2:])
    send = y.reshape((n_r, tp, hl) + rest).transpose(0, 1).contiguous().view((tp * n_r, hl) + rest)
    sizes = [i.numel() for i in idx]
    recv = y.new_empty((sum(sizes), hl) + rest)
    dist.all_to_all_single(recv, send, output_split_sizes=sizes,
                           input_split_sizes=[n_r] * tp, group=group)
    out = torch.empty_like(recv)
    out[torch.cat(idx)] = recv
    return out
