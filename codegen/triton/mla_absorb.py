"""`mla_absorb` (passes/query_absorption.py): q~^h = W_UK^h^T q_nope^h for every token and head, the absorbed MLA's
query side as its own node, so that it runs beside the indexer. One launch of `_mla_combine._absorb_kernel` (fp32
accumulation, the result in q_nope's dtype): the same kernel, arguments and bits as the absorption that
`mla_sparse` runs inside an `mla_attention` without q_absorbed (with the heuristic's config, `absorb_config`).
Tunables: BLOCK_T tokens x BLOCK_K latent columns a program, num_warps."""

from __future__ import annotations

from codegen.kernel import KernelTemplate, Tunable, pow2_bucket
from ._mla_combine import absorb_config, absorb_queries, split_kv_b


def _launch(a, attrs, config):
    T, H, dn = a.q_nope.shape
    return absorb_queries(a.q_nope, split_kv_b(a.kv_b, H, dn)[0], a.q_nope.dtype, config)


def _key(a, attrs) -> dict:
    T = a.q_nope.shape[0]
    return {"T": int(T) if hasattr(T, "__index__") else 0, "H": int(a.q_nope.shape[1]),
            "DN": int(a.q_nope.shape[2]), "KV": int(a.kv_b.shape[1])}


def _supports(a, attrs, target) -> str | None:
    try:
        dn, kv = int(a.q_nope.shape[2]), int(a.kv_b.shape[1])
    except TypeError:
        return "head dims are not concrete integers"
    if kv % 32:
        return f"kv_lora_rank {kv} is not a multiple of 32"
    return None  # (dn not a power of two >= 16: absorb_queries computes it as an einsum)


def _constraints(config: dict, key: dict, target: str) -> list[str]:
    if key["KV"] % config["BLOCK_K"]:
        return [f"BLOCK_K={config['BLOCK_K']} does not divide kv_lora_rank {key['KV']}"]
    return []


TEMPLATES = [
    KernelTemplate(family="mla_absorb", backend="triton", ops=("mla_absorb",), launch=_launch, key_dims=_key,
                   heuristic=lambda key, target: absorb_config(key["KV"]),
                   tunables=(Tunable("BLOCK_T", (16, 32, 64)), Tunable("BLOCK_K", (32, 64, 128, 256)),
                             Tunable("num_warps", (2, 4, 8))),
                   bucket=lambda key: dict(key, T=pow2_bucket(key["T"])), constraints=_constraints,
                   supports=_supports, batch_invariant=True,
                   doc="absorbed MLA query q~ = W_UK^T q_nope (one launch, fp32 accumulation)"),
]
