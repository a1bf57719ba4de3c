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

The prefix add is fused only when the mix's last source is an add whose result is read after the mix
(the model's running prefix always is: it feeds the next add or becomes a bank snapshot) and no other
node between the add and the RMSNorm reads it.

Preconditions: none beyond the pattern; a mix whose output is read by anything but one RMSNorm is left
unfused. Postconditions: every attn_res_mix followed by an RMSNorm becomes one fused.attn_res_mix_norm
(in K3/K3.1: both mixes of every layer and the output mix); numerics unchanged.
"""

from __future__ import annotations

from ir.core import Function, Module, Node

from .base import PassContext
from .fused_indexer_front import order_signature, producers, value_key
from .rewrite import fuse, single_user, uses

NAME = "attn_res_fusion"
FUSED_OP = "fused.attn_res_mix_norm"


def _prefix_add(fn: Function, mix: Node, norm: Node) -> Node | None:
    """The add producing the mix's last source, when it can join the fused node."""
    add = producers(fn).get(id(mix.inputs[-1]))
    if add is None or add.op != "add":
        return None
    i, j = fn.nodes.index(add), fn.nodes.index(norm)
    later = [r for r in uses(fn).get(id(add.output), []) if r is not mix]
    if any(i < fn.nodes.index(r) < j for r in later) or not (later or any(v is add.output for v in fn.outputs)):
        return None  # read between the add and the norm, or only by the mix (then it would not be a result)
    operands = [*mix.inputs[:-1], *add.inputs]
    if len({value_key(v) for v in operands}) != len(operands):
        return None  # a value in two roles would collapse into one operand
    return add


def _rewrite(fn: Function, mix: Node) -> bool:
    norm = single_user(fn, mix.output)
    if norm is None or norm.op != "rms_norm" or len(norm.inputs) != 2:
        return False
    proj, mnorm, *bank, last = mix.inputs
    add = _prefix_add(fn, mix, norm)
    tail = list(add.inputs) if add else [last]
    operands = [proj, mnorm, norm.inputs[1], *bank, *tail]
    if len({value_key(v) for v in operands}) != len(operands):
        return False
    group = [add, mix, norm] if add else [mix, norm]
    attrs = {"bank": len(bank), "prefix_add": add is not None, "eps": mix.attrs["eps"], "norm_eps": norm.attrs["eps"]}
    results = [add.output.name, norm.output.name] if add else [norm.output.name]
    fused = fuse(fn, group, FUSED_OP, attrs)
    order_signature(fused, operands, results)
    return True


def run(module: Module, ctx: PassContext) -> int:
    rewrites = 0
    for fn in module.functions.values():
        for mix in [n for n in fn.nodes if n.op == "attn_res_mix"]:
            rewrites += _rewrite(fn, mix)
    ctx.count(NAME, rewrites)
    return rewrites
