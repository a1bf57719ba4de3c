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


INDEXED = ("shard_dcp", "moe_expert_input_split", "fused_indexer_select", "value_gate", "kda_decode_fusion")


@pytest.mark.parametrize("preset", ["k31-tiny"])
def test_the_indexed_passes_leave_their_index_exact(preset, monkeypatch):
    """The passes that change the function besides `fuse` (inserted, replaced, removed or re-pointed nodes:
    `Index.drop` / `add`) leave every index they used equal to the maps rebuilt from scratch: checked when each
    `rewrite_each` returns (value_gate runs one per attention op) and when shard_dcp ends. Run as the pipeline runs
    them, sharded (tp = dcp = 2) so that shard_dcp also meets the token-sharded prefill."""
    import importlib

    import passes.rewrite as rw
    from passes.base import PassContext
    from passes.pipeline import PHASES

    made: list[Index] = []

    class Recorded(Index):
        def __init__(self, fn):
            super().__init__(fn)
            made.append(self)

    def checked_each(*args, **kwargs):
        start = len(made)
        n = rw_each(*args, **kwargs)
        for index in made[start:]:
            _same_maps(index, index.fn)
        return n

    rw_each = rw.rewrite_each
    monkeypatch.setattr(rw, "Index", Recorded)
    mods = {name: importlib.import_module(f"passes.{name}") for name in INDEXED}
    for mod in mods.values():
        monkeypatch.setattr(mod, "Index", Recorded)
        if hasattr(mod, "rewrite_each"):
            monkeypatch.setattr(mod, "rewrite_each", checked_each)
    from k31c.model.build import build_module
    from k31c.model.presets import get_preset

    module = build_module(get_preset(preset))   # its own module: the passes change it (tiny_model's is shared)
    ctx = PassContext(options={"tp": 2, "dcp": 2})
    for _, names in PHASES:
        for name in names:
            made.clear()
            mod = importlib.import_module(f"passes.{name}")
            n = mod.run(module, ctx)
            if name in INDEXED and not hasattr(mod, "rewrite_each"):  # shard_dcp: one index a function
                for index in made:
                    _same_maps(index, index.fn)
            if name in INDEXED:
                assert made and n > 0, f"{name} made no index or no rewrite on {preset}: the check would be vacuous"
    verify(module)


def test_names_are_fresh_and_those_fresh_name_gives():
    from passes.rewrite import Names, fresh_name

    _, module, _ = tiny_model("k31-tiny")
    fn = module.function("decode")
    base = fn.nodes[3].outputs[0].name
    names = Names(fn)
    first = names.fresh(base)
    assert first == fresh_name(fn, base) != base
    second = names.fresh(base)
    assert second not in (first, base) and second not in {o.name for n in fn.nodes for o in n.outputs}
    assert names.fresh("brand_new") == "brand_new" and names.fresh("brand_new") == "brand_new.1"
