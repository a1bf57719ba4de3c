"""`k31c tune ARTIFACT --in-graph`: the command around `graph_tune.py` (its arguments, the runtime it times, the
records and artifact configs it writes, its report).

    k31c tune build/h200 --in-graph --batch 1,8,64 --context 8192

Several batch sizes are searched in the order given, on one runtime holding the largest batch's requests; each
searches the (kernel, bucket) sites of its step that no earlier batch's search visited, with the configs the earlier
ones accepted in force (a bucket two batch sizes share is chosen once, by the first).

The step timed is the artifact's single-rank step (its module is the unsharded model; `k31c run --tp/--dcp/--ep`
shards it when serving). One rank's share of a parallel deployment is timed by benches/bench_runtime_gpu.py's rank
preset (`--sections graph_tune`), which runs this search on it."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass

IN_GRAPH_ONLY = ("batch", "context", "rounds", "min_gain_us", "try_", "budget_s", "replays", "passes", "span", "tol")
# what a record's created_by repeats: the flags that change what the search chooses (not how long it may run)
CHOICE_FLAGS = tuple(n for n in IN_GRAPH_ONLY if n not in ("budget_s", "replays"))
KERNEL_ALONE_ONLY = ("bucket", "shapes", "plot", "study_db", "function")


def flag(name: str) -> str:
    """An argparse dest as its flag: "min_gain_us" -> "--min-gain-us", "try_" -> "--try"."""
    return "--" + name.rstrip("_").replace("_", "-")


def add_in_graph_args(p):
    g = p.add_argument_group("in-graph tuning (--in-graph: configs chosen by timing the whole decode step)")
    g.add_argument("--in-graph", action="store_true",
                   help="time the decode step (its CUDA graph on a GPU) per candidate config, not kernels alone")
    g.add_argument("--batch", default=None, metavar="B[,B...]",
                   help="requests in the timed step; several: searched in this order (default 1)")
    g.add_argument("--context", type=int, default=None, help="tokens each request holds (default 8192)")
    g.add_argument("--rounds", type=int, default=None, help="confirming (incumbent, candidate) pairs (default 4)")
    g.add_argument("--min-gain-us", type=float, default=None, help="step time a change must save (default 1.0)")
    g.add_argument("--try", dest="try_", default=None, metavar="JSON",
                   help='configs to try besides the neighbours, e.g. \'{"moe_latent_tail": [{"G_warps": 8}]}\'')
    g.add_argument("--budget-s", type=float, default=None, help="no new candidate after this (default 900)")
    g.add_argument("--replays", type=int, default=None, help="timed graph replays per measurement (default 30)")
    g.add_argument("--passes", type=int, default=None, help="coordinate-descent passes over the sites (default 1)")
    g.add_argument("--span", type=int, default=None,
                   help="steps along a tunable's value list a candidate may move (default 1; 0: the whole list)")
    g.add_argument("--tol", type=float, default=None,
                   help="largest relative L2 error of the step's logits vs the start's (default 1e-2 bf16, 1e-4)")


def problems(args) -> list[str]:
    """Usage problems of the --in-graph flags (all of them, together)."""
    out = []
    if not args.in_graph:
        given = [n for n in IN_GRAPH_ONLY if getattr(args, n) is not None]
        return [f"{flag(n)} applies to --in-graph tuning only" for n in given]
    for n in KERNEL_ALONE_ONLY:
        if getattr(args, n):
            out.append(f"{flag(n)} applies to kernel-alone tuning, not --in-graph")
    if args.batch is not None:
        try:
            batches_of(args.batch)
        except ValueError as e:
            out.append(str(e))
    for n, lo in (("context", 1), ("rounds", 1), ("replays", 1), ("passes", 1), ("span", 0)):
        v = getattr(args, n)
        if v is not None and v < lo:
            out.append(f"{flag(n)} must be >= {lo}, found {v}")
    for n in ("min_gain_us", "budget_s", "tol"):
        v = getattr(args, n)
        if v is not None and not v > 0:
            out.append(f"{flag(n)} must be positive, found {v}")
    if args.try_ is not None:
        try:
            tries = parse_tries(args.try_)
        except ValueError as e:
            out.append(str(e))
        else:
            if args.kernel and set(tries) - set(args.kernel):
                out.append(f"--try names families outside --kernel: {sorted(set(tries) - set(args.kernel))}")
    return out


def parse_tries(text: str) -> dict:
    """--try's JSON: family -> a config override or a list of them."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--try is not valid JSON ({e.msg}): {text!r}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"--try must be a JSON object of family -> override(s), found {text!r}")
    out = {}
    for fam, v in obj.items():
        items = [v] if isinstance(v, dict) else v
        if not isinstance(items, list) or not all(isinstance(o, dict) and o for o in items):
            raise ValueError(f"--try {fam!r}: expected a config override or a list of them (non-empty JSON "
                             f"objects), found {json.dumps(v)}")
        out[fam] = items
    return out


@dataclass
class Accepted:
    """An accepted bucket, shaped as `tune_cli.update_artifact` reads a tuning result."""
    family: str
    bid: str
    key: dict
    config: dict
    op: str
    record: object
    step_us: float

    def to_json(self) -> dict:
        return {"family": self.family, "bucket_id": self.bid, "key": self.key, "config": self.config,
                "op": self.op, "record": self.record.key, "in_graph_step_us": self.step_us}


def step_runtime(art, path: str, *, batch: int, context: int, store, seed: int = 0):
    """The runtime of the artifact's decode step: `batch` requests at `context` tokens over random cache rows
    (`graph_tune.fill_random`); configs resolve as `k31c run` resolves them (the artifact's tuned configs, then the
    store's records, then the declared heuristics), and the runtime replays CUDA graphs on cuda. A
    `graph_tune.StepTimer(rt, b, vocab)` times the step of its first b <= batch requests."""
    import torch

    from k31c.cli import UsageError
    from k31c.cli_serve import _tuned_configs
    from k31c.runtime.cuda_graphs import GraphedRuntime
    from k31c.runtime.executor import Executor
    from k31c.runtime.reference import RequestError

    from . import graph_tune as gt
    from .policy import MissPolicy

    device = "cuda" if torch.cuda.is_available() else "cpu"
    target = art.manifest["target"]["name"]
    eng = Executor(art.module, art.weights, art.choices, target=target, configs=_tuned_configs(art),
                   batch_invariant=art.manifest["options"].get("batch_invariant", False),
                   compute_dtype=torch.bfloat16 if device == "cuda" else torch.float32, device=device,
                   tuning=MissPolicy("fallback", store, target=target), cuda_graphs=True)
    rt = GraphedRuntime(art.module, art.weights, max_rows=batch * (context + 8), max_requests=batch, engine=eng)
    try:
        gt.fill_random(rt, {f"r{i}": (context, context + 8) for i in range(batch)}, seed=seed + 1)
    except RequestError as e:
        raise UsageError([f"--context {context} / --batch {batch}: {e}"]) from None
    return rt


def batches_of(text: str | None) -> list[int]:
    """--batch: "1" or "1,8,64" (default 1)."""
    try:
        out = [int(b) for b in (text or "1").split(",")]
    except ValueError:
        raise ValueError(f"--batch must be batch sizes separated by commas, e.g. 1,8, found {text!r}") from None
    if not out or min(out) < 1:
        raise ValueError(f"--batch sizes must be >= 1, found {text!r}")
    return out


def run(args, path: str, update: bool, command: str) -> int:
    """Build the runtime over the artifact at `path`; per batch of --batch (in order), search the step's sites that
    no earlier batch's search visited (the configs it accepted are in force), write the records (and, with
    `update`, the artifact's configs); report. Returns the exit status."""
    from k31c.cli import UsageError
    from k31c.compiler import artifact_config, load_artifact

    from . import graph_tune as gt
    from .records import CacheStore, Environment
    from .tune_cli import update_artifact

    art = load_artifact(path)
    if art.weights is None:
        raise UsageError([f"artifact {path} has no weights (compiled from a config alone): --in-graph runs its "
                          f"decode step; compile from a checkpoint or a preset"])
    known = {c.template.family for c in art.choices if c.template is not None}
    if set(args.kernel) - known:
        raise UsageError([f"--kernel {f}: the artifact uses no kernel of that family (it uses "
                          f"{', '.join(sorted(known))})" for f in sorted(set(args.kernel) - known)])
    batches, context = batches_of(args.batch), args.context or 8192
    store = CacheStore(args.store) if args.store else CacheStore()
    rt = step_runtime(art, path, batch=max(batches), context=context, store=store, seed=args.seed)
    t0 = time.perf_counter()
    ctx = {"args": args, "target": art.manifest["target"]["name"], "env": Environment.current(), "rt": rt,
           "vocab": artifact_config(path).vocab_size, "context": context, "deadline": t0 + (args.budget_s or 900),
           "say": gt.say_to(quiet=args.no_progress), "store": store, "command": command, "path": path,
           "tries": parse_tries(args.try_) if args.try_ else {}}
    results, visited = [], set()
    for b in batches:
        res = _tune_batch(b, visited, ctx)
        results.append(res)
        visited |= {s.bid for s in res["sites"]}
        rt.interp.configs.update({a.bid: a.config for a in res["accepted"]})  # in force for the next batch
        if update and res["accepted"]:
            update_artifact(path, res["accepted"])
    if not any(r["sites"] for r in results):
        print("k31c tune --in-graph: the step launches no tunable kernel of --kernel", file=sys.stderr)
        return 1
    _report(args, results, context, time.perf_counter() - t0)
    return 0


def _tune_batch(batch: int, visited: set, ctx: dict) -> dict:
    """One batch size's search (module doc of graph_tune.py); its records go to the store."""
    from . import graph_tune as gt

    args, rt = ctx["args"], ctx["rt"]
    timer = gt.StepTimer(rt, batch, ctx["vocab"], replays=args.replays or 30)
    tries = ctx["tries"]
    sites = gt.tunable_sites(timer, kernels=args.kernel, tries=tries, skip=visited)
    how = "CUDA graph replays" if rt.use_graphs else "eager steps (no CUDA graphs here)"
    out = {"batch": batch, "sites": sites, "trials": [], "accepted": [], "final": None, "timed_as": how}
    if not sites:
        return out
    ctx["say"](f"k31c tune --in-graph: {ctx['path']} (target {ctx['target']}) on {ctx['env'].device}: batch {batch}, "
               f"context {ctx['context']}, {len(sites)} sites, timed as {how}; store {ctx['store'].path}")
    measure = gt.timed_measure(timer)
    rounds = args.rounds or 4
    chosen, out["trials"] = gt.search(
        sites, measure, target=ctx["target"], tries=tries, rounds=rounds,
        launch_tries=gt.LAUNCH_TRIES if gt.pdl_launches(rt) else (), min_gain_us=args.min_gain_us or 1.0,
        tol=args.tol or (1e-2 if rt.device.type == "cuda" else 1e-4), passes=args.passes or 1,
        span=1 if args.span is None else args.span, deadline=ctx["deadline"], say=ctx["say"])
    out["final"] = gt.final(measure, chosen, rounds) if chosen else None
    records = gt.records_for(sites, chosen, out["trials"], created_by=ctx["command"][:500], env=ctx["env"])
    ctx["store"].put_many(records)
    by_bid = {s.bid: s for s in sites}
    out["accepted"] = [Accepted(by_bid[bid].family, bid, by_bid[bid].key, cfg, by_bid[bid].op, rec, rec.median_us)
                       for (bid, cfg), rec in zip(chosen.items(), records)]
    return out


def _report(args, results: list, context: int, seconds: float):
    for res in results:
        for a in res["accepted"]:
            print(f"{a.bid}: {json.dumps(a.config, sort_keys=True)} (batch {res['batch']}: step {a.step_us:.1f} us "
                  f"with it)")
        line = (f"k31c tune --in-graph: batch {res['batch']}: {len(res['trials'])} candidates at {len(res['sites'])} "
                f"sites, {len(res['accepted'])} accepted")
        if res["final"]:
            fin = res["final"]
            line += f"; the step {fin['start_median_us']:.1f} -> {fin['tuned_median_us']:.1f} us ({res['timed_as']})"
        print(line)
    print(f"k31c tune --in-graph: {seconds:.0f} s")
    if args.json:
        doc = {"context": context, "seconds": seconds, "batches": [
            {"batch": r["batch"], "timed_as": r["timed_as"], "final": r["final"],
             "sites": [{"bid": s.bid, "family": s.family, "config": s.config, "launches": s.launches}
                       for s in r["sites"]],
             "trials": [t.to_json() for t in r["trials"]], "accepted": [a.to_json() for a in r["accepted"]]}
            for r in results]}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1, sort_keys=True, default=str)
