"""KDA decode: conv-state update + gate + recurrent update + gated RMSNorm in one kernel (decode, verify).

Pattern (SPEC §3, one KDA layer after its input projections; only `kda` nodes with form="recurrent" in
functions of kind decode or verify — prefill runs the chunked form through its own kernels):
    %qkv = concat(%q, %k, %v) {axis=1};  %cw = concat(@q_conv, @k_conv, @v_conv) {axis=0}
    %y, %conv' = causal_conv1d(%qkv, %cw, %conv, %slot, %cu)
    %qh = l2_norm(reshape(slice(%y, 0:P), [-1,H,D]));  %kh = l2_norm(reshape(slice(%y, P:2P), ...))
    %vh = reshape(slice(%y, 2P:3P), [-1,H,D])
    %f = linear(%f_a, @f_b);  %g = kda_gate(%f, @A_log, @dt_bias) {lower_bound}
    %beta = sigmoid(%b)
    %o, %state' = kda(%qh, %kh, %vh, %g, %beta, %state, %slot, %cu) {scale, form="recurrent"}
    %on = gated_rms_norm(%o, reshape(%gate, [-1,H,D]), @o_norm) {eps};  %out = reshape(%on, [-1, P])
Rewrite:
    %out, %conv', %state' = fused.kda_decode(%q, %k, %v, @q_conv, @k_conv, @v_conv, %conv, %f_a, @f_b,
        @A_log, @dt_bias, %b, %state, %gate, @o_norm, %slot, %cu) {heads, head_dim, scale, lower_bound,
        l2_eps, norm_eps}

The fused op (`a.operands` in this order):
    q, k, v [T, P]              the q/k/v projections (before the conv; P = H*D)
    q_conv, k_conv, v_conv [P, K]  depthwise conv weights (width K)
    conv_state f32[S, K-1, 3P]  conv tails, row state_slot[r] per request; updated in place
    f_a [T, r]                  the forget gate's low-rank down-projection W_fa x
    f_b [P, r]                  its up-projection
    A_log [H], dt_bias [P]      gate parameters
    beta_logits [T, H]          W_b x (before the sigmoid)
    kda_state f32[S, H, D, D]   recurrent state, row state_slot[r] per request; updated in place
    gate [T, P]                 output-gate projection (before the sigmoid)
    o_norm_w [D]                gated RMSNorm weight
    state_slot [R], cu_seqlens [R+1]   request r owns tokens cu[r]:cu[r+1] (1 in decode, 1–8 in verify)
  attrs: heads=H, head_dim=D, scale (q scale, D^-1/2), lower_bound (float, or none for the softplus gate),
    l2_eps (q/k L2 norm), norm_eps (gated RMSNorm), keep_states (true in verify)
  results: out [T, P], conv_state (updated), kda_state (updated); with keep_states (verify) also
    kda_states f32[T, H, D, D] and conv_states [T, K-1, 3P], the states after each token
  per token, in request order: [q;k;v]_conv = silu(conv over the request's last K inputs); q, k <- L2 per head;
  g = kda_gate(W_fb f_a); beta = sigmoid(b); S' = diag(exp g) S; S = S' + beta k (v - S'^T k)^T;
  o = S^T (q*scale); out = rmsnorm(o; o_norm_w) * sigmoid(gate) per head, flattened.

Verification keeps per-token states. In functions of kind verify the pass first turns on keep_states on
the layer's conv and recurrence (unless the model already did), so both also yield the state after every
token of the step, and returns those as extra function results after the existing ones, per KDA layer
in layer order:
    %kda_state.{i}.per_token  f32[B, H, D, D]     recurrent state after token b (b = the token's row)
    %conv_state.{i}.per_token f32[B, K-1, 3P]     conv tail after token b
(named after the layer's pool inputs). The fused node then has attr keep_states=true and results
(out, conv_state, kda_state, kda_states, conv_states). After verification accepts the first a_r >= 1
tokens of request r, the runtime rolls back by copying row cu_seqlens[r] + a_r - 1 of both into the
request's pool rows (state_slot[r]); the pools themselves hold the state after all of the step's tokens.
The first token of a verify request (the last accepted one) is always kept, so a_r >= 1.

Preconditions (PassError otherwise, naming the nodes): the conv and the recurrence address their state
pools with the same state_slot and cu_seqlens (the kernel walks each request once for both). Layers whose
graph differs from the pattern (intermediates read elsewhere) are left unfused (in verify they then keep
no per-token states: the counter shows the miss).
Postconditions: one fused.kda_decode per KDA layer in decode and verify; in verify every KDA layer's
per-token states are function results; numerics of the existing results unchanged.
"""

from __future__ import annotations

from ir.core import Function, Module, Node, Value
from ir.ops import OPS

from .base import PassContext, PassError
from .rewrite import Index, fuse, order_signature, rewrite_each

NAME = "kda_decode_fusion"
FUSED_OP = "fused.kda_decode"
KINDS = ("decode", "verify")
KEEP_KINDS = ("verify",)  # functions whose fused layers keep the per-token states


def _op(prod: dict, v, op: str) -> Node | None:
    n = prod.get(id(v))
    return n if n is not None and n.op == op else None


def _head(prod: dict, v, l2: bool):
    """[l2_norm], reshape, slice producing a q/k/v head tensor: (nodes, slice) or (None, None)."""
    nodes = []
    if l2:
        n = _op(prod, v, "l2_norm")
        if n is None:
            return None, None
        nodes.append(n)
        v = n.inputs[0]
    rs = _op(prod, v, "reshape")
    sl = _op(prod, rs.inputs[0], "slice") if rs else None
    return (nodes + [rs, sl], sl) if sl else (None, None)


def _match(kda: Node, index: Index):
    prod = index.made_by
    heads = [_head(prod, kda.inputs[i], l2) for i, l2 in ((0, True), (1, True), (2, False))]
    g, beta = _op(prod, kda.inputs[3], "kda_gate"), _op(prod, kda.inputs[4], "sigmoid")
    f = _op(prod, g.inputs[0], "linear") if g else None
    if any(s is None for _, s in heads) or not (f and beta and f.inputs[1].is_param) \
            or heads[0][0][0].attrs["eps"] != heads[1][0][0].attrs["eps"]:
        return None
    conv = _op(prod, heads[0][1].inputs[0], "causal_conv1d")
    if conv is None or any(s.inputs[0] is not conv.outputs[0] for _, s in heads):
        return None
    bounds = [(s.attrs["axis"] % 2, s.attrs["start"], s.attrs["stop"]) for _, s in heads]
    width = int(conv.outputs[0].type.shape[1])
    if [b[0] for b in bounds] != [1, 1, 1] or bounds[0][1] != 0 or bounds[0][2] != bounds[1][1] \
            or bounds[1][2] != bounds[2][1] or bounds[2][2] != width:
        return None  # q, k, v must be the conv output's consecutive column blocks
    qkv, cw = _op(prod, conv.inputs[0], "concat"), _op(prod, conv.inputs[1], "concat")
    if not (qkv and cw and len(qkv.inputs) == 3 and len(cw.inputs) == 3 and all(w.is_param for w in cw.inputs)):
        return None
    readers = index.readers(kda.outputs[0])
    norm = readers[0] if len(readers) == 1 and readers[0].op == "gated_rms_norm" else None
    grs = _op(prod, norm.inputs[1], "reshape") if norm and norm.inputs[0] is kda.outputs[0] else None
    out_rs = index.readers(norm.output) if norm is not None else []
    if grs is None or len(out_rs) != 1 or out_rs[0].op != "reshape":
        return None
    nodes = [qkv, cw, conv, *(n for hn, _ in heads for n in hn), f, g, beta, kda, grs, norm, out_rs[0]]
    results = [out_rs[0].output, conv.outputs[1], kda.outputs[1]]
    if kda.attrs.get("keep_states") != conv.attrs.get("keep_states"):
        return None  # one kernel keeps both or neither
    if kda.attrs.get("keep_states"):
        results += [kda.outputs[2], conv.outputs[2]]
    if index.escapes(nodes) != {id(v) for v in results}:
        return None
    return {"qkv": qkv, "cw": cw, "conv": conv, "f": f, "g": g, "beta": beta, "grs": grs, "norm": norm,
            "l2": heads[0][0][0], "nodes": nodes, "results": results}


def _check_slots(fn: Function, conv: Node, kda: Node):
    if conv.inputs[3] is not kda.inputs[6] or conv.inputs[4] is not kda.inputs[7]:
        raise PassError(f"{NAME}: in @{fn.name}, the conv ({conv.outputs[0].ref}) reads its state at "
                        f"({conv.inputs[3].ref}, {conv.inputs[4].ref}) but the recurrence ({kda.outputs[0].ref}) at "
                        f"({kda.inputs[6].ref}, {kda.inputs[7].ref}): one fused kernel needs one request layout")


def _keep_states(fn: Function, node: Node, pool: Value, index: Index) -> Value:
    """Turn on keep_states of a conv / recurrence node: its per-token states become a new result, named
    after the pool and returned by the function."""
    node.attrs["keep_states"] = True
    op = OPS[node.op]
    kept_type = op.infer(op.bind([v.type for v in node.inputs]), op.full_attrs(node.attrs))[2]
    kept = Value(index.fresh_name(f"{pool.name}.per_token"), kept_type, node)
    with index.rewired(node):
        node.outputs.append(kept)
    fn.outputs.append(kept)
    return kept


def _rewrite(fn: Function, kda: Node, index: Index) -> bool:
    if kda.attrs.get("form", "recurrent") != "recurrent":
        return False
    m = _match(kda, index)
    if m is None:
        return False
    conv, g, norm = m["conv"], m["g"], m["norm"]
    _check_slots(fn, conv, kda)
    keep = fn.attrs.get("kind") in KEEP_KINDS or bool(kda.attrs.get("keep_states"))
    if keep and not kda.attrs.get("keep_states"):
        m["results"] += [_keep_states(fn, kda, kda.inputs[5], index), _keep_states(fn, conv, conv.inputs[2], index)]
    h, d = (int(x) for x in kda.inputs[0].type.shape[1:])
    attrs = {"heads": h, "head_dim": d, "scale": kda.attrs["scale"], "lower_bound": g.attrs["lower_bound"],
             "l2_eps": m["l2"].attrs["eps"], "norm_eps": norm.attrs["eps"]}
    if keep:
        attrs["keep_states"] = True
    operands = [*m["qkv"].inputs, *m["cw"].inputs, conv.inputs[2], m["f"].inputs[0], m["f"].inputs[1],
                g.inputs[1], g.inputs[2], m["beta"].inputs[0], kda.inputs[5], m["grs"].inputs[0], norm.inputs[2],
                kda.inputs[6], kda.inputs[7]]
    results = [v.name for v in m["results"]]
    fused = fuse(fn, m["nodes"], FUSED_OP, attrs, index=index)
    order_signature(fused, operands, results)
    return True


def run(module: Module, ctx: PassContext) -> int:
    return rewrite_each(module, ctx, NAME, "kda", _rewrite, kinds=KINDS, indexed=True)
