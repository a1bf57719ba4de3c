"""LatentMoE tail: latent RMSNorm + cast + up-projection l -> d + shared-expert add, one kernel.

Pattern (SPEC §6, latent path after the experts):
    %y = moe_experts(%z, %weights, %ids, @w1, @w2, @w3)                    f32[T, l]  (weighted sum inside)
    %yn = rms_norm(%y, @routed_expert_norm) {eps}
    %yc = cast(%yn) {dtype=act}
    %yu = linear(%yc, @routed_expert_up_proj)                               [T, d]
    %out = add(%yu, %shared)                                                (either operand order)
Rewrite:
    %out = fused.latent_moe_tail(%y, @routed_expert_norm, @routed_expert_up_proj, %shared) {eps, dtype}

The fused op (`a.operands` in this order):
    y_latent f32[T, l]     the weighted expert sum  sum_k g_k E_{idx_k}(z)  (fp32, SPEC §6)
    norm_w [l]             latent RMSNorm weight
    w_up [d, l]            latent up-projection
    shared [T, d]          the shared experts' output
  attrs: eps (latent RMSNorm), dtype (the storage dtype the normalised latent is cast to before the GEMM)
  result: out [T, d] = w_up @ cast(rmsnorm(y_latent) * norm_w) + shared
The weighted expert combine (sum_k g_k E_k) lives inside the `moe_experts` op in this IR, so it is not
part of this node; a MoE kernel may still emit y_latent from its combine epilogue.
Norm weight folding: w_up (rmsnorm(y) * w) = (w_up diag(w)) (y / rms(y)), so a kernel may use the folded
weight W' = w_up * w[None, :] (computed once per weight; in bf16 that rounds W' once, which the bf16
tolerance covers) and apply only the per-row 1/rms(y) scale in its prologue. Under TP the latent partial
sums are reduced before this node (the norm needs the full row).

Preconditions: none beyond the pattern; configurations without the latent norm, the up-projection or a
shared expert (Kimi-Linear, K3 with latent_moe_use_norm=false) and graphs whose intermediates are read
elsewhere are left unfused.
Postconditions: one fused.latent_moe_tail per LatentMoE layer; numerics unchanged (the body is the
original nodes).
"""

from __future__ import annotations

from ir.core import Function, Module, Node

from .base import PassContext
from .rewrite import fuse, order_signature, single_user, uses

NAME = "latent_moe_tail"
FUSED_OP = "fused.latent_moe_tail"


def _match(fn: Function, experts: Node, use_map: dict):
    """(rms_norm, cast, linear, add) after `experts`, or None."""
    norm = single_user(fn, experts.output, use_map)
    if norm is None or norm.op != "rms_norm" or len(norm.inputs) != 2:
        return None
    cast = single_user(fn, norm.output, use_map)
    up = single_user(fn, cast.output, use_map) if cast is not None and cast.op == "cast" else None
    if up is None or up.op != "linear" or up.inputs[0] is not cast.output or not up.inputs[1].is_param:
        return None
    add = single_user(fn, up.output, use_map)
    if add is None or add.op != "add" or add.inputs[0] is add.inputs[1]:
        return None
    return norm, cast, up, add


def _apply(fn: Function, norm: Node, cast: Node, up: Node, add: Node):
    shared = add.inputs[1] if add.inputs[0] is up.output else add.inputs[0]
    fused = fuse(fn, [norm, cast, up, add], FUSED_OP, {"eps": norm.attrs["eps"], "dtype": cast.attrs["dtype"]})
    order_signature(fused, [norm.inputs[0], norm.inputs[1], up.inputs[1], shared])


def run(module: Module, ctx: PassContext) -> int:
    rewrites = 0
    for fn in module.functions.values():
        use_map = uses(fn)  # one use map for every layer: the groups are disjoint chains
        plans = [m for n in fn.nodes if n.op == "moe_experts" and (m := _match(fn, n, use_map)) is not None]
        for plan in plans:
            _apply(fn, *plan)
        rewrites += len(plans)
    ctx.count(NAME, rewrites)
    return rewrites
