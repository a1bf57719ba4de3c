"""Per-rank weight shards, sliced from the full checkpoint by the params' sharding attrs.

The sharding passes record on every split param where it splits:
    tp_dim, tp_parts   (passes/shard_tp.py: col/heads -> dim 0, row -> dim 1)
    ep_dim, ep_parts   (passes/shard_ep.py: the leading expert axis)
Rank r of a split in `parts` along `dim` holds the contiguous block r of size n/parts (head-major
layouts make that block r's heads / experts). Packed MXFP4 weights slice their bytes along a leading
axis (never the packed reduction axis). The result is checked against the sharded module's declared
shapes, naming every mismatch.
"""

from __future__ import annotations

from typing import Mapping

import torch

from ir.core import Module
from ir.packed import PackedMXFP4


def _block(t, dim: int, parts: int, rank: int, name: str):
    if not 0 <= rank < parts:
        raise ValueError(f"@{name}: rank {rank} outside a split in {parts}")
    if isinstance(t, PackedMXFP4):
        if dim >= len(t.shape) - 1:
            raise ValueError(f"@{name}: cannot split packed MXFP4 along its reduction axis {dim}")
        return PackedMXFP4(_block(t.packed, dim, parts, rank, name), _block(t.scales, dim, parts, rank, name))
    n = t.shape[dim]
    if n % parts:
        raise ValueError(f"@{name}: dim {dim} = {n} is not divisible by {parts}")
    # a copy, not a view: a view would keep the full tensor's storage alive on every rank
    return t.narrow(dim, rank * (n // parts), n // parts).clone(memory_format=torch.contiguous_format)


def shard_weights(module: Module, weights: Mapping, tp_rank: int = 0, ep_rank: int = 0) -> dict:
    """The weights rank (tp_rank, ep_rank) loads for a sharded `module`, sliced from full `weights`."""
    out, problems = {}, []
    for name, p in module.params.items():
        if name not in weights:
            problems.append(f"@{name}: missing from the checkpoint")
            continue
        t = weights[name]
        if "tp_parts" in p.attrs:
            t = _block(t, int(p.attrs["tp_dim"]), int(p.attrs["tp_parts"]), tp_rank, name)
        if "ep_parts" in p.attrs:
            t = _block(t, int(p.attrs["ep_dim"]), int(p.attrs["ep_parts"]), ep_rank, name)
        want = tuple(int(d) for d in p.type.shape)
        if tuple(t.shape) != want:
            problems.append(f"@{name}: shard has shape {list(t.shape)}, the sharded module declares {list(want)}")
        out[name] = t
    if problems:
        raise ValueError(f"shard_weights (tp rank {tp_rank}, ep rank {ep_rank}): " + "; ".join(problems))
    return out


def shard_bytes(weights: Mapping) -> int:
    """Bytes of a weight dict (packed weights at their packed size)."""
    return sum(t.nbytes if isinstance(t, PackedMXFP4) else t.numel() * t.element_size() for t in weights.values())


__all__ = ["shard_weights", "shard_bytes"]
