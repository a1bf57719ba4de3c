"""Shared bench scaffolding: one JSON document per bench, saved atomically to $OUT/<name>.json after
every section, and a `section` decorator that records a failing section and goes on (one shot on the
GPU must still report everything that worked)."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback


class BenchReport:
    def __init__(self, name: str):
        self.name, self.t0 = name, time.time()
        self.doc = {"bench": name, "command": " ".join([sys.executable] + sys.argv), "machine": {}, "ceilings": {},
                    "measurements": [], "errors": [], "notes": []}

    def save(self) -> str:
        text = json.dumps(self.doc, indent=1, default=str)
        if os.environ.get("OUT"):
            path = os.path.join(os.environ["OUT"], f"{self.name}.json")
            with open(path + ".tmp", "w") as f:
                f.write(text)
            os.replace(path + ".tmp", path)
        return text

    def section(self, fn):
        def run(*a, **k):
            t = time.time()
            try:
                return fn(*a, **k)
            except Exception as e:  # one shot on the GPU: report and go on
                self.doc["errors"].append({"section": fn.__name__, "error": f"{type(e).__name__}: {e}",
                                           "trace": traceback.format_exc()[-2500:]})
                print(f"!! {fn.__name__}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            finally:
                print(f"-- {fn.__name__} {time.time() - t:.1f}s (total {time.time() - self.t0:.0f}s)", flush=True)
                self.save()
        return run


def median_ms(fn, device: str, rep: int = 100) -> float:
    """Median time of fn in ms: triton's do_bench on a GPU (warm-up, cache flush), one timed call on CPU."""
    if device == "cpu":
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=rep, return_mode="median")


def copy_bandwidth_GBps(device, nbytes: int = 1 << 31) -> float:
    """Measured HBM bandwidth: (read + write bytes) / time of a device-to-device copy of `nbytes`, the
    median of 6 timed by events; the ceiling byte floors divide by."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / (event_ms(lambda: dst.copy_(src)) * 1e-3) / 1e9


def event_ms(fn, n: int = 6) -> float:
    """fn's time in ms by CUDA events around each of `n` calls, the 4th fastest of 6 (the bandwidth ceilings)."""
    import torch

    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[n // 2]


def graph_ms(calls, reps: int = 20) -> float:
    """Device ms per call: every call of `calls` (e.g. rotated input sets, so L2 does not serve the next
    replay) run once on a side stream (compilation, warm-up), then captured in ONE CUDA graph, replayed
    `reps` times between events; the median replay over len(calls). GPU only."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2] / len(calls)
