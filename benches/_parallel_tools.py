"""Helpers of benches/bench_parallel_gpu.py: a one-step profile and the generic top-k merge baseline."""

from __future__ import annotations

import torch


def profile_step(fn, cuda: bool, top: int = 12) -> dict:
    """One call of fn under torch.profiler: the ops with the most self time on the host and on the device
    (where a step's time goes: launches, host syncs, or kernels)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    with profile(activities=acts) as prof:
        fn()
        sync()
    ev = prof.key_averages()
    dev_attr = "self_device_time_total" if hasattr(ev[0], "self_device_time_total") else "self_cuda_time_total"
    row = lambda e, t: {"op": e.key, "calls": e.count, "self_us": round(getattr(e, t), 1)}  # noqa: E731
    out = {"host_top": [row(e, "self_cpu_time_total") for e in
                        sorted(ev, key=lambda e: -e.self_cpu_time_total)[:top]],
           "host_total_us": round(sum(e.self_cpu_time_total for e in ev), 1)}
    if cuda:
        out["device_top"] = [row(e, dev_attr) for e in sorted(ev, key=lambda e: -getattr(e, dev_attr))[:top]]
        out["device_total_us"] = round(sum(getattr(e, dev_attr) for e in ev), 1)
    return out


def generic_merge(local_scores: torch.Tensor, k: int, world: int, rank: int):
    """Baseline: every rank all-gathers its local top-k as (key, global position) int32 pairs; each rank
    selects the global top-k (ties to the lower position) from the union. Returns positions [rows, k]."""
    from k31c.parallel.dcp_topk import _composite, all_gather_concat, global_positions, order_keys

    rows, n = local_scores.shape
    kk = min(k, n)
    keys = order_keys(local_scores)
    top = torch.topk(keys, kk, dim=1)
    pos = global_positions(rank, n, world, 1, device=keys.device)[top.indices]
    send = torch.stack([top.values, pos.to(torch.int32)], 2).contiguous()      # [rows, kk, 2]
    recv = torch.empty((world * rows, kk, 2), dtype=torch.int32, device=keys.device)
    all_gather_concat(recv, send, group=None)
    u = recv.view(world, rows, kk, 2).permute(1, 0, 2, 3).reshape(rows, world * kk, 2)
    comp = _composite(u[..., 0], u[..., 1])
    sel = torch.topk(comp, k, dim=1).indices
    return u[..., 1].gather(1, sel)
