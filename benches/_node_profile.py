"""Where a compiled step's device time goes, node by node: each node of an Executor run is bracketed by
CUDA events, with no profiler attached. Events around eager launches measure the host too (a node's
launcher is slower than its kernel at decode sizes), so the step is run the way a CUDA graph captures
it (`static_context` set: no host reads of device data) behind a head start, `torch.cuda._sleep`, long
enough for the host to enqueue the whole step before the device reaches it: the events then time the
device alone (`host_ahead` says whether the head start sufficed). Each row
carries the bytes its operands and results occupy (for a weight-reading GEMM that is its byte floor; for
gathers such as the embedding, the cache reads or the routed experts it is an upper bound) and the
bandwidth that implies. Used by benches/bench_runtime_gpu.py (section `nodes`)."""

from __future__ import annotations

from collections import defaultdict

import torch


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    return int(getattr(x, "nbytes", 0) or 0)  # PackedMXFP4 and other packed weights


def _sleep_cycles_per_ms() -> float:
    """How many `torch.cuda._sleep` cycles last a millisecond on this device (measured)."""
    torch.cuda._sleep(1000)  # first call loads the kernel
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(10_000_000)
    b.record()
    b.synchronize()
    return 10_000_000 / a.elapsed_time(b)


def node_times(executor, step, repeats: int = 3, head_start_ms: float = 0.0) -> tuple[list[dict], bool]:
    """Run `step()` `repeats` times with every node of `executor` timed; one row per node (median time), and
    whether the host stayed ahead of the device in every repeat (only meaningful with a head start)."""
    times: dict[int, list[float]] = defaultdict(list)
    info: dict[int, dict] = {}
    pending = []
    inner = executor._dispatch

    def timed(n, args, env):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        outs = inner(n, args, env)
        b.record()
        pending.append((id(n), a, b))
        if id(n) not in info:
            t = executor._kernel.get(id(n))
            info[id(n)] = {"op": n.op, "kernel": t.family if t else "reference",
                           "results": ", ".join(o.ref for o in n.outputs)[:60],
                           "io_bytes": sum(map(_nbytes, args)) + sum(map(_nbytes, outs))}
        return outs

    executor._dispatch = timed
    ahead = True
    cycles = int(head_start_ms * _sleep_cycles_per_ms()) if head_start_ms else 0
    try:
        for _ in range(repeats):
            if cycles:
                torch.cuda._sleep(cycles)
                slept = torch.cuda.Event()
                slept.record()
            step()
            if cycles:
                ahead &= not slept.query()  # still sleeping once everything was enqueued
            torch.cuda.synchronize()
            for key, a, b in pending:
                times[key].append(a.elapsed_time(b) * 1e3)
            pending.clear()
    finally:
        del executor._dispatch  # the instance attribute; the class method is back
    rows = []
    for key, ts in times.items():
        ts.sort()
        us = ts[len(ts) // 2]
        rows.append({**info[key], "us": round(us, 2),
                     "GBps": round(info[key]["io_bytes"] / (us * 1e-6) / 1e9, 1) if us > 0 else None})
    return rows, ahead


def summarize(rows: list[dict], bandwidth_GBps: float, top: int = 30) -> dict:
    """Totals by kernel family and the slowest nodes, each with its time over its io-bytes floor."""
    fam: dict[str, dict] = defaultdict(lambda: {"nodes": 0, "us": 0.0, "io_bytes": 0})
    for r in rows:
        f = fam[r["kernel"] + ":" + r["op"]]
        f["nodes"] += 1
        f["us"] += r["us"]
        f["io_bytes"] += r["io_bytes"]
    floor = lambda b: b / (bandwidth_GBps * 1e9) * 1e6  # noqa: E731  (µs)
    by_family = sorted(({"kernel_op": k, **v, "us": round(v["us"], 1), "x_io_floor": round(v["us"] / max(floor(v["io_bytes"]), 1e-3), 2)}
                        for k, v in fam.items()), key=lambda d: -d["us"])
    slow = sorted(rows, key=lambda r: -r["us"])[:top]
    return {"total_us": round(sum(r["us"] for r in rows), 1), "nodes": len(rows),
            "io_floor_us": round(floor(sum(r["io_bytes"] for r in rows)), 1),
            "by_family": by_family,
            "slowest": [{**r, "x_io_floor": round(r["us"] / max(floor(r["io_bytes"]), 1e-3), 2)} for r in slow]}
