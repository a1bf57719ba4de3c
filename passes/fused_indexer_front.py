"""Fused indexer front: everything the DSA indexer computes per new token before scoring, in one kernel.

Pattern (per `indexer_topk`, SPEC §5 steps 1–5; `%iq` may be a result of a `fused.packed_linear`,
e.g. packed with the MLA q_b projection because both read c_Q: it is taken out of that pack):
    %iq = linear(%c_q, @wq_b)                   %kn = layer_norm(%ik, @k_norm.w, @k_norm.b) {eps}
    %iq3 = reshape(%iq) {shape=[-1, HI, DI]}     %kr = hadamard(%kn)
    %qr = hadamard(%iq3)                         %k8, %ks = quantize_fp8_pow2(%kr)
    %q8, %qs = quantize_fp8_pow2(%qr)            %keys = cache_write(%key_pool, %k8, %req, %pos, %tbl) {block_size}
    %w = scale(%iw) {factor}                     %scales = cache_write(%scale_pool, %ks, %req, %pos, %tbl) {block_size}
    %sel = indexer_topk(%q8, %qs, %w, %keys, %scales, ...)
Rewrite:
    %q8, %qs, %w, %keys, %scales = fused.indexer_front(%c_q, @wq_b, %ik, @k_norm.w, @k_norm.b, %iw,
        %key_pool, %scale_pool, %req, %pos, %tbl) {heads, head_dim, eps, weight_scale, quant="fp8_pow2", block_size}
    body: the nodes above; indexer_topk's operands are unchanged.

The fused op (what a kernel's `launch` receives, `a.operands` in this order):
    c_q        [T, q_lora]       the MLA query latent after its RMSNorm (shared with the MLA query path)
    wq_b       [HI*DI, q_lora]   indexer query projection
    ik         [T, DI]           the index-key projection W_Ik x (kept in the packed input projection)
    k_norm_w   [DI], k_norm_b [DI]  LayerNorm weight and bias
    iw         [T, HI]           the head-weight projection W_Iw x (kept in the packed input projection)
    key_pool   f8e4m3[N, DI], scale_pool f32[N]   index-key cache pools, updated in place (or block views
               f8e4m3[NB, bs, DI] / f32[NB, bs]: pages of the packed block pool, `ir.ref.paging`)
    token_req, token_pos [T], block_table [R, MB] cache addressing (`ir.ref.paging`, block_size rows per block)
  attrs: heads=HI, head_dim=DI, eps (LayerNorm), weight_scale (= HI^-1/2 DI^-1/2), quant="fp8_pow2", block_size
  results, in indexer_topk's operand order:
    q8 f8e4m3[T, HI, DI]  = fp8(H_DI (W_Iq c_q)_j) per (token, head j), with
    q_scale f32[T, HI]      its power-of-two scale (SPEC §5.4);
    w [T, HI]             = weight_scale * iw;
    key_pool, scale_pool  with the row of (token_req[t], token_pos[t]) = fp8(H_DI LayerNorm(ik_t)), its scale.
(H_DI: Hadamard rotation / sqrt(DI).)

Head weights folded in (SPEC §5): the score needs, per token and head j, w_j * s_q,j * (q8_j . k) * s_k.
(the scales are positive, so they commute with the ReLU). Because s_q,j is a power of two, w_j * s_q,j
is exact (an exponent shift, no rounding), so the kernels
fold it into one per-(token, head) weight (the scorer multiplies once instead of dequantising q); the IR
keeps indexer_topk's operands (q8, q_scale, w) separate and unchanged, so the reference, this node and
the scorer kernel stay interchangeable.  The query norm (c_Q = RMSNorm(W_qa x)) is not fused here: c_Q is
shared with the MLA query path, which runs beside the indexer (`overlapped_mla_query`).

This module also holds the small rewrite helpers the other fusion passes share (`order_signature`,
`take_from_pack`, `group_escapes`, ...).

Preconditions (PassError otherwise): the key and the key-scale cache writes address the same rows
(same token_req, token_pos, block_table values and block_size), since the kernel writes both at one row.  Layers whose
graph differs from the pattern (another quantiser, intermediates read elsewhere) are left unfused.
Postconditions: one fused.indexer_front per indexer; numerics unchanged (the body is the original nodes).
"""

from __future__ import annotations

from ir.core import Function, Module, Node

from .base import PassContext, PassError
from .rewrite import (
    fuse, group_escapes, linear_source, order_signature, producers, rewrite_each, single_user, take_from_pack
)

NAME = "fused_indexer_front"
FUSED_OP = "fused.indexer_front"


# ---- the pattern ----------------------------------------------------------------------------------
def _match(fn: Function, topk: Node):
    """The indexer front feeding `topk` as a dict of nodes, or None when the graph differs."""
    prod = producers(fn)
    src = [prod.get(id(v)) for v in topk.inputs[:5]]
    qq, _, sw, cwk, cws = src
    if not (qq and qq.op == "quantize_fp8_pow2" and topk.inputs[:2] == qq.outputs and sw and sw.op == "scale"
            and cwk and cwk.op == "cache_write" and cws and cws.op == "cache_write"):
        return None
    hq = prod.get(id(qq.inputs[0]))
    rq = prod.get(id(hq.inputs[0])) if hq and hq.op == "hadamard" else None
    if not (rq and rq.op == "reshape"):
        return None
    qk = prod.get(id(cwk.inputs[1]))
    if not (qk and qk.op == "quantize_fp8_pow2" and prod.get(id(cws.inputs[1])) is qk
            and cwk.inputs[1] is qk.outputs[0] and cws.inputs[1] is qk.outputs[1]):
        return None
    hk = prod.get(id(qk.inputs[0]))
    ln = prod.get(id(hk.inputs[0])) if hk and hk.op == "hadamard" else None
    if not (ln and ln.op == "layer_norm"):
        return None
    return {"rq": rq, "hq": hq, "qq": qq, "ln": ln, "hk": hk, "qk": qk, "cwk": cwk, "cws": cws, "sw": sw}


def _check_rows(fn: Function, m: dict):
    cwk, cws = m["cwk"], m["cws"]
    if any(a is not b for a, b in zip(cwk.inputs[2:], cws.inputs[2:])) or \
            cwk.attrs["block_size"] != cws.attrs["block_size"]:
        raise PassError(f"{NAME}: in @{fn.name}, the index-key write {cwk.output.ref} addresses rows with "
                        f"({', '.join(v.ref for v in cwk.inputs[2:])}) but the key-scale write {cws.output.ref} with "
                        f"({', '.join(v.ref for v in cws.inputs[2:])}): the fused kernel writes both at one row")


def _rewrite(fn: Function, topk: Node) -> bool:
    m = _match(fn, topk)
    if m is None:
        return False
    _check_rows(fn, m)
    iq = m["rq"].inputs[0]
    results = topk.inputs[:5]
    if not linear_source(fn, iq) or single_user(fn, iq) is not m["rq"] or \
            group_escapes(fn, list(m.values())) != {id(v) for v in results}:
        return False  # the query is not projected by a linear, or an intermediate is read elsewhere
    lin = take_from_pack(fn, iq)
    group = [lin, *m.values()]
    ln, cwk, cws, sw = m["ln"], m["cwk"], m["cws"], m["sw"]
    hi, di = (int(d) for d in m["qq"].outputs[0].type.shape[1:])
    attrs = {"heads": hi, "head_dim": di, "eps": ln.attrs["eps"], "weight_scale": sw.attrs["factor"],
             "quant": "fp8_pow2", "block_size": cwk.attrs["block_size"]}
    operands = [lin.inputs[0], lin.inputs[1], ln.inputs[0], ln.inputs[1], ln.inputs[2], sw.inputs[0],
                cwk.inputs[0], cws.inputs[0], *cwk.inputs[2:]]
    fused = fuse(fn, group, FUSED_OP, attrs)
    order_signature(fused, operands, [v.name for v in results])
    return True


def run(module: Module, ctx: PassContext) -> int:
    return rewrite_each(module, ctx, NAME, "indexer_topk", _rewrite)
