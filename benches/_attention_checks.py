"""Helpers of benches/bench_attention_decode.py: graph replay vs eager (the PDL-contract check) and the
registers / spills of every compiled indexer and MLA kernel."""

from __future__ import annotations

import os

import torch

from codegen.triton import _pdl

SMOKE = os.environ.get("BENCH_SMOKE") == "1"


def _same(a, b):
    a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
    return all(torch.equal(x, y) for x, y in zip(a, b))


def graph_vs_eager(fn, replays=50):
    """Eager result vs the result of `replays` replays of one captured call (PDL on: a contract break races)."""
    if SMOKE:
        return {"ok": _same(fn(), fn()), "replays": 1}
    want = fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = fn()
    bad = 0
    for _ in range(replays):
        g.replay()
        torch.cuda.synchronize()
        bad += not _same(got, want)
    return {"ok": bad == 0, "replays": replays, "mismatched_replays": bad, "pdl": _pdl.launch_kwargs().get("PDL", False)}


def kernel_inventory():
    """Registers / spills / shared memory of every compiled indexer and MLA kernel (one entry per
    specialisation: its constexprs tell the variants apart)."""
    from codegen.triton import _indexer_tiles, _mla_rows, _mla_tiles, _topk_parallel, _topk_select, mla_sparse
    fns = [mla_sparse._mla_heads_kernel, _mla_rows._mla_sparse_kernel, _mla_tiles._combine_kernel,
           _indexer_tiles._score_kernel, _indexer_tiles._rescore_kernel, _topk_select._merge_kernel,
           _topk_parallel._filter_kernel, _topk_parallel._select_kernel, _topk_parallel._place_kernel]
    out = []
    for fn in fns:
        for caches in getattr(fn, "device_caches", {}).values():
            for k in list(caches[0].values()):
                try:
                    k._init_handles()
                    names = fn.arg_names
                    cx = {names[i[0]]: str(v) for i, v in getattr(k.src, "constants", {}).items()
                          if isinstance(i, tuple) and len(i) == 1 and names[i[0]].isupper()}
                    out.append({"kernel": fn.__name__, "n_regs": k.n_regs, "n_spills": k.n_spills,
                                "shared": k.metadata.shared, "num_warps": k.metadata.num_warps,
                                "num_stages": k.metadata.num_stages, "constexprs": cx})
                except Exception as e:  # noqa: BLE001
                    out.append({"kernel": fn.__name__, "error": repr(e)})
    return out
