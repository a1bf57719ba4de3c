"""The serving engine on CPU (reference interpreter, fp32): what prefix caching saves on shared prompts.

    PYTHONPATH=. python benches/bench_engine_cpu.py [--requests 8] [--shared 48] [--unique 8] [--new 4]

A 4-layer hybrid model (KDA + MLA with indexer, k31-tiny widths), paged in blocks of 16 rows. Every request
is one shared system prompt plus its own tokens; they arrive together and run `max_num_seqs` at a time. Runs
with prefix caching off and on (same tokens required), and reports wall time, engine steps, tokens computed,
and the cache's hit rates per kind (latent pages, index keys, KDA state, reused tokens). The peer is the same
engine without the cache in the same process. Writes $OUT/engine_cpu.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benches._report import BenchReport  # noqa: E402
from k31c.model.build import BuildOptions, build_module  # noqa: E402
from k31c.model.init_weights import random_weights  # noqa: E402
from k31c.model.presets import get_preset  # noqa: E402
from k31c.runtime.engine import Engine  # noqa: E402
from k31c.runtime.reference import ReferenceRuntime  # noqa: E402
from k31c.runtime.sampling import SamplingParams  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--shared", type=int, default=48)
    ap.add_argument("--unique", type=int, default=8)
    ap.add_argument("--new", type=int, default=4)
    ap.add_argument("--max-num-seqs", type=int, default=2)
    args = ap.parse_args()
    rep = BenchReport("engine_cpu")
    rep.doc["machine"] = {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                          "torch": torch.__version__, "python": platform.python_version()}
    cfg = dataclasses.replace(get_preset("k31-tiny"), name="engine-bench", num_hidden_layers=4, full_attn_layers=(1, 3))
    module, weights = build_module(cfg, BuildOptions(block_size=16)), random_weights(cfg, 0)
    g = torch.Generator().manual_seed(0)
    system = torch.randint(0, 256, (args.shared,), generator=g).tolist()
    prompts = [system + torch.randint(0, 256, (args.unique,), generator=g).tolist() for _ in range(args.requests)]
    tokens = {}

    @rep.section
    def run(prefix_caching: bool):
        rt = ReferenceRuntime(module, weights, max_rows=args.max_num_seqs * (args.shared + args.unique + args.new),
                              max_requests=args.max_num_seqs)
        eng = Engine(rt, max_num_seqs=args.max_num_seqs, prefix_caching=prefix_caching)
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, SamplingParams(max_new_tokens=args.new))
        t = time.perf_counter()
        final = eng.run_to_completion()
        dt = time.perf_counter() - t
        tokens[prefix_caching] = {rid: o.tokens for rid, o in final.items()}
        st = eng.stats()
        m = {"name": f"engine prefix_caching={prefix_caching}", "wall_s": round(dt, 3), "steps": st["steps"],
             "tokens_computed": st["tokens_computed"], "prompt_tokens": sum(map(len, prompts)),
             "generated_tokens": args.requests * args.new, "prefix_cache": st.get("prefix_cache")}
        rep.doc["measurements"].append(m)
        print(m, flush=True)

    run(False)
    run(True)
    if len(tokens) == 2:
        same = tokens[False] == tokens[True]
        off, on = rep.doc["measurements"][0], rep.doc["measurements"][1]
        rep.doc["summary"] = {"same_tokens": same, "wall_ratio_off_over_on": round(off["wall_s"] / on["wall_s"], 3),
                              "tokens_computed_ratio_on_over_off":
                                  round(on["tokens_computed"] / off["tokens_computed"], 3)}
        print(rep.doc["summary"])
    print(rep.save()[-300:] if os.environ.get("OUT") else "")


if __name__ == "__main__":
    main()
