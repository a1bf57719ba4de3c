"""CUDA graphs of the compiled decode step, one per (batch-size bucket, block-table-width bucket).

    rt = GraphedRuntime(module, weights, max_rows=..., max_requests=..., engine=Executor(..., cuda_graphs=True,
                        device="cuda"))
    logits = rt.decode({"a": 7, "b": 9})      # replayed from the graph of bucket (2, W)

Capture. A decode step of R requests whose block lists are at most `need` blocks long runs in the graph
of batch bucket B = the smallest bucket >= R (default 1, 2, 4, ... up to max_num_seqs) and width bucket
W = the smallest power of two >= need, where need counts the blocks holding the step's positions, not
blocks a request took ahead of time (the engine's asynchronous decode grows one step early, and the same
step must run the same graph, kernels and numbers either way). The graph's static inputs are the six
metadata tensors at shapes [B], [B+1], [B, W]; the cache and state pools are the runtime's own tensors, updated in place by every
replay (their addresses are checked before each replay; a moved pool drops the graphs). The captured
step is the Executor's, with its MLA-query branch on the side stream: the fork (side stream waits on an
event of the capturing stream) and the join (events waited on where the branch's results are read) are
captured as graph edges, so the overlap is inside the graph. Kernels see the context bound W x block_size
instead of a host-read `token_pos.max()` (`Executor.static_context`).

Priorities. `set_main_priority(True)` captures the main stream at the highest stream priority (the
executor's side stream has the lowest; torch instantiates graphs with per-node priorities), so that when
both streams have blocks waiting for a free SM the main path's are placed first. Off by default: on the
H200 (rank preset, 8K, session 11, bench_runtime_gpu.py --sections priority) it made the batch-1 step
slower, 582-584 vs 568-572 us, and batch 8 1205-1213 vs 1112: the side stream's shared-expert GEMVs, which
the MoE tail waits for, then start only after the main path's blocks. The opposite, the side stream at the
highest priority (session 12, benches/results/h200-2026-11-30-s12/runtime_moe_sched.json), changed nothing:
batch 1 564.0-565.2 vs 557.0-563.9 µs, batch 8 1095.7-1096.6 vs 1097.2-1100.5, and with the experts' gate-up
launched late (`_moe_gemv_words` LATE) 555.9-564.2 / 1078.4-1080.5 vs LATE alone 561.2-564.0 / 1079.6-1080.4:
not kept. In that run's trace the MoE layer's middle (the experts beside the shared expert's GEMVs) moves its
bytes at ~60% of the bandwidth: the experts' MXFP4 decode at one token needs ~11 µs of the whole GPU's issue
slots a layer (~42 instructions per 8-value word, _moe_configs.py), which the concurrent GEMVs then lack.
Session 13 (benches/results/h200-2026-11-30-s13/runtime_urgent.json) ran only the routed experts, or the experts
and their input projection z, on a third stream at the highest priority (forked and joined around each node):
batch 1 571.4-581.1 / 562.7-570.4 µs (z and experts with the gate-up late: 573.0-576.6) vs 557.2-563.6 off, batch 8
1100.0-1100.6 / 1114.1-1120.2 vs 1077.6-1080.6; graph == eager bitwise. Slower: removed. Priorities order block
placement only; what the experts lack beside the shared expert is issue slots, not SMs.

Padding. Rows R..B-1 are padding requests: token 0 at position 0, block table [scratch block, -1, ...],
state slot = the scratch slot. The scratch block and slot are reserved for this purpose when the runtime
is built (one block and one slot more than asked for), so a padded row writes only memory no request
owns; its logits rows are dropped and never reach the caller.

Metadata. By default (`metadata_in_graph=True`) the graph's first node is the kernel that expands a
packed int32 buffer into the static inputs (`step_metadata.GraphMetadata`, the strided layout whose
offsets depend only on (B, W)): a replay costs the host one numpy write of a pinned buffer (two,
alternating), one asynchronous copy and `cudaGraphLaunch`; nothing waits for the device, so the host can
prepare step N+1 while step N runs. With `metadata_in_graph=False` the copy and the kernel run before
each replay (`StepMetadataBuilder`, writing into the static inputs). In the H200 trace the step's second kernel
starts ~7 µs after this kernel ends; launching it with a programmatic edge (session 12: the metadata kernel
waiting and triggering at its start) did not move that start (batch 1 568.3-569.0 vs 568.6-570.2 µs,
benches/results/h200-2026-11-30-s12/runtime_late_metapdl.json), so the gap is not the launch; not kept.
Session 13 (runtime_trace_start.json, runtime_plain_first.json in benches/results/h200-2026-11-30-s13/): with
PDL off the second kernel starts 0.4 µs after the first ends (and the step takes 594 vs ~555 µs); with the
metadata expanded before the replay, the graph's first kernel runs at once and the stall moves to the next one
(the first GEMV starts 5.8 µs after the first kernel ends); the first 1 / 2 / 3 launches captured without their
programmatic edge change nothing (batch 1 551.4-553.6 vs 550.2-551.6 µs; the second kernel still starts at
9.3 µs). So the ~7 µs sit before the graph's first programmatic launch, whatever precedes it: a cost of PDL in
a graph, not of this kernel (the option was removed).
Session 14 (benches/results/h200-2026-11-30-s14/, bench_runtime_gpu.py sections ahead, carveout, pdl_window,
head_sleep): in the step as captured, the first node after the graph's first that takes part in PDL (compiled with
the instructions, or either end of a programmatic edge) starts ~9 µs after the first node started, whichever node
that is (the norm launched plainly still waits when the GEMM after it is programmatic). A spin kernel captured first hides it when it runs >= 10 µs (the metadata kernel then starts at 11.1 and the
norm 2.0 µs later) but not at 5 µs (the second node at 9.4); one captured after the metadata kernel starts at 9.1-9.6
itself. It is not the graph's submission (behind a 1 ms sleep the second kernel still starts at 9.2), not the SM's
shared-memory carveout (every kernel at 100% shared: batch 1 558.1-559.8 vs 557.5-559.0 µs), and not PDL edges as
such: graphs of 2-54 small PDL kernels (benches/bench_pdl_chain.py: forks onto 1-4 side streams, one-program first
kernels, 20 distinct binaries of 27 parameters) start each kernel's wait-return 0.26-0.38 µs after its predecessor.
The step's first two kernel nodes launched plainly (compiled without the instructions) take the stall out of the
trace (span 548.7 / 547.8 vs 553.3 / 551.8 µs) but not out of the replay: batch 1 555.2 / 554.6 vs 550.9 / 550.4
µs, batch 8 1079.1 / 1075.8 vs 1077.1 / 1074.4 (runtime_plain_head.json), so the wait moves before the graph's first
kernel, where the trace cannot see it. Removed (it was `Executor.plain_head`).
Session 19 (benches/results/h200-2026-12-01-s19/runtime_stream_engine.json, bench_runtime_gpu.py replay_stream): 50
replays launched back to back (no host synchronisation between them) take 513.8-515.0 µs a step at batch 1, as one
replay behind a sleep (513.5-514.3): every replay pays the stall, a serving loop that keeps the device fed included.
Session 20 (benches/results/h200-2026-12-01-s20/head_prefetch*.json): spending the stall on the step's first weights,
a prefetch kernel captured as the graph's first node reading the first N MB of the weights the step reads first (the
KDA packed projection's concatenation, 90 MB) into L2, measured slower at every size: loads (`.cg`) 507.3-508.0 us at
0 MB vs 510.7-512.5 at 16, 515.0-515.5 at 32, 517.0-517.3 at 40 (the same 32 MB on a side stream joined at the step's
end 513.3-514.9); `prefetch.global.L2::evict_last` per line 512.6-513.0 vs 514.8-515.2 / 517.8-519.4 / 521.0-522.3 at
16 / 32 / 48 MB. The prefetch kernel ran 10-14 us (3-4 TB/s) and the projection after it only 1-2 us faster with 40-48
MB of its 90 MB fetched: the lines do not stay in L2 until read. Removed (that README describes the kernels).
Steps outside the buckets (more requests than the largest
bucket, a table wider than `max_width` blocks) and every prefill/verify step run eagerly; fallbacks are
counted by reason in `stats()`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from ir.ref.paging import cache_rows, write_rows
from k31c.parallel.dcp_graph import GRAPH_SAFE as DCP_GRAPH_SAFE

from .reference import ReferenceRuntime
from .step_metadata import BlockRows, GraphMetadata, StepMetadataBuilder, check_step


def batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, ... below max_num_seqs, then max_num_seqs itself."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, found {max_num_seqs}")
    out, b = [], 1
    while b < max_num_seqs:
        out.append(b)
        b *= 2
    return tuple(out + [max_num_seqs])


def bucket_for(n: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket >= n, or None when n exceeds them all."""
    fit = [b for b in buckets if b >= n]
    return min(fit) if fit else None


def width_bucket(blocks: int) -> int:
    """Block-table width of a graph: the next power of two (at least 1)."""
    return 1 << max(0, int(blocks) - 1).bit_length()


# ---- sync-free versions of launches / references that read device data on the host --------------------
def _cache_write_no_sync(a, at):
    """cache_write's reference without `cache_rows`' host-side validation (the runtime validated every
    position when it built the step)."""
    bs = int(at["block_size"])
    rows = cache_rows(a.block_table, bs, a.token_req, a.token_pos, validate=False)
    return write_rows(a.pool, rows, a.values, bs, a.values.dim() - 1)


# cache_write, and the DCP references with static shapes: a TP / DCP decode step is captured with its
# collectives (NCCL) inside the graph
GRAPH_SAFE_REFERENCE = {"cache_write": _cache_write_no_sync, **DCP_GRAPH_SAFE}


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]
    logits: torch.Tensor
    metadata: GraphMetadata | None  # the captured metadata prologue (None: metadata built before replay)


class GraphedRuntime(ReferenceRuntime):
    """A ReferenceRuntime whose decode steps replay CUDA graphs when its engine asks for them
    (`Executor(cuda_graphs=True)` on cuda); every step's metadata comes from the fused kernel."""

    def __init__(self, module, weights: Mapping, *, max_rows: int = 4096, max_requests: int = 8,
                 max_num_seqs: int | None = None, max_width: int = 1 << 16, metadata_in_graph: bool = True, **kw):
        bs = int(module.attrs.get("block_size", 1))
        super().__init__(module, weights, max_rows=max_rows + bs, max_requests=max_requests + 1, **kw)
        self.scratch = (self.blocks.allocate(1)[0], self.free_slots.pop())  # (block, slot) of padding rows
        self._metadata_builder = StepMetadataBuilder(self.device)
        self.buckets = batch_buckets(max_num_seqs or max_requests)
        self.max_width = int(max_width)
        self.metadata_in_graph = bool(metadata_in_graph)
        # batch-invariant mode splits ops per request on the host (int(cu_seqlens[r])): no capture there
        self.use_graphs = (bool(getattr(self.interp, "cuda_graphs", False)) and self.device.type == "cuda"
                           and not getattr(self.interp, "batch_invariant", False))
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.failed: dict[tuple[int, int], str] = {}
        self.replays: Counter = Counter()
        self.fallbacks: Counter = Counter()
        self._pool_ptrs = None
        self._mempool = None
        self._capture_stream = None  # warm-ups and captures run on it (made at the first capture)
        self._block_rows = BlockRows()
        self.main_priority_high = False  # see "Priorities"

    def set_main_priority(self, high: bool) -> bool:
        """Capture the main stream at the highest priority (True) or at the side stream's (False, the
        default); drops the captured graphs; returns the previous setting."""
        before, self.main_priority_high = self.main_priority_high, bool(high)
        if before != self.main_priority_high:
            self._capture_stream = None
            self.drop_graphs()
        return before

    def _metadata(self, fn: str, chunks) -> dict[str, torch.Tensor]:
        return self._metadata_builder.build(check_step(self, fn, chunks))

    def step(self, fn: str, chunks, copy: bool = True) -> torch.Tensor:
        """As ReferenceRuntime.step; a replayed decode's logits are copied out of the graph's buffer unless
        `copy=False` (then they are valid until the next decode step is launched)."""
        if fn == "decode" and self.use_graphs:
            out = self._replay(chunks, copy)
            if out is not None:
                return out
        elif fn == "decode":
            self.fallbacks["graphs off (engine without cuda_graphs, not on cuda, or batch-invariant)"] += 1
        return super().step(fn, chunks)

    def _replay(self, chunks, copy: bool = True) -> torch.Tensor | None:
        rows = check_step(self, "decode", chunks, resolve_fed=not self.metadata_in_graph, copy_blocks=False)
        # the blocks the step reads, not the request's whole allocation: the bucket (and with it the kernels'
        # context bound and their numbers) must not depend on how far ahead blocks were taken; as int32 rows of
        # the mirror (`step_metadata.BlockRows`), which the metadata write copies without a conversion
        if len(self._block_rows) > 2 * len(self.requests) + 8:
            self._block_rows.forget(self.requests)
        rows = [(n, slot, self._block_rows.row(rid, self.requests[rid])[:self.blocks_for(n + len(t))], t)
                for rid, (n, slot, _, t) in zip(chunks, rows)]
        n, need = len(rows), max(len(b) for _, _, b, _ in rows)
        B, W = bucket_for(n, self.buckets), width_bucket(need)
        reason = (f"batch {n} above the largest bucket {self.buckets[-1]}" if B is None else
                  f"table width {W} blocks above max_width {self.max_width}" if W > self.max_width else
                  self.failed.get((B, W)))
        if reason:
            self.fallbacks[reason] += 1
            return None
        ptrs = tuple(t.data_ptr() for t in self.pools.values())
        if self._pool_ptrs is not None and ptrs != self._pool_ptrs:
            self.drop_graphs()  # a pool was reallocated: every graph points at the old one
            self.fallbacks["pools moved: graphs recaptured"] += 1
        self._pool_ptrs = ptrs
        g = self.graphs.get((B, W))
        if g is None:
            try:
                g = self.graphs[(B, W)] = self._capture(B, W)
            except Exception as e:  # capture is an optimisation: name why, run eagerly from now on
                self.failed[(B, W)] = f"capture of bucket ({B}, {W}) failed: {type(e).__name__}: {str(e)[:300]}"
                self.fallbacks[self.failed[(B, W)]] += 1
                torch.cuda.synchronize(self.device)
                return None
        if g.metadata is not None:
            g.metadata.write(rows)
            g.metadata.upload()
        else:  # the packed layout of a list per row
            self._metadata_builder.build([(n, s, b.tolist(), t) for n, s, b, t in rows], width=W, pad_to=B,
                                         scratch=self.scratch, out=g.inputs)
        g.graph.replay()
        for rid in chunks:
            self.requests[rid].length += 1
        self._last_outs = None
        self.replays[(B, W)] += 1
        return g.logits[:n].clone() if copy else g.logits[:n]

    def _capture(self, B: int, W: int) -> _Graph:
        """Warm up (kernel compilation, lazy weight uploads) on a side stream, then capture one decode step of
        B scratch-only rows with a W-block table (`static_context` = W x block_size)."""
        dev, eng = self.device, self.interp
        blk, slot = self.scratch
        table = torch.full((B, W), -1, dtype=torch.int32, device=dev)
        table[:, 0] = blk
        inputs = {"tokens": torch.zeros(B, dtype=torch.int64, device=dev),
                  "token_pos": torch.zeros(B, dtype=torch.int64, device=dev),
                  "token_req": torch.arange(B, dtype=torch.int64, device=dev),
                  "cu_seqlens": torch.arange(B + 1, dtype=torch.int64, device=dev),
                  "block_table": table, "state_slot": torch.full((B,), slot, dtype=torch.int64, device=dev)}
        meta = GraphMetadata(B, W, self.scratch, dev, feed=self.token_feed) if self.metadata_in_graph else None

        def step():
            if meta is not None:
                meta.expand(inputs)
            return eng.run("decode", {**inputs, **self.pools})

        eng.static_context = W * self.block_size
        try:
            # warm-up and capture on one stream: per-stream kernel state made in the warm-up (e.g. the zeroed
            # arrival counters of `_gemv.tile_counters`) is found again in the capture, so no one-time
            # zeroing is captured into the graph (a fill kernel on every replay, session 10's trace)
            if self._capture_stream is None:  # the highest priority: out-of-range values map to the highest
                self._capture_stream = torch.cuda.Stream(dev, priority=-100 if self.main_priority_high else 0)
            cap = self._capture_stream
            cap.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(cap):
                for _ in range(2):
                    step()
            torch.cuda.current_stream(dev).wait_stream(cap)
            torch.cuda.synchronize(dev)
            if self._mempool is None:
                self._mempool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._mempool, stream=cap):
                outs = step()
        finally:
            eng.static_context = None
        moved = [name for (name, t), o in zip(self.pools.items(), outs[1:]) if o.data_ptr() != t.data_ptr()]
        if moved:
            raise RuntimeError(f"decode returned new tensors for pools {moved[:3]} (not updated in place)")
        return _Graph(graph, inputs, outs[0], meta)

    def drop_graphs(self):
        """Forget every captured graph and their memory pool (the next capture starts a fresh pool: torch's
        allocator asserts when a private pool whose graphs were freed is captured into again)."""
        self.graphs.clear()
        self._mempool = None

    def stats(self) -> dict:
        return {"graphs": sorted(self.graphs), "replays": {f"{b}x{w}": n for (b, w), n in self.replays.items()},
                "eager_fallbacks": dict(self.fallbacks), "buckets": list(self.buckets),
                "scratch_block_slot": list(self.scratch), "metadata_in_graph": self.metadata_in_graph}
