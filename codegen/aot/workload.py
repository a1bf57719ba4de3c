"""The steps an AOT build records (and a GPU check replays): scenarios of prefill / decode / verify.

A scenario is {prompts: [prompt lengths of concurrent requests], decode: decode steps (every request
one token each), verify: draft tokens per request verified once (0: none)}. Token ids are drawn from a
generator seeded by (seed, scenario index), so a build and a later run see the same tokens.

Triton specialises integer arguments equal to 1 or divisible by 16 (and pointers aligned to 16 bytes),
so the default covers token counts that are 1, odd, and multiples of 16, with one and two requests.
"""

from __future__ import annotations

import torch

DEFAULT_WORKLOAD = (
    {"prompts": [5], "decode": 3, "verify": 0},        # one request: odd prefill, decode R=1
    {"prompts": [16, 7], "decode": 2, "verify": 3},    # two requests: T=23 prefill, decode R=2, verify
    {"prompts": [32], "decode": 1, "verify": 4},       # a multiple-of-16 prefill, verify T=4
    {"prompts": [1], "decode": 1, "verify": 0},        # T=1 prefill (integers equal to 1 become constexprs)
)


def check_scenario(sc) -> list[str]:
    p = []
    if not isinstance(sc, dict) or set(sc) - {"prompts", "decode", "verify"}:
        return [f"scenario {sc!r} must be an object with keys prompts, decode, verify"]
    prompts = sc.get("prompts", [])
    if not prompts or not all(isinstance(n, int) and n > 0 for n in prompts):
        p.append(f"scenario {sc}: prompts must be a non-empty list of positive lengths")
    for k in ("decode", "verify"):
        if not isinstance(sc.get(k, 0), int) or sc.get(k, 0) < 0:
            p.append(f"scenario {sc}: {k} must be a non-negative integer")
    return p


def run_scenario(module, weights, engine, sc: dict, index: int, seed: int = 0) -> list[torch.Tensor]:
    """Run one scenario through `engine` (an Executor); the logits of every step, in order."""
    from k31c.runtime.reference import ReferenceRuntime

    prompts = [int(n) for n in sc["prompts"]]
    steps, draft = int(sc.get("decode", 0)), int(sc.get("verify", 0))
    cap = max(prompts) + steps + draft + 1
    rt = ReferenceRuntime(module, weights, max_rows=max(64, 2 * cap * len(prompts)), max_requests=len(prompts),
                          engine=engine)
    g = torch.Generator().manual_seed(1000 * seed + index)
    names = [f"r{i}" for i in range(len(prompts))]
    for n in names:
        rt.add_request(n, cap)

    def tok(k):
        return torch.randint(1, rt.vocab_size, (k,), generator=g).tolist()

    out = [rt.prefill({n: tok(p) for n, p in zip(names, prompts)})]
    for _ in range(steps):
        out.append(rt.decode({n: tok(1)[0] for n in names}))
    if draft:
        out.append(rt.verify({n: tok(draft) for n in names}))
    return out
