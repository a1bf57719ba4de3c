"""Tuning bench: `k31c tune` on a k31-tiny artifact of this machine's target, per kernel tuned vs default.

    python benches/bench_tuning.py [--function decode] [--trials 4] [--budget-s 90] [--store FILE]

One JSON document (stdout and $OUT/tuning.json): machine, versions, command; per (kernel, bucket): the
tuned and the default (declared heuristic) config re-measured side by side (median, spread, ratio
default/tuned), tuning time, trials / rejected / timed out, the IR's bytes and flops at that bucket,
achieved bandwidth, the floor max(bytes / bandwidth, flops / peak) from the measured ceilings and the
ratio of the tuned time to it, and the torch eager reference of the same node (the peer; fused nodes
have none). Then one end-to-end decode step of the artifact (Executor, CUDA graphs off) with the
compile-time configs vs the tuned ones. Records go to --store (default $OUT/<device>.jsonl, else
autotune_cache/records/<device>.jsonl); study PNGs and ceilings.png to $OUT/tuning_plots.tar.gz.

On a GPU: kernels are compiled and timed with the compute dtype bf16; each timing is one pass of
launches over 4 rotated operand sets between CUDA events (tiny shapes: the launch overhead of the
Python launcher dominates, as it does in the runtime).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tarfile
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from benches._report import BenchReport  # noqa: E402


def _args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="k31-tiny",
                    help="preset or checkpoint; 'rank': the runtime bench's one-rank share of k31-pro "
                         "(benches/bench_runtime_gpu.py) with random weights drawn on the device")
    ap.add_argument("--shapes", default=None, metavar="JSON",
                    help='capture step shapes, e.g. \'{"decode": {"R": 1}}\' (default: compile\'s)')
    ap.add_argument("--function", action="append", default=None, help="entry functions to tune (default decode)")
    ap.add_argument("--kernel", action="append", default=[])
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--timeout-s", type=float, default=30.0)
    ap.add_argument("--budget-s", type=float, default=90.0,
                    help="no new study starts this many seconds after the capture")
    ap.add_argument("--store", default=None)
    ap.add_argument("--no-e2e", action="store_true")
    ap.add_argument("--e2e-after-s", type=float, default=130.0,
                    help="skip the end-to-end step when the bench has already run this long")
    return ap.parse_args()


def _round_robin(probs):
    """One study per family first, so a budget that runs out still covers every family."""
    by = {}
    for p in probs:
        by.setdefault(p.template.family, []).append(p)
    out, queues = [], list(by.values())
    while any(queues):
        for q in queues:
            if q:
                out.append(q.pop(0))
    return out


def main():
    a = _args()
    rep = BenchReport("tuning")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target = "h200" if device == "cuda" else "cpu"
    from autotune_cache.records import Environment, default_store_path
    from autotune_cache.plot import ceilings

    env = Environment.current()
    out_dir = os.environ.get("OUT")
    store = a.store or (os.path.join(out_dir, f"{env.slug}.jsonl") if out_dir else default_store_path())
    import triton

    rep.doc["machine"] = {"device": env.device, "arch": env.arch, "torch": torch.__version__,
                          "triton": triton.__version__, "cuda": env.cuda, "k31c": env.k31c_version,
                          "target": target, "store": store}
    rep.doc["ceilings"] = ceil = ceilings(target, device)
    work = tempfile.mkdtemp(prefix="bench-tuning-")
    art = os.path.join(work, "artifact")
    plots = os.path.join(work, "plots")
    state = {}

    @rep.section
    def compile_artifact():
        from k31c.cli import main as k31c_main

        t = time.perf_counter()
        if a.model == "rank":
            _compile_rank(art, target, device)
        else:
            assert k31c_main(["compile", "--model", a.model, "--target", target, "-o", art]) == 0
        rep.doc["notes"].append(f"compiled {a.model} for {target} in {time.perf_counter() - t:.1f} s")
        import json

        state["default_configs"] = {k: v["config"] for k, v in
                                    json.load(open(os.path.join(art, "kernels", "configs.json"))).items()}

    @rep.section
    def tune():
        from types import SimpleNamespace

        from autotune_cache.tune_cli import run_tune

        args = SimpleNamespace(artifact=art, target=None, model=a.model, store=store,
                               function=a.function or ["decode"], kernel=a.kernel, bucket=None,
                               shapes=a.shapes, trials=a.trials, timeout_s=a.timeout_s, repeats=None, study_db=None,
                               plot=plots, seed=0, json=None, no_progress=False)
        results, probs = run_tune(args, art, True, device, order=_round_robin, budget_s=a.budget_s)
        state["probs"] = {p.bid: p for p in probs or []}
        for r in results:
            rep.doc["measurements"].append(_row(r, state["probs"].get(r.bid), ceil, device))
        rep.doc["notes"].append(f"{len(results)} of {len(probs or [])} studies tuned; records in {store}")

    @rep.section
    def end_to_end_decode():
        if a.no_e2e or device != "cuda" or time.time() - rep.t0 > a.e2e_after_s:
            rep.doc["notes"].append("end-to-end decode step skipped (--no-e2e, no GPU: the interpreter takes "
                                    "minutes per step, or past --e2e-after-s)")
            return
        import json

        tuned = {k: v["config"] for k, v in json.load(open(os.path.join(art, "kernels", "configs.json"))).items()}
        default = state["default_configs"]
        for label, cfgs in (("default", default), ("tuned", tuned), ("default", default)):  # default twice: drift
            ms = _decode_step_ms(art, cfgs, device)
            rep.doc["measurements"].append({"name": f"e2e decode step ({label} configs)", "median_ms": ms})

    compile_artifact()
    tune()
    if os.path.isdir(plots) and out_dir:
        with tarfile.open(os.path.join(out_dir, "tuning_plots.tar.gz"), "w:gz") as tf:
            tf.add(plots, arcname="tuning_plots")
    end_to_end_decode()
    rep.save()
    for m in rep.doc["measurements"]:
        if "bucket_id" in m:
            print(f"{m['bucket_id'][:70]:<70} tuned {m['median_us']:9.2f} us  default {m['default_us']:9.2f} us  "
                  f"x{m['ratio_default_over_tuned']:.2f}  floor x{m['ratio_vs_floor'] or 0:.0f}  "
                  f"peer {m['peer_reference_us'] or 0:.1f} us  tune {m['tuning_s']:.1f}s")
        else:
            print(m)
    print(f"errors: {[e['section'] + ': ' + e['error'] for e in rep.doc['errors']]}")
    shutil.rmtree(work, ignore_errors=True)


def _row(r, prob, ceil, device) -> dict:
    floor_s = max((r.bytes or 0) / ceil["bandwidth"], (r.flops or 0) / ceil["flops"]) or None
    row = {**r.to_json(), "name": f"{r.family} tuned", "ratio_default_over_tuned": r.speedup,
           "achieved_GBps": (r.bytes / (r.median_us * 1e-6) / 1e9) if r.bytes else None,
           "floor_us": floor_s * 1e6 if floor_s else None,
           "ratio_vs_floor": (r.median_us * 1e-6 / floor_s) if floor_s else None, "peer_reference_us": None}
    if prob is not None:
        try:
            row["peer_reference_us"] = _reference_us(prob, device)
        except Exception as e:  # the peer is optional: report why it is missing
            row["peer_error"] = f"{type(e).__name__}: {e}"
    return row


def _reference_us(prob, device) -> float | None:
    """The torch eager reference of the node on operand set 0 (registered ops only)."""
    from ir.ops import OPS

    op = OPS.get(prob.node.op)
    if op is None or prob.node.body is not None:
        return None
    attrs = {k: v for k, v in prob.attrs.items() if k != "batch_invariant"}
    args = [x.clone() if isinstance(x, torch.Tensor) else x for x in prob.sets[0].ref_args]
    fn = lambda: op.reference(op.bind(args), attrs)  # noqa: E731
    fn()
    times = []
    for _ in range(20):
        if device == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) * 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times)


def _compile_rank(art: str, target: str, device: str):
    """The runtime bench's rank preset compiled with its random weights (drawn on the device) stored."""
    import json

    from benches.bench_runtime_gpu import device_weights, rank_config
    from k31c.compiler import CompileOptions, compile_model
    from k31c.plan import plan_options

    cfg = rank_config()
    d = tempfile.mkdtemp()
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg.to_hf(), f)
    compile_model(cfg, device_weights(cfg, device), art, CompileOptions(plan=plan_options(d, target=target)),
                  model_source="bench rank preset")


def _decode_step_ms(path: str, configs: dict, device: str) -> float:
    """Median wall time of a decode step of 8 requests (sync'd), after a reference prefill of 16 tokens each."""
    import random

    from ir.interpreter import Interpreter
    from k31c.compiler import load_artifact
    from k31c.runtime.executor import Executor
    from k31c.runtime.reference import ReferenceRuntime

    art = load_artifact(path)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    # the prefill runs in the fp32 reference (its bf16 path cannot run the KDA chunked form on CUDA);
    # the executor's first decode step copies the pools into its own dtypes (Interpreter.run)
    rt = ReferenceRuntime(art.module, art.weights, max_rows=4096, max_requests=8,
                          engine=Interpreter(art.module, art.weights, torch.float32, device))
    rng = random.Random(0)
    for r in range(8):
        rt.add_request(f"r{r}", 64)
    rt.prefill({f"r{r}": [rng.randrange(rt.vocab_size) for _ in range(16)] for r in range(8)})
    rt.interp = Executor(art.module, art.weights, art.choices, target=art.manifest["target"]["name"],
                         configs=configs, compute_dtype=dtype, device=device)
    times = []
    for i in range(8 if device == "cuda" else 2):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        rt.decode({f"r{r}": rng.randrange(rt.vocab_size) for r in range(8)})
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= 2 or device != "cuda":  # the first steps compile the kernels
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


if __name__ == "__main__":
    main()
