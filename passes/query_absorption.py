"""Query absorption beside the indexer: in a decode or verify step, the MLA query's absorption into the latent
space, q~ = W_UK^T q_nope, is its own node on the query path's stream instead of the attention kernel's first launch.

Pattern (after overlapped_mla_query and value_gate; per mla_attention A of a decode/verify function, form absorbed
or latent, whose q_nope is produced by a node scheduled beside the indexer, i.e. carrying `overlap`):
    %q_nope, %q_pe, %pool' = fused.mla_query(...) {overlap="indexer", ...}
    ... indexer nodes ...
    %o = mla_attention(%q_nope, %q_pe, %pool', @kv_b, ...) {form}
Rewrite:
    %q_nope, %q_pe, %pool' = fused.mla_query(...) {overlap="indexer", ...}
    %q_abs = mla_absorb(%q_nope, @kv_b) {overlap="indexer"}                 (right after its producer)
    ... indexer nodes ...
    %o = mla_attention(%q_abs, %q_pe, %pool', @kv_b, ...) {form, q_absorbed=true, nope_dim=dn}
Why: the attention node waits for the indexer's top-k, and its absorption (a [H, dn] x [dn, kv] product per token,
one launch) ran after that wait on the step's critical path (H200 rank decode at batch 1: ~3 us per MLA layer,
benches/results/h200-2026-11-30-s11). q~ depends only on the query path, so it now runs on the second stream while
the indexer scores and selects.

Preconditions: the function's kind is decode or verify; A is not yet q_absorbed; its q_nope is a node result that
carries `overlap` (otherwise the absorption would run in order and nothing is gained: the layer is left alone).
Postconditions: one mla_absorb per rewritten layer, scheduled right after q_nope's producer with the producer's
`overlap`; A reads q~ with q_absorbed=true and nope_dim = dn; numerics unchanged (the same product, in q_nope's
dtype, that the absorbed attention computed inside). Counts one per layer.
"""

from __future__ import annotations

from ir.core import Function, Module, Node, Value

from .base import PassContext
from .rewrite import fresh_name, producers, rewrite_each

NAME = "query_absorption"
KINDS = ("decode", "verify")


def _rewrite(fn: Function, mla: Node) -> bool:
    if mla.attrs.get("q_absorbed") or mla.attrs.get("form", "absorbed") not in ("absorbed", "latent"):
        return False
    q_nope, kv_b = mla.inputs[0], mla.inputs[3]
    src = producers(fn).get(id(q_nope))
    if src is None or "overlap" not in src.attrs:
        return False
    t, h, dn = q_nope.type.shape
    q_abs = Value(fresh_name(fn, q_nope.name + ".abs"), q_nope.type.with_shape((t, h, kv_b.type.shape[1])))
    absorb = Node("mla_absorb", [q_nope, kv_b], {"overlap": src.attrs["overlap"]}, [q_abs])
    q_abs.producer = absorb
    fn.nodes.insert(fn.nodes.index(src) + 1, absorb)
    mla.inputs[0] = q_abs
    mla.attrs.update(q_absorbed=True, nope_dim=int(dn))
    return True


def run(module: Module, ctx: PassContext) -> int:
    return rewrite_each(module, ctx, NAME, "mla_attention", _rewrite, kinds=KINDS)
