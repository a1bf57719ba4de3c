"""Collective building blocks for TP / token-sharded prefill / DCP (DESIGN §5 T3–T4, issue 8).

Everything moves through torch.distributed (NCCL on GPU, gloo on CPU).

Modules: groups (the TP / DCP / EP process groups: DCP and EP groups are runs of consecutive TP ranks,
built once per run), dcp_topk (exact one-round global top-k), lse_combine, token_shard (causal-balanced
pieces and the head<->token all-to-alls), dcp_attention (the DCP ops' references: sparse and dense MLA,
the merge-free workspace), weights (per-rank shards from the params' sharding attrs), prefill_choice
(head- or token-sharded prefill per step), serving (layout checks, per-rank DCP cache rows, rank 0
schedules, the other ranks replay), launch (`--tp/--dcp/--ep`, spawn or torchrun, failure handling).
The passes that insert the collectives: passes/shard_tp.py, shard_ep.py, shard_tokens.py, shard_dcp.py.
"""

from .dcp_topk import (TopKResult, candidates_per_rank, dcp_topk, global_positions, local_count,
                       order_keys, shard_scores)
from .lse_combine import combine_partials, lse_combine
from .token_shard import (causal_balance_indices, causal_balance_pieces, heads_to_tokens,
                          tokens_to_heads)

__all__ = [
    "TopKResult", "candidates_per_rank", "dcp_topk", "global_positions", "local_count", "order_keys",
    "shard_scores", "combine_partials", "lse_combine", "causal_balance_indices",
    "causal_balance_pieces", "heads_to_tokens", "tokens_to_heads",
]
