"""CPU parts of the CUDA-graph decode path (k31c/runtime/cuda_graphs.py): bucket choice, the sync-free
cache write, the graph mode of the Executor (context bound instead of token_pos.max(), run through the
Triton interpreter) and GraphedRuntime's eager fallback (fused metadata, reserved scratch block/slot).
Capture and replay themselves need a GPU: benches/bench_runtime_gpu.py checks replayed logits against
eager logits on the H200."""

from __future__ import annotations

import tempfile

import pytest
import torch

from ir.ops import OPS
from k31c.runtime.cuda_graphs import (GRAPH_SAFE_REFERENCE, GraphedRuntime, batch_buckets, bucket_for,
                                      width_bucket)
from k31c.runtime.reference import ReferenceRuntime
from tests.helpers import assert_close_rel


def test_buckets():
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert batch_buckets(48) == (1, 2, 4, 8, 16, 32, 48)
    assert batch_buckets(1) == (1,)
    with pytest.raises(ValueError, match="max_num_seqs"):
        batch_buckets(0)
    b = batch_buckets(48)
    assert [bucket_for(n, b) for n in (1, 2, 3, 5, 33, 48, 49)] == [1, 2, 4, 8, 48, 48, None]
    assert [width_bucket(n) for n in (0, 1, 2, 3, 129, 512)] == [1, 1, 2, 4, 256, 512]


@pytest.mark.parametrize("block_view", [False, True])
def test_sync_free_cache_write_matches_reference(block_view):
    g = torch.Generator().manual_seed(5)
    bs, nb, width = 4, 6, 5
    pool = torch.randn(nb * bs, width, generator=g)
    table = torch.tensor([[3, 0, -1], [5, 2, 1]], dtype=torch.int32)
    req = torch.tensor([0, 1, 1, 0])
    pos = torch.tensor([5, 0, 9, 2])
    vals = torch.randn(4, width, generator=g)
    op = OPS["cache_write"]
    attrs = op.full_attrs({"block_size": bs})
    want = op.reference(op.bind([pool.clone(), vals, req, pos, table]), attrs)
    got_pool = pool.clone()
    if block_view:  # a page of a packed block row: block stride wider than bs * width
        packed = torch.zeros(nb, bs * width + 3)
        target = packed[:, :bs * width].view(nb, bs, width)
        target.copy_(pool.view(nb, bs, width))
    else:
        target = got_pool
    GRAPH_SAFE_REFERENCE["cache_write"](op.bind([target, vals, req, pos, table]), attrs)
    assert torch.equal(target.reshape(nb * bs, width), want)


@pytest.fixture(scope="module")
def compiled_tiny():
    from k31c.compiler import CompileOptions, compile_model
    from k31c.model.init_weights import random_weights
    from k31c.model.presets import get_preset
    from k31c.plan import plan_options

    cfg = get_preset("k31-tiny")
    opts = CompileOptions(plan=plan_options("k31-tiny", target="h200"))
    art, _ = compile_model(cfg, None, tempfile.mkdtemp(), opts, model_source="preset k31-tiny")
    return cfg, art, random_weights(cfg, 0)


def _executor(art, weights, families=("indexer_select_rows", "mla_sparse"), **kw):
    """A compiled executor running only `families` as kernels (the graph-mode special cases; everything
    else by reference, which keeps the interpreted CPU test short)."""
    from k31c.runtime.executor import Executor

    choices = [c for c in art.choices if c.template is not None and c.template.family in families]
    return Executor(art.module, weights, choices, target="h200", configs=art.configs, **kw)


def _random_cache(rt, lengths: dict):
    """Admit requests already `lengths` tokens long over random (seeded per request, finite) cache and
    state contents, so a decode step reads a real context without a slow interpreted prefill; a request's
    values do not depend on which physical blocks or slot it got."""
    bs = rt.block_size
    for i, (rid, n) in enumerate(lengths.items()):
        rt.add_request(rid, 100)
        r = rt.requests[rid]
        r.length = n
        g = torch.Generator().manual_seed(100 + i)
        for name, t in rt.pools.items():
            if name in rt.state_pools:
                t[r.slot] = (0.5 * torch.randn(t.shape[1:], generator=g)).to(t.dtype)
                continue
            blocked = str(rt.module.function("decode").input(name).type.shape[0]) == "NB"  # [NB, bs, *row]
            row = t.shape[2:] if blocked else t.shape[1:]
            vals = 0.5 * torch.randn((len(r.blocks), bs, *row), generator=g)
            vals = vals.abs() + 0.1 if name.startswith("index_scales") else vals  # per-row scales positive
            for j, b in enumerate(r.blocks):
                if blocked:
                    t[b] = vals[j].to(t.dtype)
                else:
                    t[b * bs:(b + 1) * bs] = vals[j].to(t.dtype)


def test_graph_mode_executor_equals_eager(compiled_tiny):
    """The Executor's graph mode (static context bound, sync-free indexer launch and cache write, bounded
    tuning keys) gives the eager decode's logits and pools."""
    cfg, art, weights = compiled_tiny
    runs = []
    for bound in (None, 256):
        rt = ReferenceRuntime(art.module, weights, max_rows=512, max_requests=3, engine=_executor(art, weights))
        _random_cache(rt, {"r0": 20, "r1": 37})
        rt.interp.static_context = bound
        runs.append((rt.decode({"r0": 5, "r1": 9}), {k: v.clone() for k, v in rt.pools.items()}))
        assert rt.interp.stats()["kernel_launches"].get("indexer_select_rows", 0) > 0
    assert_close_rel(runs[1][0], runs[0][0], 1e-6, "graph-mode logits")
    for k in runs[0][1]:
        assert torch.equal(runs[1][1][k], runs[0][1][k]), f"pool {k} differs in graph mode"


def test_graphed_runtime_on_cpu_runs_eagerly_with_fused_metadata(compiled_tiny):
    """Off cuda GraphedRuntime never captures: decode falls back (counted) and equals ReferenceRuntime; the
    scratch block and slot are reserved beyond the requested capacity."""
    cfg, art, weights = compiled_tiny
    outs = []
    for cls in (ReferenceRuntime, GraphedRuntime):
        rt = cls(art.module, weights, max_rows=256, max_requests=2,
                 engine=_executor(art, weights, families=(), cuda_graphs=True))
        _random_cache(rt, {"a": 5, "b": 3})
        rows = [rt.decode({"a": 7, "b": 8}), rt.decode({"b": 3})]
        outs.append(torch.cat(rows))
        if cls is GraphedRuntime:
            assert not rt.interp.cuda_graphs and not rt.use_graphs
            st = rt.stats()
            assert sum(st["eager_fallbacks"].values()) == 2 and not st["graphs"]
            blk, slot = rt.scratch
            assert slot == 2 and all(blk not in r.blocks and slot != r.slot for r in rt.requests.values())
    assert_close_rel(outs[1], outs[0], 1e-6, "GraphedRuntime eager logits")


def test_engine_over_graphed_runtime_serves_the_same_tokens(tiny):
    """The Engine (continuous batching, chunked prefill, prefix caching) over GraphedRuntime (fused metadata,
    reserved scratch block and slot) returns the tokens and logits it returns over ReferenceRuntime, and
    frees every block but the scratch one at the end."""
    from k31c.runtime.engine import Engine
    from k31c.runtime.sampling import SamplingParams

    cfg, module, weights = tiny("k31-tiny")
    g = torch.Generator().manual_seed(4)
    shared = torch.randint(0, cfg.vocab_size, (9,), generator=g).tolist()
    prompts = [shared + torch.randint(0, cfg.vocab_size, (2 + 3 * i,), generator=g).tolist() for i in range(3)]
    runs = []
    for cls in (ReferenceRuntime, GraphedRuntime):
        eng = Engine(cls(module, weights, max_rows=256, max_requests=2), keep_logits=True, prefix_caching=True,
                     max_batched_tokens=8, prefill_chunk=5)
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, SamplingParams(max_new_tokens=3))
        final = eng.run_to_completion()
        runs.append(({rid: o.tokens for rid, o in final.items()}, eng.kept_logits))
        held = eng.cache.held_blocks if eng.cache else 0
        assert eng.rt.blocks.num_free + held == eng.rt.blocks.num_blocks - (cls is GraphedRuntime)
    assert runs[1][0] == runs[0][0]
    for rid, rows in runs[0][1].items():
        for a, b in zip(runs[1][1][rid], rows):
            assert_close_rel(a, b, 1e-6, f"engine logits {rid}")
