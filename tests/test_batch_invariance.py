"""Batch-invariant mode: a request's logits alone and inside a batch of 5 other random requests are
bitwise equal (prefill with ragged chunks, then decode steps). Without the mode they are not (library
GEMMs block by problem size), which shows the test can fail."""

from __future__ import annotations

import torch

from k31c.runtime.executor import Executor
from k31c.runtime.reference import ReferenceRuntime


def _run(tiny, batch_invariant: bool, others: int):
    cfg, module, weights = tiny("k31-tiny")
    engine = Executor(module, weights, [], batch_invariant=batch_invariant)
    rt = ReferenceRuntime(module, weights, max_rows=1024, max_requests=8, engine=engine)
    g = torch.Generator().manual_seed(11)
    mine = torch.randint(0, cfg.vocab_size, (20,), generator=g).tolist()  # > index_topk: sparse
    rt.add_request("me", 40)
    chunks = {"me": mine}
    for i in range(others):
        n = int(torch.randint(3, 10, (1,), generator=g))
        rt.add_request(f"o{i}", 40)
        chunks[f"o{i}"] = torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()
    first = rt.prefill(chunks)[:20]  # "me" is the first request: its rows come first
    rows = [first]
    for step in range(2):
        toks = {rid: (7 * step + i) % cfg.vocab_size for i, rid in enumerate(chunks)}
        rows.append(rt.decode(toks)[:1])
    return torch.cat(rows)


def test_logits_alone_and_in_a_batch_are_bitwise_equal(tiny):
    alone = _run(tiny, True, 0)
    batched = _run(tiny, True, 5)
    assert torch.isfinite(alone).all()
    assert torch.equal(alone, batched)


def test_default_mode_is_not_batch_invariant(tiny):
    alone = _run(tiny, False, 0)
    batched = _run(tiny, False, 5)
    assert not torch.equal(alone, batched)  # the property above is not vacuous
    assert (alone - batched).abs().max() < 1e-3
