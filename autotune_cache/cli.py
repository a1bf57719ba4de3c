"""`k31c cache ls|verify|prune`: list, check and clean a tuning-record store.

Every line of a store is classified against the current kernel templates and the live machine
(`audit_lines`):

    corrupt    not JSON, a missing/ill-typed field, or a key that does not hash the content
    duplicate  an older record with the same key as a later one (the newest per key is kept)
    stale      its family no longer exists or its template source changed
    foreign    measured on another device/arch than this machine (kept by prune unless --drop-foreign:
               committed stores of other devices are checked on any machine)
    rejected   this device, but a hard toolchain mismatch (compiler major.minor, CUDA major, k31c minor)
    soft       usable, with reported mismatches (k31c patch, CUDA minor, ...)
    ok         exactly this machine and toolchain
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from dataclasses import dataclass

from .records import CacheStore, Environment, canonical_json, match_problems, parse_lines, template_sha256

_FMT = argparse.RawDescriptionHelpFormatter
DROPPED_BY_PRUNE = ("corrupt", "duplicate", "stale", "rejected")


@dataclass
class Verdict:
    lineno: int
    status: str
    reason: str
    line: object  # records.Line


def audit_lines(raw_lines: list[str], templates: dict, env: Environment) -> list[Verdict]:
    """Classify each non-empty line; `templates` maps family -> KernelTemplate (the current code)."""
    lines = parse_lines("\n".join(raw_lines))
    last_of_key = {}
    for i, ln in enumerate(lines):
        if ln.record is not None:
            k = ln.record.key
            if k not in last_of_key or ln.record.created_at >= lines[last_of_key[k]].record.created_at:
                last_of_key[k] = i
    shas = {fam: template_sha256(t) for fam, t in templates.items()}
    out = []
    for i, ln in enumerate(lines):
        r = ln.record
        if r is None:
            out.append(Verdict(ln.lineno, "corrupt", ln.error, ln))
        elif last_of_key[r.key] != i:
            out.append(Verdict(ln.lineno, "duplicate", f"same key as line {lines[last_of_key[r.key]].lineno}, "
                                                        "which is newer", ln))
        elif r.family not in templates:
            out.append(Verdict(ln.lineno, "stale", f"no kernel template named {r.family!r} exists", ln))
        elif r.template_sha256 != shas[r.family]:
            out.append(Verdict(ln.lineno, "stale", f"template source of {r.family} changed since it was tuned", ln))
        elif (r.device, r.arch) != (env.device, env.arch):
            out.append(Verdict(ln.lineno, "foreign", f"measured on {r.device} ({r.arch}), this machine is "
                                                      f"{env.device} ({env.arch})", ln))
        else:
            hard, soft = match_problems(r, shas[r.family], templates[r.family].backend, env)
            status, why = ("rejected", hard) if hard else ("soft", soft) if soft else ("ok", [])
            out.append(Verdict(ln.lineno, status, "; ".join(why), ln))
    return out


def _templates() -> dict:
    from codegen.registry import all_templates

    return {t.family: t for t in all_templates()}


def _store(args) -> CacheStore:
    return CacheStore(args.store) if args.store else CacheStore()


def add_cache_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("cache", help="list, verify and prune tuning records (autotune_cache/)", formatter_class=_FMT,
                       epilog="examples:\n  k31c cache ls\n  k31c cache ls --family gemm --json\n"
                              "  k31c cache verify --store autotune_cache/records/nvidia-h200.jsonl\n"
                              "  k31c cache prune --dry-run\n\n"
                              "The store defaults to $K31C_TUNING_CACHE, else autotune_cache/records/<device>.jsonl.")
    cs = p.add_subparsers(dest="cache_command", required=True)

    def common(q):
        q.add_argument("--store", default=None, help="store file (default: this machine's store)")

    q = cs.add_parser("ls", help="list records and whether this machine would use them", formatter_class=_FMT,
                      epilog="examples:\n  k31c cache ls\n  k31c cache ls --family kda_decode\n"
                             "  k31c cache ls --store /tmp/t.jsonl --json")
    common(q)
    q.add_argument("--family", default=None, help="only this kernel family")
    q.add_argument("--json", action="store_true", help="one JSON object per record, with its status")
    q.set_defaults(func=cmd_cache_ls)

    q = cs.add_parser("verify", help="report corrupted, stale, foreign and rejected records", formatter_class=_FMT,
                      epilog="examples:\n  k31c cache verify\n  k31c cache verify --store autotune_cache/records/cpu.jsonl"
                             " --strict\n\nExit status 1 when a line is corrupt (with --strict: also when any record"
                             " is stale, rejected or a duplicate).")
    common(q)
    q.add_argument("--strict", action="store_true", help="fail on stale/rejected/duplicate records too")
    q.set_defaults(func=cmd_cache_verify)

    q = cs.add_parser("prune", help="drop corrupt, duplicate, stale and rejected records (atomically)",
                      formatter_class=_FMT, epilog="examples:\n  k31c cache prune --dry-run\n"
                                                   "  k31c cache prune --store /tmp/t.jsonl --drop-foreign")
    common(q)
    q.add_argument("--drop-foreign", action="store_true", help="also drop records of other devices")
    q.add_argument("--dry-run", action="store_true", help="say what would be dropped, change nothing")
    q.set_defaults(func=cmd_cache_prune)
    return p


def _raw_lines(store: CacheStore) -> list[str]:
    try:
        with open(store.path, encoding="utf-8", errors="replace") as f:
            return f.read().splitlines()
    except FileNotFoundError:
        return []


def _no_store(store: CacheStore, cmd: str) -> int:
    print(f"k31c cache {cmd}: no tuning store at {store.path} (k31c tune writes one; or pass --store FILE)",
          file=sys.stderr)
    return 2


def cmd_cache_ls(args) -> int:
    store, env = _store(args), Environment.current()
    if not os.path.exists(store.path):
        return _no_store(store, "ls")
    verdicts = [v for v in audit_lines(_raw_lines(store), _templates(), env)
                if args.family is None or (v.line.record is not None and v.line.record.family == args.family)]
    if args.json:
        for v in verdicts:
            obj = v.line.record.to_json() if v.line.record else {"text": v.line.text}
            print(canonical_json({**obj, "line": v.lineno, "status": v.status, "reason": v.reason}))
        return 0
    print(f"{store.path}: {len(verdicts)} line(s); this machine: {env.device} ({env.arch})")
    for v in verdicts:
        r = v.line.record
        if r is None:
            print(f"  line {v.lineno:<4} corrupt   {v.reason}")
            continue
        cfg = " ".join(f"{k}={x}" for k, x in sorted(r.config.items()))
        print(f"  line {v.lineno:<4} {v.status:<9} {r.family} {canonical_json(r.bucket)}  {cfg}  "
              f"{r.median_us:.2f}±{r.spread_us:.2f} us x{r.trials}  {r.device} ({r.arch})  key {r.key[:12]}"
              + (f"  [{v.reason}]" if v.reason else ""))
    return 0


def cmd_cache_verify(args) -> int:
    store, env = _store(args), Environment.current()
    if not os.path.exists(store.path):
        return _no_store(store, "verify")
    verdicts = audit_lines(_raw_lines(store), _templates(), env)
    counts = Counter(v.status for v in verdicts)
    for v in verdicts:
        if v.status not in ("ok", "soft"):
            print(f"{store.path}:{v.lineno}: {v.status}: {v.reason}")
    print(f"{store.path}: " + ", ".join(f"{counts[s]} {s}" for s in
                                       ("ok", "soft", "foreign", "stale", "rejected", "duplicate", "corrupt")))
    bad = counts["corrupt"] + (counts["stale"] + counts["rejected"] + counts["duplicate"] if args.strict else 0)
    return 1 if bad else 0


def cmd_cache_prune(args) -> int:
    store, env = _store(args), Environment.current()
    if not os.path.exists(store.path):
        return _no_store(store, "prune")
    templates = _templates()
    drop = set(DROPPED_BY_PRUNE) | ({"foreign"} if args.drop_foreign else set())
    dropped: list[Verdict] = []

    def edit(raw: list[str]) -> list[str]:
        verdicts = audit_lines(raw, templates, env)
        dropped[:] = [v for v in verdicts if v.status in drop]
        return [v.line.text for v in verdicts if v.status not in drop]

    if args.dry_run:
        edit(_raw_lines(store))
    else:
        store.rewrite(edit)
    for v in dropped:
        print(f"{'would drop' if args.dry_run else 'dropped'} line {v.lineno}: {v.status}: {v.reason}")
    print(f"{store.path}: {'would drop' if args.dry_run else 'dropped'} {len(dropped)} line(s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (`python -m autotune_cache.cli ls`) until `k31c cache` is wired in."""
    ap = argparse.ArgumentParser(prog="k31c")
    add_cache_parser(ap.add_subparsers(dest="command", required=True))
    args = ap.parse_args(["cache"] + list(sys.argv[1:] if argv is None else argv))
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
