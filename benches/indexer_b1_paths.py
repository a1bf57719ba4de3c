"""Batch-1 indexer top-k at 8K (the rank decode step's shape, SELECT 2: `codegen/triton/_topk_fused.py`) per input set,
the heuristic's config ("default") against --variants (config overrides). The last program of the score launch scans
the row's keys only for inputs whose histograms leave the boundary bucket unresolved, so configs that differ in that
scan (SELECT_SCAN: keys a step, a row of at most that many held in registers; SELECT_PICK: masked max / min passes
over such a row, 0 = none: the bucket gathered into the work row for 8-bit steps; SELECT_WB: the work row) differ only
on those sets; a variant with "_stop": "score" runs the score launch alone (`indexer_topk(stop_after="score")`).
Each set is timed alone (graph replay behind a ~1 ms sleep, median of --replays), classified by `threshold_path`
(which step fixes the threshold, from the IR reference's scores) and checked: every variant's rows equal the
default's, the default's equal the IR reference's selection (first 8 sets). --pad-kb shifts the workspaces'
addresses (the histograms' atomics by address).

    PYTHONPATH=. python3 benches/indexer_b1_paths.py --sets 64 --replays 20 \
        --variants 'before_s20={"SELECT_SCAN": 1024, "SELECT_PICK": 0};score_only={"_stop": "score"}' \
        --json $OUT/indexer_b1_paths.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import bench_attention as ba  # noqa: E402

from autotune_cache.graph_tune import replay_us  # noqa: E402  (each replay behind a ~1 ms sleep)

def _keys(scores: torch.Tensor) -> torch.Tensor:
    """The kernel's int64 keys of a row's fp32 scores (order: score desc, position asc), on the host: the DCP top-k's
    orderable bits and (key, position) composite."""
    from k31c.parallel.dcp_topk import _composite, order_keys
    s = scores.float().cpu()
    return _composite(order_keys(s), torch.arange(len(s)))


def _reference_scores(d) -> torch.Tensor:
    """The IR reference's fp32 scores of the set's one row over its context."""
    from ir.ref import indexer as ref
    scores, _ = ref.indexer_scores_padded(*ba.indexer_reference_args(d))
    return scores[0, :d["L"]]


def threshold_path(scores: torch.Tensor, topk: int) -> dict:
    """Which step of `_topk_fused._threshold` fixes the threshold for these scores (the IR reference's fp32 scores:
    the kernel's may differ in the last bits): "d0", "t16", "w21" (histograms) or "scan" (with whether the folded
    21-bit counts disagreed, and the scanned bucket's size)."""
    import numpy as np
    k = _keys(scores).numpy()
    t16 = ((k >> 48) & 65535) ^ 32768

    def step(hist, need):
        total = hist.sum()
        suffix = total - np.cumsum(hist) + hist
        b = int((suffix >= need).sum()) - 1
        new_need = need - (suffix[b] - hist[b])
        return b, int(new_need), bool(total <= need or hist[b] == new_need)
    b0, need, done = step(np.bincount(t16 >> 5, minlength=2048), topk)
    if done:
        return {"path": "d0"}
    in0 = (t16 >> 5) == b0
    b1, need, done = step(np.bincount(t16[in0] & 31, minlength=32), need)
    if done:
        return {"path": "t16"}
    tb = (b0 << 5) | b1
    fold = (t16 & 2047) * 32 + ((k >> 43) & 31)
    h21 = np.bincount(fold, minlength=65536)[(tb & 2047) * 32:(tb & 2047) * 32 + 32]
    in16 = t16 == tb
    if h21.sum() == in16.sum():
        b2, need21, done = step(h21, need)
        if done:
            return {"path": "w21"}
        return {"path": "scan", "fold_fail": False, "n_w": int((in16 & (((k >> 43) & 31) == b2)).sum()), "need": need21}
    return {"path": "scan", "fold_fail": True, "n_w": int(in16.sum()), "need": need}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sets", type=int, default=48)
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--variants", default='before_s20={"SELECT_SCAN": 1024, "SELECT_PICK": 0}',
                    help="name=JSON overrides of the heuristic's config, ';'-separated")
    ap.add_argument("--slow-us", type=float, default=18.0, help="a set slower than this counts as slow")
    ap.add_argument("--pad-kb", type=int, default=0,
                    help="allocate this many KB first (the workspaces then land at other addresses)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("indexer_b1_paths: needs a CUDA device")
    import triton

    pad = torch.empty(args.pad_kb * 1024 + 1, dtype=torch.uint8, device="cuda")  # noqa: F841  (kept alive)
    from codegen.triton.indexer_topk import heuristic
    T, L, K = 1, args.context, 2048
    base = heuristic({"T": T, "L": L, "K": K, "HI": 32, "DI": 128}, "h200")
    configs = {"default": base}
    for item in filter(None, args.variants.split(";")):
        name, _, over = item.partition("=")
        configs[name.strip()] = dict(base, **json.loads(over))
    doc = {"bench": "indexer_b1_paths", "command": " ".join(sys.argv),
           "machine": {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
                       "gpu": torch.cuda.get_device_name()},
           "shape": {"T": T, "L": L, "K": K, "HI": 32, "DI": 128, "keys": "fp8"}, "config": base, "pad_kb": args.pad_kb,
           "sets": []}
    for i in range(args.sets):
        d = ba._indexer_inputs(T, L, seed=300 + i)
        row = {"seed": 300 + i}
        outs = {}
        for name, cfg in configs.items():
            stop = cfg.get("_stop")
            fn = ba._indexer_call(d, K, {k: v for k, v in cfg.items() if k != "_stop"}, output="rows", stop_after=stop)
            fn()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                outs[name] = fn()
            times = sorted(replay_us(g, args.replays))
            row[f"{name}_us"] = times[len(times) // 2]
            del g
        row["rows_equal_default"] = {n: bool(torch.equal(o, outs["default"])) for n, o in outs.items()
                                     if n != "default" and "_stop" not in configs[n]}
        row.update(threshold_path(_reference_scores(d), K))
        if i < 8:
            chk = ba._indexer_check(d, K, base)
            row["exact_vs_reference"] = chk["exact_match_rows"] == chk["rows"] and chk["ok"]
        doc["sets"].append(row)
        print(json.dumps(row), flush=True)
    from codegen.triton import _topk_fused
    doc["histogram_buffers"] = [hex(b.data_ptr()) for b in _topk_fused._ZEROED.values()]
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    sets = doc["sets"]
    doc["summary"] = {
        "sets": len(sets), "all_rows_equal_default": all(all(r["rows_equal_default"].values()) for r in sets),
        "exact_vs_reference": all(r.get("exact_vs_reference", True) for r in sets),
        "per_config": {n: {"median_us": med([r[f"{n}_us"] for r in sets]),
                           "mean_us": sum(r[f"{n}_us"] for r in sets) / len(sets),
                           "max_us": max(r[f"{n}_us"] for r in sets),
                           "slow_sets": [r["seed"] for r in sets if r[f"{n}_us"] > args.slow_us]} for n in configs},
        "paths": {p: sum(r["path"] == p for r in sets) for p in ("d0", "t16", "w21", "scan")}}
    print(json.dumps(doc["summary"]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
