"""Literal torch reference semantics for the elementwise / normalisation ops (SPEC §2-§6).

Conventions shared by every function in ``ir.ref``:

* Plain functions, no modules.  Device-agnostic: every helper tensor is created on the
  device of the inputs.
* Dtype-agnostic: the math runs in the dtype of the (first) float activation input.
  Parameters (weights, biases) are cast to that dtype so that e.g. fp32 parameters with
  fp64 activations compute in fp64.  Nothing is silently up/downcast beyond that.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "rms_norm",
    "layer_norm",
    "l2_norm",
    "situ_glu",
    "swiglu",
    "gated_rms_norm",
    "hadamard_matrix",
    "hadamard_rotate",
    "attn_res_mix",
]


def _like(p: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    """Parameter ``p`` cast to ``x``'s dtype/device (None passes through)."""
    if p is None:
        return None
    return p.to(device=x.device, dtype=x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2, -1) + eps) * weight, over the last axis (weight None: no gain)."""
    y = x / torch.sqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * _like(weight, x)
    return y


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
               eps: float) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) * weight + bias over the last axis, biased variance."""
    mu = x.mean(dim=-1, keepdim=True)
    xc = x - mu
    var = xc.pow(2).mean(dim=-1, keepdim=True)
    y = xc / torch.sqrt(var + eps)
    if weight is not None:
        y = y * _like(weight, x)
    if bias is not None:
        y = y + _like(bias, x)
    return y


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(sum(x^2, -1) + eps) over the last axis (eps inside the sqrt, as fla's l2norm)."""
    return x / torch.sqrt(x.pow(2).sum(dim=-1, keepdim=True) + eps)


def situ_glu(a: torch.Tensor, u: torch.Tensor, beta1: float | None,
             beta2: float | None) -> torch.Tensor:
    """SiTU-GLU: (beta1*tanh(a/beta1)*sigmoid(a)) * (beta2*tanh(u/beta2)).

    beta2=None: the up branch is used raw (u).  beta1=None is read as beta1 = 1 (SPEC §1:
    "SiTU betas absent -> beta1 = 1 and no tanh on the up branch").
    """
    b1 = 1.0 if beta1 is None else float(beta1)
    gate = b1 * torch.tanh(a / b1) * torch.sigmoid(a)
    if beta2 is None:
        up = u
    else:
        b2 = float(beta2)
        up = b2 * torch.tanh(u / b2)
    return gate * up


def swiglu(a: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(a) * u."""
    return F.silu(a) * u


def gated_rms_norm(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor | None,
                   eps: float) -> torch.Tensor:
    """rms_norm(o, weight, eps) * sigmoid(gate); o and gate shaped [..., D] (KDA output norm)."""
    return rms_norm(o, weight, eps) * torch.sigmoid(gate.to(o.dtype))


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float32,
                    device: torch.device | str | None = None) -> torch.Tensor:
    """Unnormalised Sylvester Hadamard matrix H_n (entries +-1), n a power of two.

    H_1 = [1], H_2m = [[H_m, H_m], [H_m, -H_m]]; equivalently H[i, j] = (-1)^popcount(i & j).
    """
    if not isinstance(n, int) or n < 1 or (n & (n - 1)) != 0:
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=dtype, device=device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    return h


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """x @ H_D / sqrt(D) on the last axis (D = x.shape[-1], power of two, else ValueError)."""
    d = x.shape[-1]
    h = hadamard_matrix(d, dtype=x.dtype, device=x.device)
    return torch.matmul(x, h) / (d ** 0.5)


def attn_res_mix(sources: list[torch.Tensor] | tuple[torch.Tensor, ...], proj_w: torch.Tensor,
                 norm_w: torch.Tensor, eps: float) -> torch.Tensor:
    """Attention-Residual mixing, SPEC §2 ``mix``.

    sources: candidates V_i, each [..., d] (bank oldest first, then prefix).
    key_i = V_i / sqrt(mean(V_i^2) + eps)  (no gain);  score_i = sum_c key_i[c]*norm_w[c]*proj_w[c];
    alpha = softmax_i(score);  out = sum_i alpha_i V_i.   Computed in the sources' dtype.
    """
    if len(sources) == 0:
        raise ValueError("attn_res_mix needs at least one source")
    v = torch.stack(list(sources), dim=0)                     # [n, ..., d]
    keys = v / torch.sqrt(v.pow(2).mean(dim=-1, keepdim=True) + eps)
    w = _like(norm_w, v) * _like(proj_w, v)                   # [d]
    score = (keys * w).sum(dim=-1)                            # [n, ...]
    alpha = torch.softmax(score, dim=0)
    return (alpha.unsqueeze(-1) * v).sum(dim=0)
