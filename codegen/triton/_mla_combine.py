"""The launches around the sparse MLA attention kernel (mla_sparse.py, which holds the attention itself, the
host API `sparse_latent_attention` / `mla_sparse_decode` and the template):

- before it, the query absorption q~ = W_UK^T q_nope (`_absorb_kernel`, launched by `absorb_queries`;
  `split_kv_b` cuts kv_b_proj into W_UK and W_UV);
- after it, the merge of a token's CHUNK-row pieces with their log-sum-exps (`combine_chunks`, launching
  `_mla_tiles._combine_kernel`: o~ = sum_i e^(lse_i - lse) o~_i, lse = log sum_i e^lse_i, in a fixed order).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ._mla_tiles import _combine_kernel
from ._pdl import launch_kwargs, pdl_launch_dependents, pdl_wait
from codegen.triton import _precision as precision


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _absorb_kernel(qn_ptr, w_ptr, out_ptr, T, H, s_qt, s_qh, s_wh, s_wn, DN: tl.constexpr, KV: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, DOT_DT: tl.constexpr, PREC: tl.constexpr,
                   PDL: tl.constexpr):
    """q~[t, h, k] = sum_n q_nope[t, h, n] W_UK[h, n, k] for BLOCK_T tokens x BLOCK_K latent columns of one
    head (grid: token blocks, heads, column blocks); fp32 accumulation, stored in out's dtype (the
    einsum it replaces ran in q_nope's dtype). q_nope and W_UK are read through their strides. PDL: the
    weight tile (never written during a step) is loaded before the wait on the previous kernel."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1).to(tl.int64)
    kk = tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)
    n = tl.arange(0, DN)
    tm = t < T
    w = tl.load(w_ptr + h * s_wh + n[:, None] * s_wn + kk[None, :])
    pdl_wait(PDL)
    pdl_launch_dependents(PDL)
    q = tl.load(qn_ptr + t.to(tl.int64)[:, None] * s_qt + h * s_qh + n[None, :], mask=tm[:, None], other=0.0)
    acc = tl.dot(q.to(DOT_DT), w.to(DOT_DT), input_precision=PREC)
    tl.store(out_ptr + (t.to(tl.int64)[:, None] * H + h) * KV + kk[None, :], acc, mask=tm[:, None])


def absorb_config(kv: int) -> dict:
    """The absorption's launch config inside the attention node (and mla_absorb.py's heuristic)."""
    return {"BLOCK_T": 16, "BLOCK_K": min(kv, 128), "num_warps": 4}


def absorb_queries(q_nope: torch.Tensor, W_UK: torch.Tensor, dtype: torch.dtype,
                   config: dict | None = None) -> torch.Tensor:
    """q~ = W_UK^T q_nope per head: [T, H, kv] in `dtype` from q_nope [T, H, dn] and W_UK [H, dn, kv] (strided
    views allowed: unit inner strides), one `_absorb_kernel` launch with fp32 accumulation (`config`: BLOCK_T
    tokens x BLOCK_K latent columns a program, num_warps; default `absorb_config`); dn must be a power of two
    >= 16 (else the einsum in `dtype`)."""
    T, H, DN = q_nope.shape
    KV = W_UK.shape[2]
    if DN & (DN - 1) or DN < 16 or KV % 32 or q_nope.stride(2) != 1 or W_UK.stride(2) != 1:
        return torch.einsum("thn,hnk->thk", q_nope.to(dtype), W_UK.to(dtype))
    out = torch.empty(T, H, KV, dtype=dtype, device=q_nope.device)
    if T == 0:
        return out
    f32 = _interpreting() or dtype == torch.float32
    cfg = config or absorb_config(KV)
    bt, bk = int(cfg["BLOCK_T"]), min(KV, int(cfg["BLOCK_K"]))
    if KV % bk or bt < 16 or bt & (bt - 1):
        raise ValueError(f"mla absorb: config {cfg}: BLOCK_K must divide kv={KV}, BLOCK_T a power of two >= 16")
    _absorb_kernel[(-(-T // bt), H, KV // bk)](q_nope, W_UK, out, T, H, q_nope.stride(0), q_nope.stride(1),
                                               W_UK.stride(0), W_UK.stride(1), DN=DN, KV=KV, BLOCK_T=bt,
                                               BLOCK_K=bk, DOT_DT=tl.float32 if f32 else tl.bfloat16,
                                               PREC="ieee" if f32 else precision.low_bits(),
                                               num_warps=int(cfg["num_warps"]), **launch_kwargs())
    return out


def split_kv_b(kv_b: torch.Tensor, H: int, dn: int):
    """kv_b_proj [H*(dn+dv), kv] -> (W_UK [H, dn, kv], W_UV [H, dv, kv])."""
    if kv_b.shape[0] % H:
        raise ValueError(f"mla: kv_b {tuple(kv_b.shape)} rows are not a multiple of H={H}")
    w = kv_b.view(H, kv_b.shape[0] // H, kv_b.shape[1])
    return w[:, :dn], w[:, dn:]


def combine_chunks(po: torch.Tensor, plse: torch.Tensor, o: torch.Tensor, lse: torch.Tensor) -> None:
    """o [T, H, kv], lse [T, H] from the nsplit pieces' partials po fp32 [T, H, nsplit, kv] and plse fp32
    [T, H, nsplit] (one `_combine_kernel` launch)."""
    T, H, nsplit, KV = po.shape
    cb = min(KV, 128)
    _combine_kernel[(T * H, KV // cb)](po, plse, o, lse, nsplit, KV=KV, CB=cb,
                                       SB=min(64, triton.next_power_of_2(nsplit)), num_warps=4, **launch_kwargs())
