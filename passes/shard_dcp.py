"""DCP: interleave the MLA latent and index-key caches over DCP groups of the TP ranks (T4, issue 8).

Runs after `shard_tp`; dcp divides tp and a DCP group is a run of dcp consecutive TP ranks
(k31c/parallel/groups.py; vLLM's rule). In every entry function, per MLA layer (unfused):
    %pool' = cache_write(%pool, %latent, %req, %pos, %block_table) {block_size}        (latent, keys, scales)
    %sel   = indexer_topk(%iq, %iqs, %iw, %keys', %kscale', %pos, %req, %block_table) {topk, block_size}
    %o     = mla_attention(%q_nope, %q_pe, %pool', @kv_b, %pos, %req, %block_table, %sel) {scale, ...}
becomes
    %pool' = dcp_cache_write(%pool, %latent, %req, %pos, %block_table) {block_size, interleave, group, world}
    %o     = dcp_mla(%q_nope, %q_pe, %pool', @kv_b, %iq, %iqs, %iw, %keys', %kscale', %pos, %req, %block_table)
                     {block_size, interleave, group, world, scale, topk}
and a K3 layer (no indexer, dense MLA over the whole context) becomes
    %pool' = dcp_cache_write(...)
    %o     = dcp_mla_dense(%q_nope, %q_pe, %pool', @kv_b, %pos, %req, %block_table) {block_size, interleave,
                                                                                    group, world, scale}
Rank r of a group of W stores only positions p with (p // interleave) % W == r, at local position
(p // (W·interleave))·interleave + p % interleave, so %block_table is the rank's *local* table (blocks
for its share only: k31c.parallel.serving.rows_per_rank). `dcp_mla` scores its own tokens, merges the
exact global top-k in one round (k31c/parallel/dcp_topk.py), attends over its share for the group's heads
and combines by log-sum-exp; `dcp_mla_dense` attends over every own causal position and combines the same
way (k31c/parallel/dcp_attention.py). @prefill uses the same ops.

Merge-free DCP prefill (T5), in @prefill_token_sharded when shard_tokens ran (its attention and indexer
run on this rank's tokens with all heads and read the whole context):
    %ws_table = dcp_workspace_table(%block_table) {world}       once: [R, MB·W], request q at q·MB·W + j
    %pool'    = dcp_cache_write(...)                            the cache stays interleaved (local table)
    %ws       = dcp_gather_context(%pool', %pos, %req, %block_table, %ws_table) {block_size, interleave,
                                                                               row_rank, group, world}
and the indexer / attention read %ws through %ws_table instead of %pool' through %block_table (latent,
keys, scales): the step's context is all-gathered over the DCP group into a workspace addressed by global
positions, so no top-k merge or LSE combine is needed and the result is bitwise the token-sharded
prefill without DCP (tokens are then sharded over the whole TP group).

Context options: dcp (int, default 1: no-op), dcp_interleave (default 1), dcp_group ("dcp").
Every cache format (latent fp8 / bf16 / NVFP4, keys FP8 / MXFP4: attrs latent_format, key_format) and
pool form (flat or block view) is read as the reference reads it.
Preconditions (PassError, all collected): module attr tp divisible by dcp (run shard_tp first); no fused
nodes.
Postconditions: no indexer_topk / mla_attention / cache_write on MLA pools left outside
@prefill_token_sharded; module attrs dcp, dcp_interleave; counter `shard_dcp` = rewritten layers (over all
functions).
"""

from __future__ import annotations

from ir.core import Function, Module, Node, Value
from ir.ops import get_op

from .base import PassContext, PassError
from .rewrite import Index, fresh_name

NAME = "shard_dcp"
READERS = ("mla_attention", "indexer_topk")  # what may read a gathered workspace in @prefill_token_sharded


def run(module: Module, ctx: PassContext) -> int:
    dcp = int(ctx.options.get("dcp", 1))
    if dcp == 1:
        ctx.count(NAME, 0)
        return 0
    interleave = int(ctx.options.get("dcp_interleave", 1))
    group = ctx.options.get("dcp_group", "dcp")
    tp = module.attrs.get("tp")
    problems = []
    if not isinstance(tp, int) or tp % dcp:
        problems.append(f"needs shard_tp with a tp that dcp = {dcp} divides first (module attr tp = {tp})")
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
        token_sharded = fn.attrs.get("layout") == "token_sharded"
        mlas = [n for n in fn.nodes if n.op == "mla_attention"]
        ws_table = _workspace_table(fn, dcp) if token_sharded and mlas else None
        index = Index(fn)
        for mla in mlas:
            if token_sharded:
                _gather_context(fn, mla, comm, ws_table, index)
            else:
                _rewrite(fn, mla, comm, index)
            layers += 1
    module.attrs.update(dcp=dcp, dcp_interleave=interleave)
    ctx.count(NAME, layers)
    return layers


def _producer(index: Index, v: Value, op: str, what: str) -> Node:
    n = index.producer(v)
    if n is None or n.op != op:
        raise PassError(f"{NAME}: {what} {v.ref} must come from {op}, found {n.op if n else 'a function input'}")
    return n


def _to_dcp_write(n: Node, comm: dict):
    n.op = "dcp_cache_write"
    n.attrs = {"block_size": n.attrs["block_size"], **comm}


def _workspace_table(fn: Function, dcp: int) -> Value:
    """%ws_table = dcp_workspace_table(%block_table) {world}, first in the function."""
    op = get_op("dcp_workspace_table")
    table = fn.input("block_table")
    (t,) = op.infer(op.bind([table.type]), op.full_attrs({"world": dcp}))
    node = Node("dcp_workspace_table", [table], {"world": dcp})
    node.outputs = [Value(fresh_name(fn, "ws_table"), t, node)]
    fn.nodes.insert(0, node)
    return node.output


def _gather_context(fn: Function, mla: Node, comm: dict, ws_table: Value, index: Index):
    """T5: interleaved writes, then every reader of the written pools (not the return) reads a gathered
    workspace through the workspace table."""
    mop, iop = get_op("mla_attention"), get_op("indexer_topk")
    pools = [mla.inputs[mop.operand_index("latent")]]
    if len(mla.inputs) > mop.operand_index("selection"):
        ix = _producer(index, mla.inputs[mop.operand_index("selection")], "indexer_topk", "the selection of")
        pools += [ix.inputs[iop.operand_index("keys")], ix.inputs[iop.operand_index("key_scale")]]
    wop, gop = get_op("cache_write"), get_op("dcp_gather_context")
    for pool in pools:
        write = _producer(index, pool, "cache_write", "the cache pool")
        # the step's tokens (not this rank's token shard): every rank gathers the same context
        meta = [write.inputs[wop.operand_index(n)] for n in ("token_pos", "token_req", "block_table")]
        _to_dcp_write(write, comm)
        inputs = [pool, *meta, ws_table]
        attrs = {**write.attrs, "row_rank": write.inputs[wop.operand_index("values")].type.rank - 1}
        (t,) = gop.infer(gop.bind([v.type for v in inputs]), gop.full_attrs(attrs))
        gather = Node("dcp_gather_context", inputs, attrs)
        gather.outputs = [Value(index.fresh_name(pool.name + ".ws"), t, gather)]
        for n in index.readers(pool):
            if n.op not in READERS:
                raise PassError(f"{NAME}: {n.op} reads the cache pool {pool.ref} in @{fn.name}; only {READERS} "
                                f"can read the gathered workspace")
            bt = get_op(n.op).operand_index("block_table")
            with index.rewired(n):
                n.inputs = [gather.output if v is pool else ws_table if i == bt else v for i, v in enumerate(n.inputs)]
        fn.nodes.insert(fn.nodes.index(write) + 1, gather)
        index.add(gather)


def _rewrite(fn: Function, mla: Node, comm: dict, index: Index):
    mop, iop = get_op("mla_attention"), get_op("indexer_topk")
    m = lambda name: mla.inputs[mop.operand_index(name)]  # noqa: E731
    base = [m("q_nope"), m("q_pe"), m("latent"), m("kv_b")]
    meta = [m("token_pos"), m("token_req"), m("block_table")]
    common = {"block_size": mla.attrs["block_size"], **comm, "scale": mla.attrs["scale"],
              "latent_format": mla.attrs.get("latent_format", "plain")}
    if len(mla.inputs) <= mop.operand_index("selection"):  # K3: dense MLA over the whole context
        _to_dcp_write(_producer(index, m("latent"), "cache_write", "the cache pool"), comm)
        _replace(fn, mla, "dcp_mla_dense", base + meta, common, index)
        return
    ix = _producer(index, mla.inputs[mop.operand_index("selection")], "indexer_topk", "the selection of")
    if len(index.users.get(id(ix.output), [])) != 1:
        raise PassError(f"{NAME}: the selection {ix.output.ref} is read by more than its attention")
    for v in (m("latent"), ix.inputs[iop.operand_index("keys")], ix.inputs[iop.operand_index("key_scale")]):
        _to_dcp_write(_producer(index, v, "cache_write", "the cache pool"), comm)
    i = lambda name: ix.inputs[iop.operand_index(name)]  # noqa: E731
    inputs = base + [i("q"), i("q_scale"), i("w"), i("keys"), i("key_scale")] + meta
    _replace(fn, mla, "dcp_mla", inputs, {**common, "topk": ix.attrs["topk"],
                                          "key_format": ix.attrs.get("key_format", "fp8")}, index)
    fn.nodes.remove(ix)
    index.drop(ix)


def _replace(fn: Function, mla: Node, opname: str, inputs: list[Value], attrs: dict, index: Index):
    op = get_op(opname)
    (t,) = op.infer(op.bind([v.type for v in inputs]), op.full_attrs(attrs))
    if not t.same_as(mla.output.type):
        raise PassError(f"{NAME}: {opname} would give {t} for {mla.output.ref}: {mla.output.type}")
    node = Node(opname, inputs, attrs, [mla.output])
    index.drop(mla)
    mla.output.producer = node
    fn.nodes[fn.nodes.index(mla)] = node
    index.add(node)
