"""Where a captured decode graph's replay time goes, kernel by kernel: the replays run under torch.profiler
(CUPTI records the kernels a CUDA graph launches), and each replay's kernels are laid out on one time axis.

Per kernel, memcpy and memset (in launch order, medians over the replays): its name, stream, start offset from the replay's
first kernel, duration, and the gap before it, i.e. the time since the device last had a kernel running on
any stream (launch latency, PDL waits that did not overlap, dependency joins). Per replay: the span (first
start to last end), the busy time (the union of all kernels' intervals), the idle time (span - busy) and the
time two streams ran kernels at once. Used by benches/bench_runtime_gpu.py (section `trace`)."""

from __future__ import annotations

import json
import os
import tempfile

import torch


_DEVICE_WORK = {"kernel": "", "gpu_memcpy": "memcpy: ", "gpu_memset": "memset: "}  # trace category -> name prefix


def _kernels(trace_path: str) -> list[dict]:
    with open(trace_path) as f:
        doc = json.load(f)
    ev = [e for e in doc.get("traceEvents", []) if e.get("cat") in _DEVICE_WORK and e.get("ph") == "X"
          and "spin_kernel" not in e.get("name", "")]  # torch.cuda._sleep's kernel: graph_trace's head start
    return sorted(({"name": _DEVICE_WORK[e["cat"]] + e["name"], "stream": (e.get("args") or {}).get("stream"), "ts": float(e["ts"]),
                    "dur": float(e["dur"])} for e in ev), key=lambda k: k["ts"])


def _split_replays(kernels: list[dict], n: int, per: int) -> list[list[dict]]:
    """The kernels of n replays of `per` kernels each (replays are synchronised, so they do not interleave)."""
    if len(kernels) != n * per:
        raise RuntimeError(f"graph trace: expected {n} replays x {per} kernels, the profiler recorded {len(kernels)}")
    return [kernels[i * per:(i + 1) * per] for i in range(n)]


def _replay_rows(ks: list[dict]) -> tuple[list[dict], dict]:
    t0 = ks[0]["ts"]
    rows, busy_end, busy, overlap = [], t0, 0.0, 0.0
    for k in ks:
        start, end = k["ts"], k["ts"] + k["dur"]
        rows.append({"start": start - t0, "dur": k["dur"], "gap": max(0.0, start - busy_end)})
        busy += max(0.0, end - max(start, busy_end))
        overlap += max(0.0, min(end, busy_end) - start)
        busy_end = max(busy_end, end)
    span = busy_end - t0
    return rows, {"span_us": span, "busy_us": busy, "idle_us": span - busy, "two_streams_us": overlap}


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def graph_trace(graph: torch.cuda.CUDAGraph, replays: int = 10, ahead_cycles: int = 0) -> dict:
    """Replay `graph` `replays` times under the profiler (after one untraced replay) and summarise.
    ahead_cycles > 0: each replay behind a `torch.cuda._sleep` of that many cycles (left out of the kernels), so
    the graph is submitted before the device reaches it."""
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as one:
        if ahead_cycles:
            torch.cuda._sleep(ahead_cycles)
        graph.replay()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "one.json")
        one.export_chrome_trace(p)
        per = len(_kernels(p))
        if per == 0:
            return {"error": "the profiler recorded no kernels of the graph replay (CUPTI graph tracing off?)"}
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                if ahead_cycles:
                    torch.cuda._sleep(ahead_cycles)
                graph.replay()
                torch.cuda.synchronize()
        p = os.path.join(d, "all.json")
        prof.export_chrome_trace(p)
        runs = _split_replays(_kernels(p), replays, per)
    laid = [_replay_rows(ks) for ks in runs]
    kernels = []
    for i in range(per):
        k = runs[0][i]
        kernels.append({"i": i, "name": k["name"][:80], "stream": k["stream"],
                        **{f: round(_median([rows[i][f] for rows, _ in laid]), 2) for f in ("start", "dur", "gap")}})
    totals = {f: round(_median([s[f] for _, s in laid]), 2) for f in laid[0][1]}
    by_name: dict[str, dict] = {}
    for k in kernels:
        b = by_name.setdefault(k["name"], {"name": k["name"], "count": 0, "dur_us": 0.0, "gap_us": 0.0})
        b["count"] += 1
        b["dur_us"] = round(b["dur_us"] + k["dur"], 2)
        b["gap_us"] = round(b["gap_us"] + k["gap"], 2)
    return {"replays": replays, "kernels_per_replay": per, **totals,
            "gaps_us": round(sum(k["gap"] for k in kernels), 2),
            "by_name": sorted(by_name.values(), key=lambda b: -b["dur_us"]), "kernels": kernels}


def graph_node_kinds(rt, batch: int, dot_path: str) -> dict:
    """Re-capture `rt`'s decode graph of `batch` rows in CUDA-graph debug mode, write its DOT dump to
    `dot_path` and count its nodes by kind (kernel, memcpy, memset, event record / wait, empty, host)."""
    import re

    orig = torch.cuda.CUDAGraph

    class _Debug(orig):
        def __init__(self, keep_graph: bool = False):
            super().__init__(True)  # keep_graph: the cudaGraph_t outlives instantiation, for the dump
            self.enable_debug_mode()

    rt.drop_graphs()
    torch.cuda.CUDAGraph = _Debug
    try:
        rt.replays.clear()
        rt.decode({f"r{i}": 3 for i in range(batch)})
    finally:
        torch.cuda.CUDAGraph = orig
    (key,) = rt.replays
    rt.graphs[key].graph.debug_dump(dot_path)
    with open(dot_path) as f:
        text = f.read()
    kinds: dict[str, int] = {}
    for m in re.finditer(r'label="\{?([A-Z_]+)\b', text):
        kinds[m.group(1)] = kinds.get(m.group(1), 0) + 1
    return {"dot": os.path.basename(dot_path), "bytes": len(text), "node_kinds": kinds}
