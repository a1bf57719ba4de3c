"""Serving a sharded model on several ranks: rank 0 owns the scheduler, the others replay its steps.

`parallel_runtime(layout, module, weights, build)` is what a command's runtime factory calls:
- one rank (no layout, or tp = 1): `build(module, weights)` unchanged;
- otherwise the module is sharded by the passes (shard_tp, shard_ep, shard_tokens, shard_dcp; a module already
  sharded by `k31c compile --tp` is only checked), this rank's weights are sliced from the full ones
  (`shard_weights`), and
  * rank 0 gets a `LeaderRuntime`: the runtime's interface, every request/step call broadcast first
    (torch.distributed.broadcast_object_list) so the other ranks make the same call;
  * ranks > 0 never return: they run `follow()` (replay until rank 0 says stop) and then raise
    `FollowerDone`, which `launch_main` turns into the rank's normal exit.
Prefill steps pick head- or token-sharded prefill per step (`choose_prefill_function`), the same on
every rank since every rank sees the same step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch.distributed as dist

from ir.core import Module

from .prefill_choice import choose_prefill_function
from .weights import shard_weights


class FollowerDone(Exception):
    """Raised on ranks > 0 when rank 0 has ended the run; not an error."""


@dataclass(frozen=True)
class ParallelLayout:
    tp: int = 1
    dcp: int = 1
    ep: int = 1
    rank: int = 0
    dcp_interleave: int = 1

    @property
    def world(self) -> int:
        return self.tp

    def problems(self, cfg=None) -> list[str]:
        out = []
        if self.tp < 1 or self.dcp < 1 or self.ep < 1:
            out.append(f"--tp/--dcp/--ep must be >= 1, found {self.tp}/{self.dcp}/{self.ep}")
            return out
        if self.tp % self.dcp:
            out.append(f"--dcp {self.dcp} must divide --tp {self.tp} (a DCP group is a subgroup of the TP group)")
        if self.ep not in (1, self.tp):
            out.append(f"--ep {self.ep}: experts are split over the whole TP group (--ep {self.tp}) or "
                       f"replicated (--ep 1); EP subgroups of the TP group are not implemented")
        if self.dcp not in (1, self.tp):
            out.append(f"--dcp {self.dcp}: the DCP group is the whole TP group (--dcp {self.tp}) or absent "
                       f"(--dcp 1); DCP subgroups of the TP group are not implemented")
        if cfg is not None:
            for what, n in (("KDA heads", cfg.kda_num_heads), ("MLA heads", cfg.num_attention_heads)):
                if n % self.tp:
                    out.append(f"--tp {self.tp} does not divide the {n} {what} of {cfg.name}")
            if cfg.num_experts % self.ep:
                out.append(f"--ep {self.ep} does not divide the {cfg.num_experts} experts of {cfg.name}")
        return out


def shard_module(module: Module, layout: ParallelLayout, token_shard_min_tokens: int = 0) -> Module:
    """Run the parallel passes on `module` (in place) for `layout`; a module already carrying
    tp/ep attrs (compiled with them) is checked instead."""
    from passes import shard_dcp, shard_ep, shard_tokens, shard_tp
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
                               "token_shard_min_tokens": token_shard_min_tokens})
    for p in (shard_tp, shard_ep, shard_tokens, shard_dcp):  # the pipeline's parallel phase, in its order
        p.run(module, ctx)
    return module


class LeaderRuntime:
    """Rank 0's runtime: forwards to the local runtime after broadcasting each call to the followers."""

    def __init__(self, rt, group=None):
        self._rt, self._group = rt, group

    def _send(self, *msg):
        dist.broadcast_object_list([msg], src=0, group=self._group)

    def __getattr__(self, name):  # read-only attributes (requests, pools, vocab_size, ...)
        return getattr(self._rt, name)

    def add_request(self, rid: str, capacity: int):
        self._send("add_request", rid, capacity)
        return self._rt.add_request(rid, capacity)

    def release(self, rid: str):
        self._send("release", rid)
        return self._rt.release(rid)

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
        return self.step("verify", drafts)

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
        elif kind == "add_request":
            rt.add_request(*rest)
        elif kind == "release":
            rt.release(*rest)
        else:
            raise RuntimeError(f"follower: unknown message {kind!r} from rank 0")


_LEADERS: list[LeaderRuntime] = []


def parallel_runtime(layout: ParallelLayout | None, module: Module, weights: Mapping, build: Callable):
    """See the module docstring. `build(module, weights)` makes one rank's local runtime."""
    if layout is None or layout.world == 1:
        return build(module, weights)
    module = shard_module(module, layout)
    ep_rank = layout.rank if layout.ep > 1 else 0
    local = build(module, shard_weights(module, weights, tp_rank=layout.rank, ep_rank=ep_rank))
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
