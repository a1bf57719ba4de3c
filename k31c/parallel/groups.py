"""The process groups of a parallel layout, built once per run (issue 8: DCP and EP groups inside TP).

One instance is `tp` ranks (the world). Inside it (DESIGN §5 T4 with vLLM's rule, k31c/plan/options.py):
- the TP group is every rank;
- DCP groups are `tp / dcp` runs of `dcp` consecutive ranks: rank r is DCP rank r % dcp of group r // dcp.
  Each DCP group stores one copy of the context, interleaved over its ranks; ranks with the same DCP rank
  in different groups hold the same positions. A DCP group's ranks hold consecutive TP head blocks, so
  `dcp_mla`'s all-gather of absorbed queries over the group yields heads [g·dcp·H/tp, (g+1)·dcp·H/tp)
  in rank order, and each rank keeps block `r % dcp` of them;
- EP groups are `tp / ep` runs of `ep` consecutive ranks: rank r holds the experts of EP rank r % ep
  (experts are replicated tp / ep times, once per EP group).
Merge-free DCP prefill (T5) gathers the context over the DCP group and then shards tokens over TP.

`group_ranks(tp, dcp, ep)` lists the groups; `build_groups(...)` makes them with
torch.distributed.new_group (every rank creates every subgroup in the same order, as new_group requires)
and registers this rank's group under its name ("tp", "dcp", "ep") with `ir.ops.collective.set_group`,
which is how a collective op's `group` attr finds its handle. A group spanning the world is registered
as the default group (None); a group of one rank is not made (no op runs on it). The groups of one
layout are built once per process group and reused.
"""

from __future__ import annotations

import torch.distributed as dist

from ir.ops.collective import clear_groups, set_group

_BUILT: dict[tuple, tuple] = {}  # (id(WORLD), tp, dcp, ep) -> (WORLD kept alive so its id stays unique, handles)


def group_ranks(tp: int, dcp: int = 1, ep: int = 1) -> dict[str, list[list[int]]]:
    """{name: [ranks of each group]} for a layout (every size divides tp: `ParallelLayout.problems`);
    rank r is rank r % n of its group of n."""
    sizes = {"tp": tp, "dcp": dcp, "ep": ep}
    return {name: [list(range(g * n, (g + 1) * n)) for g in range(tp // n)] for name, n in sizes.items()}


def build_groups(tp: int, dcp: int = 1, ep: int = 1) -> dict[str, object]:
    """Create (once per process group) and register the layout's groups; returns {name: handle}
    (None = the default group). Must be called by every rank of the world, in the same order."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("build_groups: torch.distributed is not initialised (launch with --tp N or torchrun)")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != tp:
        raise RuntimeError(f"build_groups: the process group has {world} ranks, the layout --tp {tp}")
    key = (id(dist.group.WORLD), tp, dcp, ep)
    if key not in _BUILT:
        handles: dict[str, object] = {}
        for name, groups in group_ranks(tp, dcp, ep).items():
            if len(groups) == 1:  # the whole world: the default group
                handles[name] = None
                continue
            if len(groups[0]) == 1:  # a group of one rank carries no collective (the pass is a no-op)
                continue
            for ranks in groups:  # every rank makes every subgroup, in the same order
                g = dist.new_group(ranks)
                if rank in ranks:
                    handles[name] = g
        _BUILT[key] = (dist.group.WORLD, handles)
    handles = _BUILT[key][1]
    clear_groups()  # a previous layout's groups must not linger under these names
    for name, g in handles.items():
        set_group(name, g)
    return dict(handles)


__all__ = ["group_ranks", "build_groups"]
