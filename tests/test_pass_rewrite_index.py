"""passes/rewrite.py's `Index` and `fuse(..., index=)`: after every fuse the index equals the producers and readers
rebuilt from scratch, and fusing with the index leaves exactly the IR that fusing without it leaves (the same groups,
on a clone of the module)."""

from __future__ import annotations

import random

import pytest

from ir.parser import parse_module
from ir.printer import print_module
from ir.verifier import verify
from passes.rewrite import Index, RewriteError, fuse, producers, uses
from tests.conftest import tiny_model


def _same_maps(index: Index, fn):
    assert {k: sorted(map(id, v)) for k, v in index.users.items() if v} == \
        {k: sorted(map(id, v)) for k, v in uses(fn).items()}
    assert {k: id(n) for k, n in index.made_by.items()} == {k: id(n) for k, n in producers(fn).items()}


@pytest.mark.parametrize("preset", ["k31-tiny", "kimi-linear-tiny"])
def test_fusing_through_the_index_keeps_it_exact_and_the_ir_the_same(preset):
    _, module, _ = tiny_model(preset)
    text = print_module(module)
    plain, indexed = parse_module(text), parse_module(text)
    rng = random.Random(7)
    fn_plain, fn_indexed = plain.function("decode"), indexed.function("decode")
    index = Index(fn_indexed)
    fused = 0
    for step in range(40):
        at, size = rng.randrange(0, len(fn_plain.nodes) - 3), rng.choice((2, 3))
        groups = [fn.nodes[at:at + size] for fn in (fn_plain, fn_indexed)]
        if any(n.op.startswith("fused.") for n in groups[0]):
            continue
        fuse(fn_plain, groups[0], f"fused.t{step}")
        fuse(fn_indexed, groups[1], f"fused.t{step}", index=index)
        _same_maps(index, fn_indexed)
        fused += 1
    assert fused >= 20
    assert print_module(indexed) == print_module(plain)
    verify(indexed)


def test_a_group_not_in_the_function_is_refused():
    _, module, _ = tiny_model("k31-tiny")
    fn = parse_module(print_module(module)).function("decode")
    other = parse_module(print_module(module)).function("decode")
    with pytest.raises(RewriteError, match="are not in @decode"):
        fuse(fn, [fn.nodes[0], other.nodes[1]], "fused.x", index=Index(fn))
