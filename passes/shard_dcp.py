"""DCP: interleave the MLA latent and index-key caches over the TP group (T4, issue 8 item 3).

Runs after `shard_tp` with dcp == tp (the DCP group is the TP group). In every entry function, per MLA
layer with a DSA indexer (unfused):
    %pool' = cache_write(%pool, %latent, %req, %pos, %block_table) {block_size}        (latent, keys, scales)
    %sel   = indexer_topk(%iq, %iqs, %iw, %keys', %kscale', %pos, %req, %block_table) {topk, block_size}
    %o     = mla_attention(%q_nope, %q_pe, %pool', @kv_b, %pos, %req, %block_table, %sel) {scale, ...}
becomes
    %pool' = dcp_cache_write(%pool, %latent, %req, %pos, %block_table) {block_size, interleave, group, world}
    %o     = dcp_mla(%q_nope, %q_pe, %pool', @kv_b, %iq, %iqs, %iw, %keys', %kscale', %pos, %req, %block_table)
                     {block_size, interleave, group, world, scale, topk}
Rank r stores only positions p with (p // interleave) % W == r, at local position
(p // (W·interleave))·interleave + p % interleave; `dcp_mla` scores its own tokens, merges the exact global
top-k in one round (k31c/parallel/dcp_topk.py), attends over its share for every head and combines by
log-sum-exp (k31c/parallel/dcp_attention.py). @prefill uses the same op (a merge per prefill token).

Merge-free DCP prefill (T5), in @prefill_token_sharded when shard_tokens ran (its attention and indexer
run on this rank's tokens with all heads and read the whole context):
    %pool' = dcp_cache_write(...)                               the cache stays interleaved
    %ws    = dcp_gather_context(%pool', %pos, %req, %block_table) {block_size, interleave, group, world}
and the indexer / attention read %ws instead of %pool' (latent, keys, scales): the step's context is
all-gathered into a pool-shaped workspace at its ordinary rows, so no top-k merge or LSE combine is
needed and the result is bitwise the token-sharded prefill without DCP.

Context options: dcp (int, default 1: no-op), dcp_interleave (default 1), tp_group ("tp").
Preconditions (PassError): module attr tp == dcp (run shard_tp first; DCP subgroups of TP are not built),
no fused nodes, every MLA layer has an indexer (K3 dense MLA under DCP is not built).
Postconditions: no indexer_topk / mla_attention / cache_write on MLA
pools left; module attrs dcp, dcp_interleave; counter `shard_dcp` = rewritten layers (over all functions).
"""

from __future__ import annotations

from ir.core import Function, Module, Node, Value
from ir.ops import get_op

from .base import PassContext, PassError
from .rewrite import fresh_name, producers, uses

NAME = "shard_dcp"


def run(module: Module, ctx: PassContext) -> int:
    dcp = int(ctx.options.get("dcp", 1))
    if dcp == 1:
        ctx.count(NAME, 0)
        return 0
    interleave = int(ctx.options.get("dcp_interleave", 1))
    group = ctx.options.get("tp_group", "tp")
    problems = []
    if module.attrs.get("tp") != dcp:
        problems.append(f"needs shard_tp with tp = dcp = {dcp} first (module attr tp = {module.attrs.get('tp')})")
    if interleave < 1:
        problems.append(f"dcp_interleave must be >= 1, found {interleave}")
    for fn in module.functions.values():
        if any(n.body is not None for n in fn.nodes):
            problems.append(f"@{fn.name} has fused nodes: run {NAME} before the fusion phase")
    if problems:
        raise PassError(f"{NAME} (dcp={dcp}): " + "; ".join(problems))
    comm = {"interleave": interleave, "group": group, "world": dcp}
    layers = 0
    for fn in module.functions.values():
        rewrite = _gather_context if fn.attrs.get("layout") == "token_sharded" else _rewrite
        for mla in [n for n in fn.nodes if n.op == "mla_attention"]:
            rewrite(fn, mla, comm)
            layers += 1
    module.attrs.update(dcp=dcp, dcp_interleave=interleave)
    ctx.count(NAME, layers)
    return layers


def _producer(fn: Function, v: Value, op: str, what: str) -> Node:
    n = producers(fn).get(id(v))
    if n is None or n.op != op:
        raise PassError(f"{NAME}: {what} {v.ref} must come from {op}, found {n.op if n else 'a function input'}")
    return n


def _to_dcp_write(n: Node, comm: dict):
    n.op = "dcp_cache_write"
    n.attrs = {"block_size": n.attrs["block_size"], **comm}


def _gather_context(fn: Function, mla: Node, comm: dict):
    """T5: interleaved writes, then every reader of the written pools (not the return) reads a gathered
    workspace."""
    mop, iop = get_op("mla_attention"), get_op("indexer_topk")
    pools = [mla.inputs[mop.operand_index("latent")]]
    if len(mla.inputs) > mop.operand_index("selection"):
        ix = _producer(fn, mla.inputs[mop.operand_index("selection")], "indexer_topk", "the selection of")
        pools += [ix.inputs[iop.operand_index("keys")], ix.inputs[iop.operand_index("key_scale")]]
    wop = get_op("cache_write")
    for pool in pools:
        write = _producer(fn, pool, "cache_write", "the cache pool")
        # the step's tokens (not this rank's token shard): every rank gathers the same context
        meta = [write.inputs[wop.operand_index(n)] for n in ("token_pos", "token_req", "block_table")]
        _to_dcp_write(write, comm)
        gather = Node("dcp_gather_context", [pool, *meta], dict(write.attrs))
        gather.outputs = [Value(fresh_name(fn, pool.name + ".ws"), pool.type, gather)]
        for n in fn.nodes:
            n.inputs = [gather.output if v is pool else v for v in n.inputs]
        gather.inputs[0] = pool
        fn.nodes.insert(fn.nodes.index(write) + 1, gather)


def _rewrite(fn: Function, mla: Node, comm: dict):
    mop, iop = get_op("mla_attention"), get_op("indexer_topk")
    if len(mla.inputs) <= mop.operand_index("selection"):
        raise PassError(f"{NAME}: {mla.output.ref} has no indexer selection (dense K3 MLA under DCP is not built)")
    ix = _producer(fn, mla.inputs[mop.operand_index("selection")], "indexer_topk", "the selection of")
    if len(uses(fn).get(id(ix.output), [])) != 1:
        raise PassError(f"{NAME}: the selection {ix.output.ref} is read by more than its attention")
    for v in (mla.inputs[mop.operand_index("latent")], ix.inputs[iop.operand_index("keys")],
              ix.inputs[iop.operand_index("key_scale")]):
        _to_dcp_write(_producer(fn, v, "cache_write", "the cache pool"), comm)
    m = lambda name: mla.inputs[mop.operand_index(name)]  # noqa: E731
    i = lambda name: ix.inputs[iop.operand_index(name)]  # noqa: E731
    inputs = [m("q_nope"), m("q_pe"), m("latent"), m("kv_b"), i("q"), i("q_scale"), i("w"), i("keys"),
              i("key_scale"), m("token_pos"), m("token_req"), m("block_table")]
    attrs = {"block_size": mla.attrs["block_size"], **comm, "scale": mla.attrs["scale"], "topk": ix.attrs["topk"]}
    op = get_op("dcp_mla")
    (t,) = op.infer(op.bind([v.type for v in inputs]), op.full_attrs(attrs))
    if not t.same_as(mla.output.type):
        raise PassError(f"{NAME}: dcp_mla would give {t} for {mla.output.ref}: {mla.output.type}")
    node = Node("dcp_mla", inputs, attrs, [mla.output])
    mla.output.producer = node
    fn.nodes[fn.nodes.index(mla)] = node
    fn.nodes.remove(ix)
