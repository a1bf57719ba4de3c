"""Per-step choice between head-sharded and token-sharded prefill (T3, issue 8).

The compiler leaves both entries in a TP module: @prefill (head sharding) and, when `shard_tokens` ran,
@prefill_token_sharded, whose attrs carry `token_multiple` (2·TP: every request's chunk must be a
multiple, so each rank holds exactly B/TP rows) and `token_shard_min_tokens` (the cost model's
crossover: `k31c.plan.sharding_cost.prefill_sharding(opts)["crossover_tokens"]`). Every rank makes the
same choice from the same step, so no coordination is needed.
"""

from __future__ import annotations

from typing import Sequence

from ir.core import Module

HEAD, TOKEN = "prefill", "prefill_token_sharded"


def choose_prefill_function(module: Module, chunk_lens: Sequence[int]) -> str:
    """"prefill_token_sharded" when the module has it, every chunk is a multiple of its token_multiple
    and the step reaches its crossover; "prefill" otherwise."""
    fn = module.functions.get(TOKEN)
    if fn is None or not chunk_lens:
        return HEAD
    multiple = int(fn.attrs.get("token_multiple", 1))
    if any(n % multiple for n in chunk_lens) or sum(chunk_lens) < int(fn.attrs.get("token_shard_min_tokens", 0)):
        return HEAD
    return TOKEN


def split_for_token_sharding(module: Module, chunk_lens: Sequence[int]) -> list[int]:
    """Per request, the largest prefix length that token-sharded prefill accepts (a multiple of
    token_multiple); the scheduler runs the remainders in a following head-sharded step."""
    fn = module.functions.get(TOKEN)
    multiple = int(fn.attrs.get("token_multiple", 1)) if fn is not None else 1
    return [n - n % multiple for n in chunk_lens]
