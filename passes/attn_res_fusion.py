"""AttnRes: the prefix add, the mix over sources (logits, softmax, weighted sum) and the RMSNorm after it,
in one kernel.

Pattern (SPEC §2; `x = mix(prefix, bank)` followed by the sublayer's RMSNorm):
    [%p = add(%prev, %part)]                                   the prefix update, when the last source is one
    %x = attn_res_mix(@proj, @norm, %b_1, ..., %b_n, %p) {eps}
    %h = rms_norm(%x, @w) {eps=norm_eps}
Rewrite:
    [%p,] %h = fused.attn_res_mix_norm(@proj, @norm, @w, %b_1, ..., %b_n, %prev, %part | %p)
        {bank=n, prefix_add=true|false, eps, norm_eps}

The fused op (`a.operands` in this order):
    proj [1, d] or [d] (the mix's projection), mix_norm [d], norm_w [d] (the following RMSNorm's weight),
    bank_1 .. bank_n [T, d] (attrs.bank = n completed-block snapshots, oldest first), then
    prefix_add=true:  prev [T, d], part [T, d]   (the prefix is prev + part: the running block sum plus the
                                                 latest sublayer output)
    prefix_add=false: prefix [T, d]
  attrs: bank (int), prefix_add (bool), eps (mix key RMS eps), norm_eps (the RMSNorm's eps)
  results: prefix_add=true: (prefix [T, d] = prev + part, h [T, d]); prefix_add=false: (h [T, d])
  with V = [bank_1..bank_n, prefix], key_i = V_i / sqrt(mean(V_i^2) + eps), score_i = sum_c key_i[c] mix_norm[c]
  proj[c], alpha = softmax_i(score), x = sum_i alpha_i V_i, h = rmsnorm(x; norm_w, norm_eps); mixing in fp32.

The prefix add is fused when the mix's last source is an add that no node between the add and the RMSNorm
reads. The fused node returns the prefix even when only the mix read it (the output mix's last prefix in
K3: nothing reads it after the mix): storing one row per token costs less than launching the add alone.

Preconditions: none beyond the pattern; a mix whose output is read by anything but one RMSNorm is left
unfused. Postconditions: every attn_res_mix followed by an RMSNorm becomes one fused.attn_res_mix_norm
(in K3/K3.1: both mixes of every layer and the output mix); numerics unchanged.
"""

from __future__ import annotations

from ir.core import Function, Module, Node

from .base import PassContext
from .rewrite import Index, fuse, order_signature, single_user, value_key

NAME = "attn_res_fusion"
FUSED_OP = "fused.attn_res_mix_norm"


def _prefix_add(mix: Node, norm: Node, prod: dict, use_map: dict, index: dict) -> Node | None:
    """The add producing the mix's last source, when it can join the fused node."""
    add = prod.get(id(mix.inputs[-1]))
    if add is None or add.op != "add":
        return None
    i, j = index[id(add)], index[id(norm)]
    later = [r for r in use_map.get(id(add.output), []) if r is not mix]
    if any(i < index[id(r)] < j for r in later):
        return None  # read between the add and the norm: the add must come first
    return add


def _plan(fn: Function, mix: Node, prod: dict, use_map: dict, index: dict):
    """(add or None, mix, norm) when `mix` is followed by its RMSNorm, else None."""
    norm = single_user(fn, mix.output, use_map)
    if norm is None or norm.op != "rms_norm" or len(norm.inputs) != 2:
        return None
    return _prefix_add(mix, norm, prod, use_map, index), mix, norm


def _signature(add: Node | None, mix: Node, norm: Node) -> list:
    proj, mnorm, *bank, last = mix.inputs
    return [proj, mnorm, norm.inputs[1], *bank, *(add.inputs if add else [last])]


def _apply(fn: Function, add: Node | None, mix: Node, norm: Node, graph: Index) -> bool:
    operands = _signature(add, mix, norm)
    if add is not None and len({value_key(v) for v in operands}) != len(operands):
        add, operands = None, _signature(None, mix, norm)  # a value in two roles would collapse into one operand
    if len({value_key(v) for v in operands}) != len(operands):
        return False
    attrs = {"bank": len(mix.inputs) - 3, "prefix_add": add is not None, "eps": mix.attrs["eps"],
             "norm_eps": norm.attrs["eps"]}
    results = [add.output.name, norm.output.name] if add else [norm.output.name]
    fused = fuse(fn, [add, mix, norm] if add else [mix, norm], FUSED_OP, attrs, keep=(add.output,) if add else (),
                 index=graph)
    order_signature(fused, operands, results)
    return True


def run(module: Module, ctx: PassContext) -> int:
    rewrites = 0
    for fn in module.functions.values():
        # Plan every mix on one use map (the groups are disjoint and local), then fuse; operands are
        # read from the nodes when each group is fused, after the values earlier fusions renamed.
        graph = Index(fn)   # the plans read it before any fuse; each fuse keeps it current
        index = {id(n): i for i, n in enumerate(fn.nodes)}
        plans = [_plan(fn, mix, graph.made_by, graph.users, index) for mix in fn.nodes if mix.op == "attn_res_mix"]
        claimed: set[int] = set()
        for plan in filter(None, plans):
            add, mix, norm = plan
            if add is not None and id(add) in claimed:
                add = None  # the last source of two mixes: its add joins the first one only
            claimed.add(id(add))
            rewrites += _apply(fn, add, mix, norm, graph)
    ctx.count(NAME, rewrites)
    return rewrites
