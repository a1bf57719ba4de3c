"""`k31c tune ARTIFACT --in-graph`: the command around `graph_tune.py` (its arguments, the runtime it times, the
records and artifact configs it writes, its report)."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass

IN_GRAPH_ONLY = ("batch", "context", "rounds", "min_gain_us", "try_", "budget_s", "replays", "passes", "span", "tol")
KERNEL_ALONE_ONLY = ("bucket", "shapes", "plot", "study_db", "function")


def add_in_graph_args(p):
    g = p.add_argument_group("in-graph tuning (--in-graph: configs chosen by timing the whole decode step)")
    g.add_argument("--in-graph", action="store_true",
                   help="time the decode step (its CUDA graph on a GPU) per candidate config, not kernels alone")
    g.add_argument("--batch", type=int, default=None, help="requests in the timed step (default 1)")
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
        return [f"--{n.rstrip('_').replace('_', '-')} applies to --in-graph tuning only" for n in given]
    for n in KERNEL_ALONE_ONLY:
        if getattr(args, n):
            out.append(f"--{n.replace('_', '-')} applies to kernel-alone tuning, not --in-graph")
    for n, lo in (("batch", 1), ("context", 1), ("rounds", 1), ("replays", 1), ("passes", 1), ("span", 0)):
        v = getattr(args, n)
        if v is not None and v < lo:
            out.append(f"--{n} must be >= {lo}, found {v}")
    for n in ("min_gain_us", "budget_s", "tol"):
        v = getattr(args, n)
        if v is not None and not v > 0:
            out.append(f"--{n.replace('_', '-')} must be positive, found {v}")
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


def step_runtime(art, path: str, *, batch: int, context: int, store, seed: int = 0, replays: int = 30):
    """(runtime, StepTimer) of the artifact's decode step: `batch` requests at `context` tokens over random cache
    rows (`graph_tune.fill_random`); configs resolve as `k31c run` resolves them (the artifact's tuned configs,
    then the store's records, then the declared heuristics), and the runtime replays CUDA graphs on cuda."""
    import torch

    from k31c.cli import UsageError
    from k31c.cli_serve import _tuned_configs
    from k31c.compiler import artifact_config
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
    return rt, gt.StepTimer(rt, batch, artifact_config(path).vocab_size, replays=replays)


def run(args, path: str, update: bool, command: str) -> int:
    """Build the runtime over the artifact at `path`, search, write the records (and, with `update`, the
    artifact's configs), report. Returns the exit status."""
    from k31c.cli import UsageError
    from k31c.compiler import load_artifact

    from . import graph_tune as gt
    from .records import CacheStore, Environment
    from .tune_cli import update_artifact

    art = load_artifact(path)
    if art.weights is None:
        raise UsageError([f"artifact {path} has no weights (compiled from a config alone): --in-graph runs its "
                          f"decode step; compile from a checkpoint or a preset"])
    target = art.manifest["target"]["name"]
    batch, context = args.batch or 1, args.context or 8192
    known = {c.template.family for c in art.choices if c.template is not None}
    if set(args.kernel) - known:
        raise UsageError([f"--kernel {f}: the artifact uses no kernel of that family (it uses "
                          f"{', '.join(sorted(known))})" for f in sorted(set(args.kernel) - known)])
    store = CacheStore(args.store) if args.store else CacheStore()
    env = Environment.current()
    say = gt.say_to(quiet=args.no_progress)
    rt, timer = step_runtime(art, path, batch=batch, context=context, store=store, seed=args.seed,
                             replays=args.replays or 30)
    t0 = time.perf_counter()
    sites = gt.step_sites(timer.launches({}))
    tries = parse_tries(args.try_) if args.try_ else {}
    sites = [s for s in sites if (not args.kernel or s.family in args.kernel)
             and (s.template.tunables or s.family in tries)]
    if not sites:
        print("k31c tune --in-graph: the step launches no tunable kernel of --kernel", file=sys.stderr)
        return 1
    how = "CUDA graph replays" if rt.use_graphs else "eager steps (no CUDA graphs here)"
    say(f"k31c tune --in-graph: {path} (target {target}) on {env.device}: batch {batch}, context {context}, "
        f"{len(sites)} sites, timed as {how}; store {store.path}")
    measure = gt.timed_measure(timer)
    rounds = args.rounds or 4
    tol = args.tol or (1e-2 if rt.device.type == "cuda" else 1e-4)
    chosen, trials = gt.search(sites, measure, target=target, tries=tries, rounds=rounds,
                               launch_tries=gt.LAUNCH_TRIES if gt.pdl_launches(rt) else (),
                               min_gain_us=args.min_gain_us or 1.0, tol=tol, passes=args.passes or 1,
                               span=1 if args.span is None else args.span,
                               deadline=t0 + (args.budget_s or 900), say=say)
    fin = gt.final(measure, chosen, rounds) if chosen else None
    records = gt.records_for(sites, chosen, trials, created_by=command[:500], env=env)
    store.put_many(records)
    by_bid = {s.bid: s for s in sites}
    accepted = [Accepted(by_bid[bid].family, bid, by_bid[bid].key, cfg, by_bid[bid].op, rec, rec.median_us)
                for (bid, cfg), rec in zip(chosen.items(), records)]
    if update and accepted:
        update_artifact(path, accepted)
    _report(args, sites, trials, accepted, fin, batch, context, how, time.perf_counter() - t0)
    return 0


def _report(args, sites, trials, accepted, fin, batch, context, how, seconds):
    for a in accepted:
        print(f"{a.bid}: {json.dumps(a.config, sort_keys=True)} (step {a.step_us:.1f} us with it)")
    line = (f"k31c tune --in-graph: {len(trials)} candidates at {len(sites)} sites in {seconds:.0f} s, "
            f"{len(accepted)} accepted")
    if fin:
        line += f"; the step {fin['start_median_us']:.1f} -> {fin['tuned_median_us']:.1f} us ({how})"
    print(line)
    if args.json:
        doc = {"batch": batch, "context": context, "timed_as": how, "seconds": seconds,
               "sites": [{"bid": s.bid, "family": s.family, "config": s.config, "launches": s.launches}
                         for s in sites],
               "trials": [t.to_json() for t in trials], "accepted": [a.to_json() for a in accepted],
               "final": fin}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1, sort_keys=True, default=str)
