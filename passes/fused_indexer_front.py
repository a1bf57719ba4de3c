"""Fused indexer front: everything the DSA indexer computes per new token before scoring, in one kernel.

Pattern (per `indexer_topk`, SPEC §5 steps 1–5; `%iq` may be a result of a `fused.packed_linear`,
e.g. packed with the MLA q_b projection because both read c_Q: it is taken out of that pack):
    %iq = linear(%c_q, @wq_b)                   %kn = layer_norm(%ik, @k_norm.w, @k_norm.b) {eps}
    %iq3 = reshape(%iq) {shape=[-1, HI, DI]}     %kr = hadamard(%kn)
    %qr = hadamard(%iq3)                         %k8, %ks = quantize_fp8_pow2(%kr)
    %q8, %qs = quantize_fp8_pow2(%qr)            %keys = cache_write(%key_pool, %k8, %req, %pos, %base)
    %w = scale(%iw) {factor}                     %scales = cache_write(%scale_pool, %ks, %req, %pos, %base)
    %sel = indexer_topk(%q8, %qs, %w, %keys, %scales, ...)
Rewrite:
    %q8, %qs, %w, %keys, %scales = fused.indexer_front(%c_q, @wq_b, %ik, @k_norm.w, @k_norm.b, %iw,
        %key_pool, %scale_pool, %req, %pos, %base) {heads, head_dim, eps, weight_scale, quant="fp8_pow2"}
    body: the nodes above; indexer_topk's operands are unchanged.

The fused op (what a kernel's `launch` receives, `a.operands` in this order):
    c_q        [T, q_lora]       the MLA query latent after its RMSNorm (shared with the MLA query path)
    wq_b       [HI*DI, q_lora]   indexer query projection
    ik         [T, DI]           the index-key projection W_Ik x (kept in the packed input projection)
    k_norm_w   [DI], k_norm_b [DI]  LayerNorm weight and bias
    iw         [T, HI]           the head-weight projection W_Iw x (kept in the packed input projection)
    key_pool   f8e4m3[N, DI], scale_pool f32[N]   index-key cache pools, updated in place
    token_req, token_pos [T], req_base [R]        cache addressing: row = req_base[token_req] + token_pos
  attrs: heads=HI, head_dim=DI, eps (LayerNorm), weight_scale (= HI^-1/2 DI^-1/2), quant="fp8_pow2"
  results, in indexer_topk's operand order:
    q8 f8e4m3[T, HI, DI]  = fp8(H_DI (W_Iq c_q)_j) per (token, head j), with
    q_scale f32[T, HI]      its power-of-two scale (SPEC §5.4);
    w [T, HI]             = weight_scale * iw;
    key_pool, scale_pool  with row req_base[token_req[t]] + token_pos[t] = fp8(H_DI LayerNorm(ik_t)), its scale.
(H_DI: Hadamard rotation / sqrt(DI).)

Head weights folded in (SPEC §5): the scorer needs w_j * s_q,j * (q8_j . k). Because s_q is a power of
two, w_j * s_q,j is exact (an exponent shift, no rounding), so the kernel may emit the folded product
instead of separate q_scale and w; the IR keeps indexer_topk's operands (q8, q_scale, w) unchanged so
the reference and the scorer kernel stay interchangeable.  The query norm (c_Q = RMSNorm(W_qa x)) is
not fused here: c_Q is shared with the MLA query path, which runs beside the indexer
(`overlapped_mla_query`).

Preconditions (PassError otherwise): the key and the key-scale cache writes address the same rows
(same token_req, token_pos, req_base values), since the kernel writes both at one row.  Layers whose
graph differs from the pattern (another quantiser, intermediates read elsewhere) are left unfused.
Postconditions: one fused.indexer_front per indexer; numerics unchanged (the body is the original nodes).
"""

from __future__ import annotations

from ir.core import Function, Module, Node, Value

from .base import PassContext, PassError
from .rewrite import fuse, single_user

NAME = "fused_indexer_front"
FUSED_OP = "fused.indexer_front"
PACKED_OP = "fused.packed_linear"


# ---- helpers shared by the fusion passes ----------------------------------------------------------
def value_key(v: Value):
    """Operand identity as `fuse` sees it: a parameter by name, any other value by object."""
    return ("@", v.name) if v.is_param else ("%", id(v))


def order_signature(node: Node, operands: list[Value], results: list[str] | None = None):
    """Put a node made by `fuse` into its documented signature: permute its operands (and body inputs,
    renamed %in0..) into the order of `operands`, and its results (and body outputs) into the order of
    the result names `results`.  Raises PassError when the sets differ (the pattern assumed wrongly)."""
    pos = {value_key(v): i for i, v in enumerate(node.inputs)}
    order = [pos.get(value_key(v), -1) for v in operands]
    if sorted(order) != list(range(len(node.inputs))):
        raise PassError(f"{node.op}: operands ({', '.join(v.ref for v in node.inputs)}) do not match the documented "
                        f"signature ({', '.join(v.ref for v in operands)})")
    node.inputs = [node.inputs[i] for i in order]
    node.body.inputs = [node.body.inputs[i] for i in order]
    for i, v in enumerate(node.body.inputs):
        v.name = f"in{i}"
    if results is not None:
        names = [o.name for o in node.outputs]
        if sorted(names) != sorted(results):
            raise PassError(f"{node.op}: results ({', '.join(names)}) are not the documented ({', '.join(results)})")
        rorder = [names.index(r) for r in results]
        node.outputs = [node.outputs[i] for i in rorder]
        node.body.outputs = [node.body.outputs[i] for i in rorder]


def producers(fn: Function) -> dict[int, Node]:
    return {id(o): n for n in fn.nodes for o in n.outputs}


def fresh_name(fn: Function, base: str) -> str:
    """`base`, or `base.1`, `base.2`, ... : a value name not yet used in `fn`."""
    taken = {v.name for v in fn.inputs} | {o.name for n in fn.nodes for o in n.outputs}
    name, k = base, 1
    while name in taken:
        name, k = f"{base}.{k}", k + 1
    return name


def linear_source(fn: Function, value: Value) -> bool:
    """Whether `value` is the result of a plain `linear`, or one linear of a fused.packed_linear, with
    a parameter weight (what `take_from_pack` accepts)."""
    node = producers(fn).get(id(value))
    if node is not None and node.op == "linear":
        return node.inputs[1].is_param
    if node is None or node.op != PACKED_OP or node.body is None:
        return False
    return all(n.op == "linear" and n.inputs[0] is node.body.inputs[0] for n in node.body.nodes) and \
        all(v.is_param for v in node.inputs[1:])


def take_from_pack(fn: Function, value: Value) -> Node:
    """The plain `linear` producing `value`. When `value` is one result of a fused.packed_linear, that
    pack is split: `value` gets its own linear at the pack's place and the other members stay packed
    (a single remaining member becomes a plain linear). Precondition: `linear_source(fn, value)`."""
    node = producers(fn)[id(value)]
    if node.op == "linear":
        return node
    body_in = {id(v): i for i, v in enumerate(node.body.inputs)}
    returned = {id(v): i for i, v in enumerate(node.body.outputs)}
    members = []
    for inner in node.body.nodes:
        j = returned.get(id(inner.output))
        if j is not None:
            out = node.outputs[j]
            members.append(Node("linear", [node.inputs[0], node.inputs[body_in[id(inner.inputs[1])]]], {}, [out]))
            out.producer = members[-1]
    at = fn.nodes.index(node)
    fn.nodes[at:at + 1] = members
    mine = next(m for m in members if m.output is value)
    rest = [m for m in members if m is not mine]
    if len(rest) >= 2:
        fuse(fn, rest, PACKED_OP, {"splits": [int(m.inputs[1].type.shape[0]) for m in rest]})
    return mine


def group_escapes(fn: Function, group: list[Node]) -> set[int]:
    """ids of the group's values read outside the group or returned."""
    members = {id(n) for n in group}
    defined = {id(o) for n in group for o in n.outputs}
    read = {id(v) for n in fn.nodes if id(n) not in members for v in n.inputs} | {id(v) for v in fn.outputs}
    return defined & read


# ---- the pattern ----------------------------------------------------------------------------------
def _match(fn: Function, topk: Node):
    """The indexer front feeding `topk` as a dict of nodes, or None when the graph differs."""
    prod = producers(fn)
    src = [prod.get(id(v)) for v in topk.inputs[:5]]
    qq, _, sw, cwk, cws = src
    if not (qq and qq.op == "quantize_fp8_pow2" and src[1] is qq and sw and sw.op == "scale"
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
    if any(a is not b for a, b in zip(cwk.inputs[2:], cws.inputs[2:])):
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
             "quant": "fp8_pow2"}
    operands = [lin.inputs[0], lin.inputs[1], ln.inputs[0], ln.inputs[1], ln.inputs[2], sw.inputs[0],
                cwk.inputs[0], cws.inputs[0], *cwk.inputs[2:]]
    fused = fuse(fn, group, FUSED_OP, attrs)
    order_signature(fused, operands, [v.name for v in results])
    return True


def run(module: Module, ctx: PassContext) -> int:
    rewrites = 0
    for fn in module.functions.values():
        for topk in [n for n in fn.nodes if n.op == "indexer_topk"]:
            rewrites += _rewrite(fn, topk)
    ctx.count(NAME, rewrites)
    return rewrites
