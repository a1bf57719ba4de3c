"""Literal torch reference semantics of the MoE router and routed experts (SPEC §6)."""

from __future__ import annotations

import torch

from .basic import situ_glu, swiglu

__all__ = ["moe_router", "moe_experts"]


def moe_router(logits: torch.Tensor, bias: torch.Tensor | None, topk: int, activation: str,
               renormalize: bool, scaling: float, n_group: int = 1, topk_group: int = 1):
    """Router: (weights [B, topk], ids int64 [B, topk]).

    scores = sigmoid(logits) | softmax(logits, -1); selection on scores + bias (bias only
    selects).  Grouped (DeepSeek-V3 noaux_tc): the E experts form n_group contiguous groups,
    each scored by the sum of its top-2 biased scores (the top-1 when a group has one expert);
    the topk_group best groups are kept (ties to the lower group id), the others' experts
    are excluded (-inf, as transformers' kimi_linear).  n_group = 1 is plain top-k.
    Order of the k entries: descending biased score, ties to the lower expert id.
    weights = scores[ids]; renormalize -> weights / (sum + 1e-20); then * scaling.

    Computed in logits' dtype (fp32 or fp64); half-precision logits are upcast to fp32 (the
    router is fp32 by contract).
    """
    if activation not in ("sigmoid", "softmax"):
        raise ValueError(f"router activation must be 'sigmoid' or 'softmax', got {activation!r}")
    x = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    B, E = x.shape
    if not 1 <= topk <= E:
        raise ValueError(f"topk={topk} out of range for {E} experts")
    if n_group < 1 or E % n_group or not 1 <= topk_group <= n_group:
        raise ValueError(f"bad grouping n_group={n_group} topk_group={topk_group} for E={E}")
    scores = torch.sigmoid(x) if activation == "sigmoid" else torch.softmax(x, dim=-1)
    choice = scores if bias is None else scores + bias.to(device=x.device, dtype=x.dtype)
    if n_group > 1:
        per = E // n_group
        grouped = choice.view(B, n_group, per)
        top2 = torch.sort(grouped, dim=-1, descending=True).values[..., : min(2, per)]
        gscore = top2.sum(dim=-1)                                   # [B, n_group]
        gorder = torch.sort(gscore, dim=-1, descending=True, stable=True).indices
        keep = torch.zeros(B, n_group, dtype=torch.bool, device=x.device)
        keep.scatter_(1, gorder[:, :topk_group], True)
        emask = keep.unsqueeze(-1).expand(B, n_group, per).reshape(B, E)
        if topk > topk_group * per:
            raise ValueError("topk exceeds the experts in the kept groups")
        choice = choice.masked_fill(~emask, float("-inf"))
    ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :topk]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * scaling
    return weights, ids.to(torch.int64)


def moe_experts(z: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w1: torch.Tensor,
                w2: torch.Tensor, w3: torch.Tensor, act: str, beta1: float | None = None,
                beta2: float | None = None) -> torch.Tensor:
    """y[t] = sum_k weights[t,k] * W2_e act(W1_e z_t, W3_e z_t), e = ids[t,k].

    z [B, l]; weights [B, k]; ids int64 [B, k]; w1, w3 [E, I, l]; w2 [E, l, I].
    act "situ" (SiTU-GLU with beta1/beta2) or "silu" (SwiGLU).  Everything runs in z's dtype
    (weights and expert matrices are cast to it).  Experts with no tokens are skipped.  The
    per-(token, slot) expert outputs are stored and then summed over k in slot order, so the
    result is deterministic (no atomic scatter-add).
    """
    if act not in ("situ", "silu"):
        raise ValueError(f"expert activation must be 'situ' or 'silu', got {act!r}")
    B, ell = z.shape
    k = ids.shape[1]
    dt = z.dtype
    ids = ids.to(device=z.device, dtype=torch.int64)
    outs = z.new_zeros(B, k, ell)
    for e in torch.unique(ids).tolist():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        zt = z[tok]
        a = zt @ w1[e].to(dt).t()
        u = zt @ w3[e].to(dt).t()
        h = situ_glu(a, u, beta1, beta2) if act == "situ" else swiglu(a, u)
        outs[tok, slot] = h @ w2[e].to(dt).t()
    return (weights.to(dt).unsqueeze(-1) * outs).sum(dim=1)
