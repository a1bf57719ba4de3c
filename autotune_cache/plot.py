"""Figures of a tuning run (matplotlib, Agg backend: no display needed).

- `study_png(result, dir)`: one PNG per study: each trial's median time (rejected / timed-out /
  failed trials marked at the bottom), the best-so-far line, and the heuristic's re-measured time;
- `ceilings_png(results, ceilings, dir)`: every tuned kernel on a roofline: arithmetic intensity
  (IR flops / IR bytes of the node at its bucket) against achieved FLOP/s (IR flops / tuned median),
  under the roofs `min(peak FLOP/s, bandwidth x intensity)` of the device's measured ceilings.
  Kernels the IR gives no flop count for are drawn at their achieved bandwidth on the bandwidth roof
  side (intensity taken as 0.01 flop/byte) and labelled "bytes only".

`ceilings(target, device)`: GPU targets take the `measured` figures of `k31c/targets` (datasheet
peaks where none was measured); the CPU is measured here once (a 64 MiB tensor copy counting bytes read
+ written, and a 1024^3 fp32 matmul).
"""

from __future__ import annotations

import math
import os
import re
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_")[:150]


def study_png(result, out_dir: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [n for n, v in result.history if v is not None]
    ys = [v for _, v in result.history if v is not None]
    bad = [n for n, v in result.history if v is None]
    ax.scatter(xs, ys, s=18, label="trial median")
    best, line = math.inf, []
    for n, v in result.history:
        best = min(best, v) if v is not None else best
        line.append(best if math.isfinite(best) else float("nan"))
    ax.step([n for n, _ in result.history], line, where="post", color="C2", label="best so far")
    if math.isfinite(result.default_us):
        ax.axhline(result.default_us, color="C3", ls="--", label=f"heuristic {result.default_us:.1f} us")
    if bad:
        floor = min(ys) * 0.9 if ys else 1.0
        ax.scatter(bad, [floor] * len(bad), marker="x", color="k", label="rejected / failed / timed out")
    if ys and max(ys) / max(min(ys), 1e-9) > 20:
        ax.set_yscale("log")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("trial")
    ax.set_ylabel("median time per launch (us)")
    ax.set_title(f"{result.family} {result.bid.split(':', 1)[1]}", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out_dir, f"study_{_safe(result.bid)}.png")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def ceilings(target: str, device: str) -> dict:
    """{"bandwidth": bytes/s, "flops": FLOP/s, "source": words}."""
    if device == "cpu":
        import torch

        x = torch.empty(16 << 20, dtype=torch.float32).uniform_()
        y = torch.empty_like(x)
        y.copy_(x)
        t0 = time.perf_counter()
        for _ in range(5):
            y.copy_(x)
        bw = 5 * 2 * x.numel() * 4 / (time.perf_counter() - t0)
        a = torch.randn(1024, 1024)
        a @ a
        t0 = time.perf_counter()
        for _ in range(3):
            a @ a
        fl = 3 * 2 * 1024 ** 3 / (time.perf_counter() - t0)
        return {"bandwidth": bw, "flops": fl, "source": "measured here: 64 MiB copy, 1024^3 fp32 matmul"}
    from k31c.targets import get_target

    t = get_target(target)
    meas = getattr(t, "measured", None) or {}
    bw = meas.get("hbm_bandwidth", t.hbm_bandwidth)
    fl = meas.get("bf16", t.peak_flops.get("bf16"))
    src = "measured" if "hbm_bandwidth" in meas and "bf16" in meas else "datasheet"
    return {"bandwidth": bw, "flops": fl, "source": f"k31c/targets {t.name} ({src}: bandwidth, bf16 matmul)"}


def ceilings_png(results: list, ceil: dict, out_dir: str, title: str = "") -> str:
    os.makedirs(out_dir, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 5.5))
    bw, peak = ceil["bandwidth"], ceil["flops"]
    ridge = peak / bw
    xs = [10 ** (k / 10) for k in range(-30, 41)]
    ax.plot(xs, [min(peak, bw * x) for x in xs], color="k", lw=1.5,
            label=f"roof: {bw / 1e9:.0f} GB/s, {peak / 1e12:.2f} TFLOP/s")
    ax.axvline(ridge, color="0.7", lw=0.8, ls=":")
    for i, r in enumerate(results):
        if not r.bytes or not r.median_us or not math.isfinite(r.median_us):
            continue
        sec = r.median_us * 1e-6
        if r.flops:
            x, y, tag = r.flops / r.bytes, r.flops / sec, ""
        else:
            x, y, tag = 0.01, 0.01 * r.bytes / sec, " (bytes only)"
        ax.scatter([x], [y], s=22, color=f"C{i % 10}")
        frac = y / min(peak, bw * x)
        ax.annotate(f"{r.family} {100 * frac:.2g}% of roof{tag}", (x, y), fontsize=6, xytext=(3, 2),
                    textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (IR flops / IR bytes)")
    ax.set_ylabel("achieved FLOP/s (IR flops / tuned median)")
    ax.set_title(title or f"tuned kernels vs measured ceilings ({ceil['source']})", fontsize=8)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path = os.path.join(out_dir, "ceilings.png")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
