"""Fused indexer: scorer + exact top-k emitting the physical cache rows that attention reads.

Pattern:
    %sel = indexer_topk(%q8, %qs, %w, %keys, %scales, %pos, %req, %tbl) {topk, block_size, key_format}   (positions)
    %o = mla_attention(..., %req, %tbl, %sel) {selection_kind="positions" (default)}
Rewrite:
    %rows = fused.indexer_select(%q8, %qs, %w, %keys, %scales, %pos, %req, %tbl)
                {topk, block_size, key_format, emits="rows"}
        body: %sel = indexer_topk(...); %rows = selection_to_rows(%sel, %req, %tbl) {block_size}
    %o = mla_attention(..., %req, %tbl, %rows) {selection_kind="rows"}

The fused op (`a.operands` in this order, exactly indexer_topk's):
    q8 f8e4m3[T, HI, DI], q_scale f32[T, HI], w [T, HI], keys f8e4m3[N, DI] | u8[N, DI/2],
    key_scale f32[N] | u8[N, DI/32] (or block views [NB, bs, ...] of both, `ir.ref.paging`),
    token_pos [T], token_req [T], block_table [R, MB]
  attrs: topk (int), block_size (rows per cache block), key_format ("fp8" | "mxfp4", indexer_topk's),
    emits="rows"
  result: rows i64[T, topk] — for token t of request r = token_req[t], the top-k positions s <= token_pos[t]
    of I(t, s) = sum_j w_j relu(deq(q8_j) . deq(keys[row(r, s)])) (ties to the lower position),
    emitted as their pool rows row(r, s) (`ir.ref.paging`), in ascending position order, -1 padded when
    the context is shorter than topk.
A kernel scores straight off the pool rows and writes rows; attention then gathers those rows without
a block-table lookup per selected token.

Preconditions (PassError otherwise, naming the node): every reader of the selection is an
mla_attention that reads it as positions, and addresses the latent pool with the same token_req,
block_table and block_size as the indexer (so a row means the same token to both).
Postconditions: indexer_topk appears only inside fused.indexer_select bodies; mla_attention reads
rows; numerics unchanged (rows map back to the same positions).
"""

from __future__ import annotations

from ir.core import Function, Module, Node, Value

from .base import PassContext, PassError
from .rewrite import Index, fuse, rewrite_each

NAME = "fused_indexer_select"
FUSED_OP = "fused.indexer_select"

_MLA_REQ, _MLA_BASE, _MLA_SEL = 5, 6, 7  # mla_attention operand positions: token_req, block_table, selection
_TOPK_REQ, _TOPK_BASE = 6, 7             # indexer_topk operand positions: token_req, block_table


def _check_readers(fn: Function, topk: Node, sel: Value, index: Index) -> list[Node]:
    readers = index.readers(sel)
    if any(v is sel for v in fn.outputs):
        raise PassError(f"{NAME}: in @{fn.name}, the selection {sel.ref} is returned: its positions cannot be "
                        f"replaced by pool rows")
    for r in readers:
        where = f"{NAME}: in @{fn.name}, node ({', '.join(o.ref for o in r.outputs)} = {r.op})"
        if r.op != "mla_attention" or len(r.inputs) <= _MLA_SEL or r.inputs[_MLA_SEL] is not sel \
                or sel in r.inputs[:_MLA_SEL]:
            raise PassError(f"{where} reads the selection {sel.ref} other than as mla_attention's selection; "
                            f"it expects positions, the fused indexer emits pool rows")
        if r.attrs.get("selection_kind", "positions") != "positions":
            raise PassError(f"{where} already reads its selection as {r.attrs['selection_kind']!r}")
        if r.inputs[_MLA_REQ] is not topk.inputs[_TOPK_REQ] or r.inputs[_MLA_BASE] is not topk.inputs[_TOPK_BASE] \
                or r.attrs["block_size"] != topk.attrs["block_size"]:
            raise PassError(f"{where} addresses its pool with ({r.inputs[_MLA_REQ].ref}, {r.inputs[_MLA_BASE].ref}) "
                            f"block_size {r.attrs['block_size']} but the indexer with ({topk.inputs[_TOPK_REQ].ref}, "
                            f"{topk.inputs[_TOPK_BASE].ref}) block_size {topk.attrs['block_size']}: "
                            f"rows would not mean the same tokens")
    return readers


def _rewrite(fn: Function, topk: Node, index: Index) -> bool:
    sel = topk.output
    readers = _check_readers(fn, topk, sel, index)
    if not readers:
        return False
    rows = Value(index.fresh_name(sel.name + ".rows"), sel.type)
    bs = topk.attrs["block_size"]
    convert = Node("selection_to_rows", [sel, topk.inputs[_TOPK_REQ], topk.inputs[_TOPK_BASE]], {"block_size": bs}, [rows])
    rows.producer = convert
    fn.nodes.insert(fn.nodes.index(topk) + 1, convert)
    index.add(convert)
    for r in readers:
        with index.rewired(r):
            r.inputs[_MLA_SEL] = rows
        r.attrs["selection_kind"] = "rows"
    fuse(fn, [topk, convert], FUSED_OP, {"topk": topk.attrs["topk"], "block_size": bs, "emits": "rows",
                                         "key_format": topk.attrs.get("key_format", "fp8")}, index=index)
    return True


def run(module: Module, ctx: PassContext) -> int:
    return rewrite_each(module, ctx, NAME, "indexer_topk", _rewrite, indexed=True)
