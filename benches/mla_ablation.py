"""Where the batch-64 sparse MLA decode's time goes (issue 4's open goal): the ORIENT 3 kernel with parts of it taken
out, timed like bench_mla_b64.py (the whole launcher, 4 input sets a graph, rows from HBM and L2-resident rows).

The ablated kernel is built from the module's own source (`codegen/triton/_mla_gluon.py`) by the edits in EDITS, each
guarded by a bit of a new constexpr ABL, and imported from a temporary file (Triton reads a kernel's source from its
file); an edit that no longer applies stops the bench with its name. Bits:
    1 no value dots (acc x alpha only)      2 no gathers in the loop (the prologue's still run)
    4 no logits dots                        8 one loop step only
   16 no row maximum (the previous max)    32 no P store, fence and barrier
   64 no merge of the pieces (FOLD)
The results are wrong under any bit but 0: only the times mean anything. Also times the absorption launch alone.

    PYTHONPATH=. python3 benches/mla_ablation.py [--rounds 2] [--abl 0,8,15,79,7,23,39,55,71,64,1,17,33,5,4]
One JSON document in $OUT/mla_ablation.json.
"""

from __future__ import annotations

import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from benches._ablate import AblatedLaunch, ablated_module, guard  # noqa: E402
from benches._report import graph_ms  # noqa: E402
from _attention_checks import mla_call, mla_set  # noqa: E402

_LOOP_GATHER = ("        _gather(lat_ptr, _step_rows(rows_s, it + STAGES - 1, STEPS, CP), sb, sr, xk.index(nb), "
                "xp.index(nb), KV, DR,\n                CP, LOG_BS)")
_LOGITS = """        sc = warpgroup_mma(xb, qc.permute((1, 0)), sc, use_acc=False, is_async=True)
        se = warpgroup_mma(xp.index(b), qpc.permute((1, 0)), se, use_acc=False, is_async=True)
        sc, se = warpgroup_mma_wait(0, deps=[sc, se])"""
_VALUE = """        a0 = _value_dot(xb, 0, pb, a0, al, LX, MMA)
        a1 = _value_dot(xb, 1, pb, a1, al, LX, MMA)
        a2 = _value_dot(xb, 2, pb, a2, al, LX, MMA)
        a3 = _value_dot(xb, 3, pb, a3, al, LX, MMA)
        a0, a1, a2, a3 = warpgroup_mma_wait(0, deps=[a0, a1, a2, a3])"""


EDITS = {   # name: (text in the module, its replacement)
    "ABL parameter": ("PS: gl.constexpr, LX: gl.constexpr):",
                      "PS: gl.constexpr, LX: gl.constexpr, ABL: gl.constexpr = 0):"),
    "one step (8)": ("    n = gl.cdiv(end - start, BLOCK_N)\n",
                     "    n = gl.cdiv(end - start, BLOCK_N)\n    if ABL & 8:\n        n = 1\n"),
    "loop gathers (2)": (_LOOP_GATHER, guard(_LOOP_GATHER, 2, "cp.commit_group()")),
    "logits (4)": (_LOGITS, guard(_LOGITS, 4)),
    "row max (16)": ("        m_new = gl.maximum(m_i, gl.max(s, axis=0))",
                     guard("        m_new = gl.maximum(m_i, gl.max(s, axis=0))", 16, "m_new = m_i")),
    "P store (32)": ("""        ps.store(gl.permute(p.to(gl.float16), (1, 0)))
        al = gl.expand_dims(gl.convert_layout(alpha, HV), 0)
        fence_async_shared()
        _barrier()""", """        if ABL & 32 == 0:
            ps.store(gl.permute(p.to(gl.float16), (1, 0)))
        al = gl.expand_dims(gl.convert_layout(alpha, HV), 0)
        if ABL & 32 == 0:
            fence_async_shared()
            _barrier()"""),
    "value (1)": (_VALUE, guard(_VALUE, 1, "a0 = a0 * al")),
    "merge (64)": ("    if FOLD:\n        _barrier()", "    if FOLD and ABL & 64 == 0:\n        _barrier()"),
    "absolute import": ("from ._pdl import pdl_enter", "from codegen.triton._pdl import pdl_enter"),
}


def main():
    from codegen.triton import _mla_gluon
    from codegen.triton._mla_combine import absorb_queries, split_kv_b
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 2
    abls = [int(a) for a in (sys.argv[sys.argv.index("--abl") + 1].split(",") if "--abl" in sys.argv else
                             "0,8,15,79,7,23,39,55,71,64,1,17,33,5,4".split(","))]
    launch = AblatedLaunch(ablated_module(_mla_gluon, EDITS, "mla_ablation")._mla_gluon_kernel)
    _mla_gluon._mla_gluon_kernel = launch     # the launcher's kernel, with the current ABL bits
    import triton
    doc = {"bench": "mla_ablation", "command": " ".join([sys.executable] + sys.argv), "measurements": [],
           "machine": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}}
    o3 = dict(ORIENT=3, BLOCK_H=16, BLOCK_N=64, num_warps=4, PREFETCH=1)
    T = 64
    sets = [mla_set(T, 8192, 2048, 100 + i) for i in range(4)]
    l2 = [dict(sets[0], rows=sets[0]["rows"][:1].expand(T, -1).contiguous())] * 4
    absorb = [lambda d=d: absorb_queries(d["qn"], split_kv_b(d["kvb"], 12, 128)[0], d["qn"].dtype) for d in sets]
    for rnd in range(rounds):
        us = graph_ms(absorb, reps=15) * 1e3
        doc["measurements"].append({"name": "absorb_only", "us": us, "round": rnd})
        print(f"absorb_only round {rnd}: {us:.2f} us", file=sys.stderr, flush=True)
        for name, cfg in (("c1024_s3", dict(o3, CHUNK=1024, num_stages=3)),
                          ("c512_s2", dict(o3, CHUNK=512, num_stages=2))):
            for abl in abls:
                launch.abl = abl
                for rows, ss in (("hbm", sets), ("l2", l2)):
                    if rows == "l2" and abl & 2:     # no loop gathers: the rows' home does not matter
                        continue
                    us = graph_ms([mla_call(d, cfg) for d in ss], reps=15) * 1e3
                    doc["measurements"].append({"name": name, "config": cfg, "abl": abl, "rows": rows, "us": us,
                                                "round": rnd})
                    print(f"{name} ABL {abl:3d} {rows}: {us:.2f} us", file=sys.stderr, flush=True)
        if os.environ.get("OUT"):
            open(os.path.join(os.environ["OUT"], "mla_ablation.json"), "w").write(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
