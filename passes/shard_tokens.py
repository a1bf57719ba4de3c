"""Token-sharded prefill (T3, issue 8 item 2): a second prefill entry whose MLA layers run on 1/TP of
the tokens with all heads instead of all tokens with H/TP heads.

Runs after `shard_tp` (module attr tp == the option tp). It copies @prefill into
@prefill_token_sharded and rewrites, in the copy, every (unfused) MLA layer:
    %sel = indexer_topk(%q8, %qs, %w, %keys, %kscale, %token_pos, %token_req, ...)      [B, K]
    %o   = mla_attention(%q_nope, %q_pe, %pool, @kv_b, %token_pos, %token_req, ..., %sel) [B, H/TP, dv]
into
    %rows = token_shard_rows(%cu_seqlens, %token_pos)        [B/TP] once per function (causal balance:
    %pos.t, %req.t = take_rows(%token_pos|%token_req, %rows)        pieces r and 2·TP−1−r per request)
    %sel.t = indexer_topk(take_rows(%q8|%qs|%w, %rows), %keys, %kscale, %pos.t, %req.t, ...)   [B/TP, K]
    %q_nope.t = heads_to_tokens(%q_nope, %cu_seqlens)        [B/TP, H, dn]   all-to-all #1
    %q_pe.t   = heads_to_tokens(%q_pe, %cu_seqlens)          [B/TP, H, dr]
    %kv_b.all = all_gather(@kv_b) {axis=0}                   every head's W_UK / W_UV
    %o.t = mla_attention(%q_nope.t, %q_pe.t, %pool, %kv_b.all, %pos.t, %req.t, ..., %sel.t)   [B/TP, H, dv]
    %o   = tokens_to_heads(%o.t, %cu_seqlens)                [B, H/TP, dv]   all-to-all #2
Cache writes (latents, index keys) stay replicated: every rank writes every token, so decode and later
chunks see the same cache as head sharding. The other operands of both ops (cache addressing) pass
through untouched. Indexer scoring, top-k and attention cost 1/TP per rank; the indexer's projections
still run for every token (replicated, cheap next to the O(T·L) scorer).

When to use it is the runtime's per-step choice (`k31c.parallel.prefill_choice`): the step's chunks must
be multiples of 2·TP tokens (so every rank holds exactly B/TP rows) and the step at least the cost
model's crossover (`token_shard_min_tokens`, from `k31c.plan.sharding_cost.prefill_sharding`), recorded
in the new function's attrs.

Context options: tp, tp_group ("tp"), token_shard_min_tokens (int, default 0).
Preconditions: shard_tp ran with the same tp; no fused nodes in @prefill.
Postconditions: @prefill_token_sharded exists, attrs layout="token_sharded", token_multiple=2·TP;
counter `shard_tokens` = rewritten MLA layers.
"""

from __future__ import annotations

import copy

from ir.core import Function, Module, Node, Value
from ir.ops import get_op
from ir.shapes import shapes_equal

from .base import PassContext, PassError
from .rewrite import Names, producers

NAME = "shard_tokens"
SOURCE, TARGET = "prefill", "prefill_token_sharded"


def run(module: Module, ctx: PassContext) -> int:
    tp = int(ctx.options.get("tp", 1))
    if tp == 1 or SOURCE not in module.functions:
        ctx.count(NAME, 0)
        return 0
    group = ctx.options.get("tp_group", "tp")
    if module.attrs.get("tp") != tp:
        raise PassError(f"{NAME}: run shard_tp with tp={tp} first (module attr tp = {module.attrs.get('tp')})")
    src = module.function(SOURCE)
    if any(n.body is not None for n in src.nodes):
        raise PassError(f"{NAME}: @{SOURCE} has fused nodes; run {NAME} before the fusion phase")
    fn = copy.deepcopy(src)
    fn.name = TARGET
    fn.attrs = {**src.attrs, "layout": "token_sharded", "token_multiple": 2 * tp,
                "token_shard_min_tokens": int(ctx.options.get("token_shard_min_tokens", 0))}
    for n in fn.walk():  # deepcopy copied the param Values too; keep them tied to the module's params
        for v in n.inputs:
            if v.is_param:
                v.type = module.params[v.name].type
    rewriter = _Rewriter(fn, tp, group)
    layers = [n for n in fn.nodes if n.op == "mla_attention"]
    for n in layers:
        rewriter.layer(n)
    module.add_function(fn)
    ctx.count(NAME, len(layers))
    return len(layers)


class _Rewriter:
    def __init__(self, fn: Function, tp: int, group: str):
        self.fn, self.tp, self.comm = fn, tp, {"group": group, "world": tp}
        self.names = Names(fn)
        cu, pos, req = fn.input("cu_seqlens"), fn.input("token_pos"), fn.input("token_req")
        self.cu = cu
        head: list[Node] = []
        self.rows = self._node(head, "token_shard_rows", [cu, pos], self.comm, "token_rows")
        self.pos = self._node(head, "take_rows", [pos, self.rows], {}, "token_pos.t")
        self.req = self._node(head, "take_rows", [req, self.rows], {}, "token_req.t")
        fn.nodes[0:0] = head

    def _node(self, out: list, opname: str, inputs: list[Value], attrs: dict, hint: str) -> Value:
        op = get_op(opname)
        (t,) = op.infer(op.bind([v.type for v in inputs]), op.full_attrs(attrs))
        node = Node(opname, list(inputs), dict(attrs))
        node.outputs = [Value(self.names.fresh(hint), t, node)]
        out.append(node)
        return node.outputs[0]

    def layer(self, mla: Node):
        fn, op = self.fn, get_op("mla_attention")
        idx = {name: op.operand_index(name) for name in ("q_nope", "q_pe", "kv_b", "token_pos", "token_req")}
        if len(mla.inputs) > op.operand_index("selection"):
            self._indexer(producers(fn).get(id(mla.inputs[op.operand_index("selection")])), mla)
        before: list[Node] = []
        inputs = list(mla.inputs)
        for name in ("q_nope", "q_pe"):
            v = inputs[idx[name]]
            inputs[idx[name]] = self._node(before, "heads_to_tokens", [v, self.cu], self.comm, v.name + ".t")
        kv_b = inputs[idx["kv_b"]]
        inputs[idx["kv_b"]] = self._node(before, "all_gather", [kv_b], {"axis": 0, **self.comm},
                                         kv_b.name.replace("@", "") + ".all")
        inputs[idx["token_pos"]], inputs[idx["token_req"]] = self.pos, self.req
        mla.inputs = inputs
        (t,) = op.infer(op.bind([v.type for v in inputs]), op.full_attrs(mla.attrs))
        o = mla.output
        o_tok = Value(self.names.fresh(o.name + ".t"), t, mla)
        mla.outputs = [o_tok]
        back = Node("tokens_to_heads", [o_tok, self.cu], dict(self.comm), [o])
        o.producer = back
        at = fn.nodes.index(mla)
        fn.nodes[at:at + 1] = before + [mla, back]
        (t_back,) = get_op("tokens_to_heads").infer(get_op("tokens_to_heads").bind([o_tok.type, self.cu.type]),
                                                    dict(self.comm))
        if not shapes_equal(t_back.shape, o.type.shape):
            raise PassError(f"{NAME}: {o.ref} would change from {o.type} to {t_back}")

    def _indexer(self, ix: Node | None, mla: Node):
        if ix is None or ix.op != "indexer_topk":
            raise PassError(f"{NAME}: the selection of {mla.output.ref} must come from an unfused indexer_topk, "
                            f"found {ix.op if ix else 'a function input'}")
        op = get_op("indexer_topk")
        inputs = list(ix.inputs)
        before: list[Node] = []
        for name in ("q", "q_scale", "w"):
            i = op.operand_index(name)
            inputs[i] = self._node(before, "take_rows", [inputs[i], self.rows], {}, inputs[i].name + ".t")
        inputs[op.operand_index("token_pos")], inputs[op.operand_index("token_req")] = self.pos, self.req
        ix.inputs = inputs
        (t,) = op.infer(op.bind([v.type for v in inputs]), op.full_attrs(ix.attrs))
        ix.output.type = t
        at = self.fn.nodes.index(ix)
        self.fn.nodes[at:at] = before
