"""Serving a sharded model on several ranks: rank 0 owns the scheduler, the others replay its steps.

`parallel_runtime(layout, module, weights, build)` is what a command's runtime factory calls:
- one rank (no layout, or tp = 1): `build(module, weights)` unchanged;
- otherwise the layout is checked against the model (every problem named together, `check_layout`), the
  process groups are built once (`k31c.parallel.groups`: TP = every rank, DCP / EP = runs of consecutive
  ranks), the module is sharded by the passes (shard_tp, shard_ep, shard_tokens, shard_dcp, then
  plan_cache_layout again when the module carries a one-rank plan; a module
  already sharded by `k31c compile --tp` is only checked), this rank's weights are sliced from the full
  ones (`shard_weights`, EP rank = rank % ep), under DCP the runtime reserves cache blocks for this
  rank's share of each request only (`use_local_cache_rows`), and
  * rank 0 gets a `LeaderRuntime`: the runtime's interface, every request/step call broadcast first
    (torch.distributed.broadcast_object_list) so the other ranks make the same call (add_request,
    release, grow, steps, verify + accept; a shared cached prefix is refused: each rank's allocator is
    its own);
  * ranks > 0 never return: they run `follow()` (replay until rank 0 says stop) and then raise
    `FollowerDone`, which `launch_main` turns into the rank's normal exit.
Prefill steps pick head- or token-sharded prefill per step (`choose_prefill_function`), the same on
every rank since every rank sees the same step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from ir.core import Module

from .dcp_topk import local_count
from .groups import build_groups
from .prefill_choice import choose_prefill_function
from .weights import shard_weights


class FollowerDone(Exception):
    """Raised on ranks > 0 when rank 0 has ended the run; not an error."""


class LayoutError(ValueError):
    """The layout does not fit the model (every problem named); every rank raises it alike."""


@dataclass(frozen=True)
class ParallelLayout:
    """One instance of `tp` ranks; DCP and EP groups are runs of consecutive ranks inside it
    (k31c/parallel/groups.py): dcp | tp, ep | tp."""
    tp: int = 1
    dcp: int = 1
    ep: int = 1
    rank: int = 0
    dcp_interleave: int = 1

    @property
    def world(self) -> int:
        return self.tp

    @property
    def dcp_rank(self) -> int:
        return self.rank % self.dcp

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep

    def problems(self, cfg=None) -> list[str]:
        """Every configuration error of the layout (and, given a ModelConfig, of the model under it)."""
        out = []
        for flag, v in (("--tp", self.tp), ("--dcp", self.dcp), ("--ep", self.ep),
                        ("--dcp-interleave", self.dcp_interleave)):
            if not isinstance(v, int) or v < 1:
                out.append(f"{flag} must be a positive integer, found {v!r}")
        if out:
            return out
        if self.tp % self.dcp:
            out.append(f"--dcp {self.dcp} does not divide --tp {self.tp} (a DCP group is a run of --dcp ranks "
                       f"of the TP group)")
        if self.tp % self.ep:
            out.append(f"--ep {self.ep} does not divide --tp {self.tp} (an EP group is a run of --ep ranks of "
                       f"the TP group; experts are replicated once per EP group)")
        if cfg is not None:
            for what, n in (("KDA heads", cfg.kda_num_heads), ("MLA heads", cfg.num_attention_heads)):
                if n % self.tp:
                    out.append(f"--tp {self.tp} does not divide the {n} {what} of {cfg.name}")
            if cfg.num_experts % self.ep:
                out.append(f"--ep {self.ep} does not divide the {cfg.num_experts} experts of {cfg.name}")
        return out


def layout_config(module: Module):
    """The ModelConfig a module was built from (its `config` attr), or None when it has none."""
    raw = module.attrs.get("config")
    if not raw:
        return None
    from k31c.model.config import ModelConfig

    return ModelConfig.from_hf(json.loads(raw), source=f"module @{module.name}", name=module.name)


def check_layout(layout: ParallelLayout, module: Module | None = None):
    """Raise LayoutError naming every problem of `layout` (for `module`'s model when given)."""
    problems = layout.problems(layout_config(module) if module is not None else None)
    if problems:
        raise LayoutError("parallel layout: " + "; ".join(problems))


def shard_module(module: Module, layout: ParallelLayout, token_shard_min_tokens: int = 0) -> Module:
    """Run the parallel passes on `module` (in place) for `layout`; a module already carrying
    tp/ep attrs (compiled with them) is checked instead. Collectives name the groups "tp", "dcp", "ep"
    (registered by `k31c.parallel.groups.build_groups`)."""
    from passes import plan_cache_layout, shard_dcp, shard_ep, shard_tokens, shard_tp
    from passes.base import PassContext, PassError

    have = tuple(module.attrs.get(k, 1) for k in ("tp", "ep", "dcp", "dcp_interleave"))
    want = (layout.tp, layout.ep, layout.dcp, layout.dcp_interleave if layout.dcp > 1 else 1)
    if have[:3] != (1, 1, 1):
        if have != want:
            raise PassError(f"module was compiled for tp/ep/dcp/dcp-interleave = {have}, launched with {want}: "
                            f"launch with the compiled layout (k31c inspect shows it) or recompile")
        return module
    ctx = PassContext(options={"tp": layout.tp, "ep": layout.ep, "dcp": layout.dcp,
                               "dcp_interleave": layout.dcp_interleave,
                               "tp_group": "tp", "ep_group": "ep", "dcp_group": "dcp",
                               "token_shard_min_tokens": token_shard_min_tokens})
    for p in (shard_tp, shard_ep, shard_tokens, shard_dcp):  # the pipeline's parallel phase, in its order
        p.run(module, ctx)
    if "cache_layout" in module.attrs:  # planned for one rank: the per-rank pools changed, plan them again
        plan_cache_layout.run(module, ctx)
    return module


def rows_per_rank(tokens: int, dcp: int, interleave: int = 1) -> int:
    """Cache rows one DCP rank reserves for a request of `tokens` positions: the largest share of any
    rank (rank 0's, = ceil(tokens / dcp) for interleave 1), so every rank takes the same blocks, and a
    table of MB blocks covers MB·block_size·dcp global positions (what the T5 workspace table assumes)."""
    return int(local_count(torch.tensor(int(tokens)), 0, dcp, interleave))


def use_local_cache_rows(rt, layout: ParallelLayout):
    """Under DCP a rank stores 1/dcp of a request's positions: set runtime `rt`'s `rows_for(tokens)` hook
    (which its blocks_for, hence add_request / grow / engine admission, use) to `rows_per_rank`. The KV
    capacity in tokens of a pool grows ~dcp-fold."""
    if layout.dcp == 1:
        return rt
    dcp, il = layout.dcp, layout.dcp_interleave
    rt.rows_for = lambda tokens: rows_per_rank(tokens, dcp, il)
    return rt


class LeaderRuntime:
    """Rank 0's runtime: forwards to the local runtime after broadcasting each call to the followers."""

    def __init__(self, rt, group=None):
        self._rt, self._group = rt, group

    def _send(self, *msg):
        dist.broadcast_object_list([msg], src=0, group=self._group)

    def __getattr__(self, name):  # read-only attributes (requests, pools, vocab_size, ...)
        return getattr(self._rt, name)

    def add_request(self, rid: str, capacity: int, prefix_blocks: Sequence[int] = (), prefix_len: int = 0):
        if prefix_blocks or prefix_len:
            from k31c.runtime.reference import RequestError

            raise RequestError(f"request {rid!r}: a cached prefix cannot be shared across "
                               f"{dist.get_world_size(self._group)} ranks (each rank's block allocator holds its "
                               f"own references); serve without --prefix-caching under --tp > 1")
        self._send("add_request", rid, capacity)
        return self._rt.add_request(rid, capacity)

    def release(self, rid: str):
        self._send("release", rid)
        return self._rt.release(rid)

    def grow(self, rid: str, capacity: int):
        self._send("grow", rid, capacity)
        return self._rt.grow(rid, capacity)

    def accept(self, rid: str, n: int):
        self._send("accept", rid, n)
        return self._rt.accept(rid, n)

    def step(self, fn: str, chunks: Mapping[str, Sequence[int]]):
        chunks = {rid: [int(t) for t in toks] for rid, toks in chunks.items()}
        if fn == "prefill":
            fn = choose_prefill_function(self._rt.module, [len(c) for c in chunks.values()])
        self._send("step", fn, chunks)
        return self._rt.step(fn, chunks)

    def prefill(self, chunks):
        return self.step("prefill", chunks)

    def decode(self, tokens):
        return self.step("decode", {rid: [t] for rid, t in tokens.items()})

    def verify(self, drafts):
        drafts = {rid: [int(t) for t in toks] for rid, toks in drafts.items()}
        self._send("verify", drafts)  # the followers' runtimes keep their per-token states for accept()
        return self._rt.verify(drafts)

    def stop(self):
        self._send("stop")


def follow(rt, group=None) -> int:
    """Replay rank 0's calls on this rank's runtime until it says stop; returns the number of steps."""
    steps = 0
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        kind, *rest = box[0]
        if kind == "stop":
            return steps
        if kind == "step":
            rt.step(*rest)
            steps += 1
        elif kind in REPLAYED:
            getattr(rt, kind)(*rest)
            steps += kind == "verify"
        else:
            raise RuntimeError(f"follower: unknown message {kind!r} from rank 0")


REPLAYED = ("add_request", "release", "grow", "verify", "accept")  # what LeaderRuntime forwards besides steps


_LEADERS: list[LeaderRuntime] = []


def parallel_runtime(layout: ParallelLayout | None, module: Module, weights: Mapping, build: Callable):
    """See the module docstring. `build(module, weights)` makes one rank's local runtime."""
    if layout is None or layout.world == 1:
        return build(module, weights)
    check_layout(layout, module)
    build_groups(layout.tp, layout.dcp, layout.ep)
    module = shard_module(module, layout)
    local = build(module, shard_weights(module, weights, tp_rank=layout.rank, ep_rank=layout.ep_rank))
    use_local_cache_rows(local, layout)
    if layout.rank == 0:
        leader = LeaderRuntime(local)
        _LEADERS.append(leader)
        return leader
    follow(local)
    raise FollowerDone()


def stop_followers():
    """Called by launch_main on rank 0 when the command returns: release the followers."""
    while _LEADERS:
        _LEADERS.pop().stop()
