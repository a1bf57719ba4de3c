"""Where a CUDA graph with programmatic (PDL) edges loses time at its start (issue 7): chains of small kernels.

    python benches/bench_pdl_chain.py [--lengths 2,8,32] [--programs 132] [--spin-us 3] [--fork-every 0,8]
                                      [--fanout 1,4] [--first-grid 0,1] [--distinct 0,20]

The rank decode graph's second kernel starts ~7 µs after its first ends (session 13, runtime_trace_start.json),
only when PDL is on, whatever the first kernels are. This bench builds graphs of N launches of one small kernel
(`_tick_kernel`: P programs, each spinning `spin` ns on %globaltimer; program 0 stamps the time it entered, the
time its grid-dependency wait returned and the time it left) and replays them in three modes:
  - `pdl` / `plain`: every launch with / without the programmatic attribute (the kernel always executes the PDL
    instructions, which return at once in a plain launch);
  - `pdl_first_plain`: the first launch plain, the rest programmatic (the decode step's shape);
with the step graph's other traits as options: every k-th launch forking `fanout` side streams (joined at the next
fork), the first two launches with one program, and `distinct` binaries of 27 parameters (`_tick_wide_kernel`).
Each graph is timed two ways:
  - `isolated`: event, replay, event, synchronise (how `bench_runtime_gpu.replay_us` times the decode graph: the
    device idles while the host submits the graph);
  - `ahead`: the same behind a ~1 ms `torch.cuda._sleep` launched first, so the host has submitted the graph
    before the device reaches it and the events see device time only.
Per mode and shape: the median replay time, and from the stamps of one more replay the gap before each kernel's
entry and wait-return, measured from the previous kernel's exit.

H200, session 14 (benches/results/h200-2026-11-30-s14/pdl_chain_*.json): no such stall in any of these graphs.
With PDL a launch's wait returns 0.26-0.38 µs after its predecessor exits (its programs entered ~2.5 µs before);
plain launches start 0.67-0.9 µs after. That holds for 2-54 launches, forks every 6-8 launches onto 1 or 4 side
streams, one-program first launches and 20 distinct binaries. `ahead` is ~2-5 µs faster than `isolated` (the
graph's submission). The real step behind the same head start keeps its stall (`bench_runtime_gpu.py --sections
ahead`: the second kernel at 9.2 µs, replay 546.7 vs 548.8 µs isolated). So the stall comes from what the step's
kernels do, not from PDL edges, graph shape or submission.

One JSON document (stdout and $OUT/pdl_chain.json) with machine, versions, command. GPU only (sm_90+).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from benches._report import BenchReport  # noqa: E402
from codegen.triton._pdl import pdl_launch_dependents, pdl_wait  # noqa: E402


@triton.jit
def _now():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _tick(stamps, i, spin_ns, PDL: tl.constexpr):
    """Stamp entry, wait-return and exit (program 0) around a spin of spin_ns on %globaltimer."""
    t0 = _now()
    pdl_wait(PDL)
    t1 = _now()
    pdl_launch_dependents(PDL)
    t = t1
    while t - t1 < spin_ns:
        t = _now()
    if tl.program_id(0) == 0:
        tl.store(stamps + 3 * i, t0)
        tl.store(stamps + 3 * i + 1, t1)
        tl.store(stamps + 3 * i + 2, _now())


@triton.jit
def _tick_kernel(stamps, i, spin_ns, PDL: tl.constexpr):
    _tick(stamps, i, spin_ns, PDL)


@triton.jit
def _tick_wide_kernel(stamps, i, spin_ns, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11, d12, d13, d14, d15, d16,
                      d17, d18, d19, d20, d21, d22, d23, V: tl.constexpr, PDL: tl.constexpr):
    """`_tick_kernel` with 24 more pointer parameters (the step's kernels take ~30-45) and a constexpr V that
    makes each value a binary of its own (the step launches ~20 distinct kernels)."""
    _tick(stamps, i, spin_ns + V, PDL)


MODES = ("pdl", "plain", "pdl_first_plain")


def _launch(stamps, i, grid, spin_ns, pdl, distinct):
    if distinct:
        _tick_wide_kernel[(grid,)](stamps, i, spin_ns, *([stamps] * 24), V=i % distinct, PDL=True, launch_pdl=pdl)
    else:
        _tick_kernel[(grid,)](stamps, i, spin_ns, PDL=True, launch_pdl=pdl)


def chain(stamps, n: int, programs: int, spin_ns: int, mode: str, fork_every: int = 0, first_grid: int = 0,
          distinct: int = 0, fanout: int = 1):
    """n launches on the current stream; fork_every > 0: every fork_every-th launch starts `fanout` launches, each
    on a side stream of its own that waits for the main stream (joined again at the next fork), as the decode
    step's overlapped branches do (its graph fans out up to 4 ways); first_grid > 0: the first two launches have
    that many programs (the step's first kernels have one); distinct > 0: `_tick_wide_kernel` in that many
    binaries, launch i taking binary i % distinct."""
    main = torch.cuda.current_stream()
    sides = _SIDE.setdefault(main.device, [])
    while len(sides) < fanout:
        sides.append(torch.cuda.Stream())
    forked, i = False, 0
    while i < n:
        pdl = mode == "pdl" or (mode == "pdl_first_plain" and i > 0)
        grid = first_grid if first_grid and i < 2 else programs
        if fork_every and i % fork_every == fork_every - 1:
            for side in sides[:fanout] if forked else ():
                main.wait_stream(side)
            for side in sides[:fanout]:
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    _launch(stamps, min(i, n - 1), grid, spin_ns, pdl, distinct)
                i += 1
            forked = True
        else:
            _launch(stamps, i, grid, spin_ns, pdl, distinct)
            i += 1
    for side in sides[:fanout] if forked else ():
        main.wait_stream(side)


_SIDE: dict = {}  # device -> side streams


def replay_us(graph, ahead_cycles: int, reps: int = 30) -> float:
    out = []
    for _ in range(reps):
        if ahead_cycles:
            torch.cuda._sleep(ahead_cycles)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e3)
    return sorted(out)[reps // 2]


def gaps(stamps, n: int) -> dict:
    s = stamps.view(n, 3).cpu().tolist()
    enter = [round((s[i][0] - s[i - 1][2]) / 1e3, 2) for i in range(1, n)]
    wait = [round((s[i][1] - s[i - 1][2]) / 1e3, 2) for i in range(1, n)]
    return {"enter_gap_us": enter, "wait_gap_us": wait, "span_us": round((s[-1][2] - s[0][0]) / 1e3, 2),
            "first_wait_us": round((s[0][1] - s[0][0]) / 1e3, 2)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="2,8,32")
    ap.add_argument("--programs", type=int, default=132)
    ap.add_argument("--spin-us", type=float, default=3.0)
    ap.add_argument("--fork-every", default="0", help="comma list: 0 (one stream) or k (every k-th launch forked)")
    ap.add_argument("--fanout", default="1", help="comma list: side streams a fork starts")
    ap.add_argument("--distinct", default="0", help="comma list: 0 (one kernel) or k binaries of 27 parameters")
    ap.add_argument("--first-grid", default="0", help="comma list: programs of the first two launches (0: --programs)")
    args = ap.parse_args()
    rep = BenchReport("pdl_chain")
    if not torch.cuda.is_available():
        rep.doc["notes"].append("GPU only")
        print(rep.save())
        return
    rep.doc["machine"] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                          "triton": triton.__version__, "cuda": torch.version.cuda}
    ahead = 2_000_000  # spin cycles: ~1 ms at the H200's ~1.98 GHz
    spin_ns = int(args.spin_us * 1e3)

    @rep.section
    def chains():
        ints = lambda v: [int(x) for x in v.split(",")]  # noqa: E731
        shapes = [(n, f, g, d, k) for n in ints(args.lengths) for f in ints(args.fork_every)
                  for g in ints(args.first_grid) for d in ints(args.distinct) for k in ints(args.fanout)]
        for n, fork, first, distinct, fanout in shapes:
            for mode in MODES:
                stamps = torch.zeros(3 * n, dtype=torch.int64, device="cuda")
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    chain(stamps, n, args.programs, spin_ns, mode, fork, first, distinct, fanout)
                torch.cuda.current_stream().wait_stream(side)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    chain(stamps, n, args.programs, spin_ns, mode, fork, first, distinct, fanout)
                g.replay()
                torch.cuda.synchronize()
                row = {"n": n, "mode": mode, "programs": args.programs, "spin_us": args.spin_us, "fork_every": fork,
                       "first_grid": first, "distinct": distinct, "fanout": fanout}
                for how, cyc in (("isolated", 0), ("ahead", ahead)):
                    row[f"replay_us_{how}"] = round(replay_us(g, cyc), 2)
                    if cyc:
                        torch.cuda._sleep(cyc)
                    g.replay()
                    torch.cuda.synchronize()
                    row[how] = gaps(stamps, n)
                rep.doc["measurements"].append(row)
                print(row, flush=True)
                del g

    chains()
    rep.save()


if __name__ == "__main__":
    main()
