"""Value projection + sigmoid output gate in one kernel (MLA layer, absorbed form).

Pattern (SPEC §4: absorbed decode o^h = W_UV^h o~^h, then step 5 o <- o * sigmoid(W_g x)):
    %o3 = mla_attention(%q_nope, %q_pe, %pool, @kv_b, ...) {form="absorbed"}     [T, H, dv]
    %o = reshape(%o3) {shape=[-1, H*dv]}
    %s = sigmoid(%g)
    %y = mul(%o, %s)                                                           (either operand order)
Rewrite (mla_attention is split at the value up-projection, which is then fused with the gate):
    %o3.latent = mla_attention(...) {form="latent"}                             o~ [T, H, kv]
    %y = fused.value_gate(%o3.latent, @kv_b, %g) {heads=H, nope_dim=dn, v_head_dim=dv}
        body: %o3 = mla_value_proj(%o3.latent, @kv_b) {nope_dim=dn}; reshape; sigmoid; mul

The fused op (`a.operands` in this order):
    o_latent [T, H, kv]      the absorbed attention's output before W_UV (o~ = sum_s p(s) c(s))
    kv_b [H*(dn+dv), kv]     DeepSeek kv_b_proj layout: view(H, dn+dv, kv), rows dn.. of head h are W_UV^h
    gate [T, H*dv]           the output-gate projection W_g x (from the packed input projection)
  attrs: heads=H, nope_dim=dn, v_head_dim=dv
  result: y [T, H*dv] (o_latent's dtype), y[t, h*dv + v] = (sum_k W_UV^h[v, k] o~[t, h, k]) * sigmoid(gate[t, h*dv + v])
One GEMM per head with the gate applied in its epilogue: o (H*dv per token) never goes to memory.

Under DCP (after shard_dcp) the attention is `dcp_mla` / `dcp_mla_dense` (this rank's H/W heads, their
absorbed output [T, H/W, dv] after the LSE combine); the same pattern matches it and the rewrite sets its
form="latent" (it then returns o~ [T, H/W, kv] of this rank's heads, before its own W_UV), so the value
projection + gate of a DCP layer run as the same fused kernel. Operand 3 is kv_b in all three ops.

Decompressed form (prefill): left unfused — there W_UV is applied per context token inside the
attention (v = W_UV c), so there is no value projection after it to fuse; the gate stays a sigmoid and a
mul. Layers without an output gate (Kimi-Linear) are left unchanged (mla_attention stays absorbed).

Preconditions: none beyond the pattern; a layer whose graph differs (the attention output, its reshape
or the sigmoid read elsewhere, a reshape that is not [-1, H*dv]) is left unfused.
Postconditions: per rewritten layer one mla_attention {form="latent"} followed by one fused.value_gate;
numerics unchanged (W_UV o~ is computed by the same formula, now in its own op).
"""

from __future__ import annotations

from ir.core import Function, Module, Node, Value

from .base import PassContext
from .rewrite import Index, fuse, order_signature, rewrite_each

NAME = "value_gate"
FUSED_OP = "fused.value_gate"


def _match(mla: Node, index: Index):
    """(reshape, sigmoid, mul) after an absorbed mla_attention, or None."""
    if mla.attrs.get("form", "absorbed") != "absorbed" or mla.attrs.get("q_absorbed"):
        return None  # (q_absorbed: query_absorption runs after this pass; its q_nope operand is q~, not dn wide)
    out = mla.output
    t, h, dv = out.type.shape
    rs = index.single_user(out)
    if rs is None or rs.op != "reshape" or list(rs.attrs["shape"]) != [-1, int(h) * int(dv)]:
        return None
    mul = index.single_user(rs.output)
    if mul is None or mul.op != "mul":
        return None
    other = mul.inputs[1] if mul.inputs[0] is rs.output else mul.inputs[0]
    sig = index.producer(other)
    if sig is None or sig.op != "sigmoid" or index.single_user(other) is not mul or other is rs.output:
        return None
    return rs, sig, mul


def _rewrite(fn: Function, mla: Node, index: Index) -> bool:
    m = _match(mla, index)
    if m is None:
        return False
    rs, sig, mul = m
    out, kv_b = mla.output, mla.inputs[3]
    heads, dn = (int(d) for d in mla.inputs[0].type.shape[1:])
    dv, kv = int(out.type.shape[2]), int(kv_b.type.shape[1])
    latent = Value(index.fresh_name(out.name + ".latent"), out.type.with_shape((out.type.shape[0], heads, kv)), mla)
    mla.attrs["form"] = "latent"
    with index.rewired(mla):
        mla.outputs = [latent]
    proj = Node("mla_value_proj", [latent, kv_b], {"nope_dim": dn}, [out])
    out.producer = proj
    fn.nodes.insert(fn.nodes.index(mla) + 1, proj)
    index.add(proj)
    fused = fuse(fn, [proj, rs, sig, mul], FUSED_OP, {"heads": heads, "nope_dim": dn, "v_head_dim": dv}, index=index)
    order_signature(fused, [latent, kv_b, sig.inputs[0]])
    return True


ATTENTION_OPS = ("mla_attention", "dcp_mla", "dcp_mla_dense")  # absorbed output [T, H, dv]; kv_b is operand 3


def run(module: Module, ctx: PassContext) -> int:
    return sum(rewrite_each(module, ctx, NAME, op, _rewrite, indexed=True) for op in ATTENTION_OPS)
