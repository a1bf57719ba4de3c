"""`k31c tune ARTIFACT | --target T`: tune a compiled artifact's kernels on the machine it will serve on.

    k31c tune build/tiny --kernel gemm --trials 30 --plot /tmp/tune
    k31c tune build/h200 --bucket '{"D":256,"R":8,"bi":0,"rot":0}' --kernel rms_norm
    k31c tune --target h200 --model k31-tiny --trials 20        # records only: compiles in a temp dir

ARTIFACT: every kernel node of the artifact (or those of `--kernel`, `--bucket`, `--function`) is
captured at the compiler's representative step shapes (`autotune_cache/inputs.py`), each (kernel,
bucket) is tuned by an optuna study (`autotune_cache/tuner.py`), the winners are written to the
tuning store (`--store`, default this device's `autotune_cache/records/<device>.jsonl`), and the
artifact is updated: `kernels/configs.json` gets the tuned config under the bucket id the runtime
computes (source "tuned"), `plan.json`'s kernel list follows, the studies live in
`ARTIFACT/tuning/studies.db` (`--study-db`), a summary in `ARTIFACT/tuning/summary.json`, and the
manifest's file hashes are refreshed (also when the run is interrupted), so `load_artifact` accepts
the result. `--target T`: compiles `--model` for T into a temporary folder and only writes records.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from .graph_tune_cli import CHOICE_FLAGS, add_in_graph_args, flag
from .graph_tune_cli import problems as in_graph_problems

EPILOG = """examples:
  k31c tune build/tiny --kernel rms_norm --trials 12
  k31c tune build/h200 --trials 40 --timeout-s 30 --plot /tmp/tune-plots
  k31c tune --target h200 --model k31-tiny --kernel gemm --store /tmp/h200.jsonl
  k31c tune build/h200 --in-graph --batch 1 --context 8192 --rounds 4     # configs chosen inside the decode step

An interrupted tune resumes where it stopped: run the same command again (studies are kept in
--study-db; finished trials are not re-run, measured configs are not re-timed)."""


def add_tune_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("tune", help="tune kernel configs on this machine (optuna; records + artifact configs)",
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    add_tune_args(p)
    p.set_defaults(func=main)
    return p


def add_tune_args(p: argparse.ArgumentParser):
    p.add_argument("artifact", nargs="?", default=None, help="compiled artifact directory (from k31c compile)")
    p.add_argument("--target", default=None, help="tune a fresh compile for this target (records only)")
    p.add_argument("--model", default="k31-tiny", help="with --target: preset or checkpoint (default k31-tiny)")
    p.add_argument("--kernel", action="append", default=[], metavar="FAMILY",
                   help="only this kernel family (repeatable)")
    p.add_argument("--bucket", default=None, metavar="JSON", help="only this shape bucket (needs --kernel)")
    p.add_argument("--function", action="append", default=[], choices=("prefill", "decode", "verify"),
                   help="only kernel nodes of this entry function (repeatable)")
    p.add_argument("--shapes", default=None, metavar="JSON",
                   help='capture step shapes, e.g. \'{"prefill": {"B": 64, "R": 2}}\' (default: compile\'s)')
    p.add_argument("--trials", type=int, default=20, help="trials per study, resumed studies included (default 20)")
    p.add_argument("--timeout-s", type=float, default=60.0, help="per-candidate limit: check + compile + timing")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per trial (default 20 GPU / 3 CPU)")
    p.add_argument("--store", default=None, help="tuning store file (default: this device's store)")
    p.add_argument("--study-db", default=None, help="optuna sqlite file (default ARTIFACT/tuning/studies.db)")
    p.add_argument("--plot", default=None, metavar="DIR", help="write a PNG per study and ceilings.png here")
    p.add_argument("--seed", type=int, default=0, help="sampler and capture seed (default 0)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_in_graph_args(p)


def _problems(args) -> list[str]:
    out = in_graph_problems(args)
    if bool(args.artifact) == bool(args.target):
        out.append("give an artifact directory or --target T (not both)")
    if args.bucket is not None and not args.kernel:
        out.append("--bucket needs --kernel FAMILY (a bucket is a kernel's shape bucket)")
    for name in ("bucket", "shapes"):
        text = getattr(args, name)
        if text is not None:
            try:
                if not isinstance(json.loads(text), dict):
                    out.append(f"--{name} must be a JSON object, found {text!r}")
            except json.JSONDecodeError as e:
                out.append(f"--{name} is not valid JSON ({e.msg}): {text!r}")
    if args.trials < 1:
        out.append(f"--trials must be >= 1, found {args.trials}")
    if args.timeout_s <= 0:
        out.append(f"--timeout-s must be positive, found {args.timeout_s}")
    return out


def main(args) -> int:
    import torch

    from k31c.cli import UsageError

    problems = _problems(args)
    if problems:
        raise UsageError(problems)
    tmp = None
    path = args.artifact
    if args.target:
        from k31c.cli import main as k31c_main

        tmp = tempfile.mkdtemp(prefix="k31c-tune-")
        path = os.path.join(tmp, "artifact")
        rc = k31c_main(["compile", "--model", args.model, "--target", args.target, "-o", path])
        if rc:
            return rc
    try:
        if args.in_graph:
            from .graph_tune_cli import run

            return run(args, path, update=args.artifact is not None, command=command_line(args, path))
        return _tune(args, path, update=args.artifact is not None,
                     device="cuda" if torch.cuda.is_available() else "cpu")
    finally:
        if tmp:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)


def _tune(args, path: str, update: bool, device: str) -> int:
    results, probs = run_tune(args, path, update, device)
    if probs is None:
        hint = (" at the capture shapes: give --shapes with a step size that reaches that bucket, e.g. "
                "--shapes '{\"prefill\": {\"B\": 512, \"R\": 4}}'") if args.bucket else ""
        print(f"k31c tune: nothing to tune (no kernel node matches --kernel/--bucket/--function{hint})",
              file=sys.stderr)
        return 1
    return 0 if len(results) == len(probs) else 1


def run_tune(args, path: str, update: bool, device: str, order=None, budget_s: float | None = None):
    """Capture, tune, store, update the artifact, report. Returns (results, problems or None when no
    node matched). `order(problems) -> problems` reorders the studies; no study starts once `budget_s`
    seconds have passed since the capture finished."""
    import torch

    from k31c.compiler import load_artifact

    from .inputs import capture_problems
    from .records import CacheStore, Environment
    from .tuner import tune_problems

    art = load_artifact(path)
    target = art.manifest["target"]["name"]
    env = Environment.current()
    store = CacheStore(args.store) if args.store else CacheStore()
    choices = [c for c in art.choices if not args.function or c.function in args.function]
    families = set(args.kernel) or None
    known = {c.template.family for c in art.choices if c.template is not None}
    if families and families - known:
        from k31c.cli import UsageError

        uses = ", ".join(sorted(known))
        raise UsageError([f"--kernel {f}: the artifact uses no kernel of that family (it uses {uses})"
                          for f in sorted(families - known)])
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    t0 = time.perf_counter()
    say = (lambda m: None) if args.no_progress else (lambda m: print(m, file=sys.stderr))
    say(f"k31c tune: {path} (target {target}) on {env.device}; capturing operands ...")
    probs = capture_problems(art.module, art.weights, choices, device=device, compute_dtype=dtype,
                             batch_invariant=art.manifest["options"].get("batch_invariant", False),
                             families=families, bucket=json.loads(args.bucket) if args.bucket else None,
                             seed=args.seed, shapes=json.loads(args.shapes) if args.shapes else None)
    if not probs:
        return [], None
    if order is not None:
        probs = order(probs)
    say(f"k31c tune: {len(probs)} (kernel, bucket) studies, {args.trials} trials each; captured in "
        f"{time.perf_counter() - t0:.1f} s; store {store.path}")
    study_db = args.study_db or (os.path.join(path, "tuning", "studies.db") if update else None)
    if study_db:
        os.makedirs(os.path.dirname(os.path.abspath(study_db)), exist_ok=True)
    repeats = args.repeats or (20 if device == "cuda" else 3)
    cmd = command_line(args, path)
    results = []
    try:
        deadline = time.perf_counter() + budget_s if budget_s else None
        results = tune_problems(probs, store=store, trials=args.trials, progress=not args.no_progress,
                                deadline=deadline, target=target, env=env, seed=args.seed, study_db=study_db,
                                timeout_s=args.timeout_s, repeats=repeats, final_repeats=2 * repeats,
                                created_by=cmd[:500])
    finally:
        if update:
            update_artifact(path, results)
    _report(results, args, target, device, path if update else None)
    return results, probs


def command_line(args, path: str) -> str:
    """The `k31c tune` command that reproduces this run (recorded in every record's created_by)."""
    import shlex

    parts = ["k31c", "tune"] + ([path] if args.artifact else ["--target", args.target, "--model", args.model])
    for k in args.kernel:
        parts += ["--kernel", k]
    for f in args.function:
        parts += ["--function", f]
    for name in ("bucket", "shapes"):
        if getattr(args, name):
            parts += [f"--{name}", getattr(args, name)]
    if getattr(args, "in_graph", False):
        parts.append("--in-graph")
        for name in CHOICE_FLAGS:
            if getattr(args, name) is not None:
                parts += [flag(name), str(getattr(args, name))]
    else:
        parts += ["--trials", str(args.trials)]
    parts += ["--seed", str(args.seed)]
    return " ".join(shlex.quote(p) for p in parts)


def update_artifact(path: str, results: list) -> None:
    """Tuned configs into kernels/configs.json and plan.json; tuning/summary.json; manifest hashes."""
    from codegen.registry import all_templates
    from k31c.artifact import MANIFEST, file_hashes, manifest_json

    by_family = {t.family: t for t in all_templates()}
    cfg_path = os.path.join(path, "kernels", "configs.json")
    plan_path = os.path.join(path, "plan.json")
    if results:
        configs = json.load(open(cfg_path, encoding="utf-8"))
        plan = json.load(open(plan_path, encoding="utf-8")) if os.path.isfile(plan_path) else None
        renamed = []  # (old kernel name or None, new name, result)
        for r in results:
            t = by_family[r.family]
            old = configs.get(r.bid, {})
            name = t.kernel_name(r.config, r.key)
            configs[r.bid] = {"family": r.family, "op": old.get("op", r.op), "kernel_name": name, "config": r.config,
                              "source": "tuned", "record": r.record.key}
            renamed.append((old.get("kernel_name"), name, r))
        _atomic_write(cfg_path, json.dumps(configs, indent=1, sort_keys=True) + "\n")
        if plan is not None and isinstance(plan.get("kernels", {}).get("kernels"), list):
            _update_plan(plan, renamed)
            from k31c.plan import plan_json

            _atomic_write(plan_path, plan_json(plan))
        summary = os.path.join(path, "tuning", "summary.json")
        os.makedirs(os.path.dirname(summary), exist_ok=True)
        old = json.load(open(summary, encoding="utf-8")) if os.path.isfile(summary) else {}
        old.update({r.bid: r.to_json() for r in results})
        _atomic_write(summary, json.dumps(old, indent=1, sort_keys=True) + "\n")
    man_path = os.path.join(path, MANIFEST)
    if os.path.isfile(man_path):  # refresh the hashes: configs, plan and tuning/ changed
        man = json.load(open(man_path, encoding="utf-8"))
        man["files"] = file_hashes(path)
        _atomic_write(man_path, manifest_json(man))


def _update_plan(plan: dict, renamed: list):
    ks = plan["kernels"]["kernels"]
    names = {k.get("name"): k for k in ks}
    for old, name, r in renamed:
        entry = names.get(old) if old else names.get(name)
        if entry is None:
            entry = {"op": r.op, "family": r.family, "backend": "triton"}
            ks.append(entry)
        entry.update(name=name, config=r.config, cache="hit")
    ks.sort(key=lambda k: str(k.get("name", "")))
    count = lambda what: sum(1 for k in ks if k.get("cache") == what)  # noqa: E731
    plan["kernels"].update(count=len(ks), cache_hits=count("hit"), cache_misses=count("miss"),
                           heuristic=count("heuristic"), fallbacks=count("fallback"))


def _atomic_write(path: str, text: str):
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)
    os.replace(tmp, path)


def _report(results: list, args, target: str, device: str, artifact: str | None):
    for r in results:
        print(f"{r.bid}: {r.median_us:.2f} us ± {r.spread_us:.2f} (default {r.default_us:.2f} us, "
              f"x{r.speedup:.2f}) {json.dumps(r.config, sort_keys=True)}; {r.trials} trials, {r.rejected} rejected, "
              f"{r.timeouts} timed out, {r.seconds:.1f} s")
    doc = {"target": target, "device": device, "artifact": artifact, "results": [r.to_json() for r in results]}
    if args.plot:
        from .plot import ceilings, ceilings_png, study_png

        paths = [study_png(r, args.plot) for r in results]
        ceil = ceilings(target, device)
        paths.append(ceilings_png(results, ceil, args.plot))
        doc["ceilings"] = ceil
        print(f"k31c tune: wrote {len(paths)} PNGs to {args.plot}", file=sys.stderr)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1, sort_keys=True)


def cli(argv: list[str] | None = None) -> int:
    """Stand-alone entry (`python -m autotune_cache.tune_cli ARTIFACT ...`) until `k31c tune` is wired in."""
    from k31c.cli import UsageError

    ap = argparse.ArgumentParser(prog="k31c tune", formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=EPILOG)
    add_tune_args(ap)
    args = ap.parse_args(argv)
    try:
        return main(args)
    except UsageError as e:
        print(f"k31c tune: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(cli())
