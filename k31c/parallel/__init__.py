"""Collective building blocks for TP / token-sharded prefill / DCP (DESIGN §5 T3–T4, issue 8).

Everything moves through torch.distributed (NCCL on GPU, gloo on CPU).
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
