"""Assemble the plan dict (`make_plan`), serialise it deterministically (`plan_json`) and print it as
readable tables (`format_plan`). The keys are documented in `k31c/plan/__init__.py`."""

from __future__ import annotations

import json

from .memory import (GiB, cache_bytes, capacity, kda_state_bytes, memory_plan, param_counts, weight_bytes)
from .options import LATENT_FORMATS, PlanOptions
from .sharding_cost import prefill_sharding
from .traffic import decode_traffic

PLAN_SCHEMA = "k31c-plan/1"
LONG_CONTEXT_CHUNK = 131072  # the second prefill-sharding scenario: a chunk after this much context


def make_plan(opts: PlanOptions, kernel_list: list[dict] | None = None) -> dict:
    """The whole plan as a plain, JSON-serialisable dict. `kernel_list` is filled by codegen's kernel
    selection (entries: name, op, family, backend, config, cache = hit | miss | heuristic | fallback)."""
    cfg, t = opts.cfg, opts.target
    divisors = [d for d in range(1, opts.tp + 1) if opts.tp % d == 0]
    sharding = {"fresh_prompt": prefill_sharding(opts)}
    if opts.max_context > 2 * LONG_CONTEXT_CHUNK:
        sharding["after_context"] = prefill_sharding(opts, context=LONG_CONTEXT_CHUNK)
    return {
        "schema": PLAN_SCHEMA,
        "flags": opts.flags(),
        "model": {"name": cfg.name, "source": opts.model_source, "config_digest": cfg.digest(),
                  "layers": cfg.num_hidden_layers, "full_attention_layers": len(cfg.full_attn_layers),
                  "kda_layers": len(cfg.kda_layers), "has_indexer": cfg.has_indexer,
                  "max_position_embeddings": cfg.max_position_embeddings, "experts_format": cfg.experts_format},
        "target": {"name": t.name, "description": t.description, "source": t.source, "memory_bytes": t.memory_bytes,
                   "hbm_bandwidth": t.hbm_bandwidth, "peak_flops": dict(t.peak_flops), "measured": dict(t.measured),
                   "native_formats": list(t.native_formats), "link_bandwidth": t.link_bandwidth,
                   "scaleup_size": t.scaleup_size, "topology": t.topology, "compute_units": t.compute_units,
                   "compute_unit_kind": t.compute_unit_kind, "core_kinds": dict(t.core_kinds),
                   "backends": list(t.backends), "plan_only": t.plan_only, "estimates": list(t.estimates)},
        "layout": {"tp": opts.tp, "dcp": opts.dcp, "ep": opts.ep, "world": opts.world,
                   "rule": "one instance = tp ranks; dcp | tp and ep | tp (DCP and EP groups are made of TP ranks)"},
        "formats": {"latent_cache": opts.latent_cache, "key_cache": opts.key_cache if cfg.has_indexer else None,
                    "kda_state": opts.kda_state, "experts": cfg.experts_format,
                    "emulated": opts.emulated_formats()},
        "parameters": param_counts(cfg),
        "weights": weight_bytes(cfg, opts.tp, opts.ep),
        "cache": _cache_section(opts),
        "kda_state": kda_state_bytes(cfg, opts.tp, opts.kda_state),
        "memory": memory_plan(opts),
        "capacity": {"chosen": capacity(opts), "by_dcp": [capacity(opts, d) for d in divisors]},
        "decode_traffic": decode_traffic(opts),
        "prefill_sharding": sharding,
        "kernels": kernels_section(t, kernel_list),
        "notes": _notes(opts),
    }


def _cache_section(opts: PlanOptions) -> dict:
    cfg = opts.cfg
    keys = ("fp8", "mxfp4") if cfg.has_indexer else ("fp8",)
    rows = []
    for lat in LATENT_FORMATS:
        for key in keys:
            cb = cache_bytes(cfg, lat, key)
            rows.append({"latent": lat, "key": key if cfg.has_indexer else None, "per_layer": cb["per_layer"],
                         "per_token": cb["per_token"], "chosen": lat == opts.latent_cache and key == opts.key_cache,
                         "on_target": _format_status(opts.target, (lat, key) if cfg.has_indexer else (lat,))})
    chosen = cache_bytes(cfg, opts.latent_cache, opts.key_cache)
    out = {**chosen, "per_token_per_rank": chosen["per_token"] / opts.dcp,
           "latent_only_per_token": chosen["full_attention_layers"] * chosen["latent_per_layer"], "table": rows}
    if cfg.has_indexer:
        fp8, mx = (cache_bytes(cfg, "fp8", k)["index_key_per_layer"] for k in ("fp8", "mxfp4"))
        out["mxfp4_key_shrink"] = 1 - mx / fp8
    return out


def _format_status(target, fmts) -> str:
    """native | emulated (exactly, on the CPU target) | not native (needs --emulate-formats)."""
    if all(f == "bf16" or target.is_native(f) for f in fmts):
        return "native"
    return "emulated" if target.emulates_all_formats else "not native"


def kernels_section(target, kernel_list: list[dict] | None) -> dict:
    if target.plan_only:
        return {"selected": False, "note": f"plan only: no kernel backend for {target.name}"}
    if kernel_list is None:
        return {"selected": False, "note": "kernels: not selected (compile selects them)"}
    ks = sorted((dict(k) for k in kernel_list), key=lambda k: str(k.get("name", "")))
    count = lambda what: sum(1 for k in ks if k.get("cache") == what)  # noqa: E731
    return {"selected": True, "count": len(ks), "cache_hits": count("hit"), "cache_misses": count("miss"),
            "heuristic": count("heuristic"), "fallbacks": count("fallback"), "kernels": ks,
            "note": f"{len(ks)} kernels selected"}


def _notes(opts: PlanOptions) -> list[str]:
    t, cfg = opts.target, opts.cfg
    notes = []
    if t.plan_only:
        notes.append(f"plan only: no kernel backend for {t.name}; nothing is compiled for it")
    for what in opts.emulated_formats():
        if t.emulates_all_formats:
            notes.append(f"{what}: emulated exactly on {t.name} (reference / interpreter)")
        else:
            notes.append(f"{what}: emulated on {t.name} (dequantised in the kernel; memory saving kept, "
                         f"no native-rate math) because --emulate-formats was given")
    if cfg.experts_format == "mxfp4" and not t.is_native("mxfp4"):
        notes.append(f"routed experts MXFP4: {t.name} has no native MXFP4, so they are weight-only quantised "
                     f"and dequantised to bf16 in the expert GEMM")
    if t.estimates:
        notes.append(f"{t.name} figures that are estimates, not datasheet values: {', '.join(t.estimates)}")
    if t.measured:
        notes.append(f"cost model uses {t.name}'s measured figures: "
                     + ", ".join(f"{k} {_rate(v, k)}" for k, v in t.measured.items()))
    notes.append(f"activations sized for --max-batched-tokens {opts.max_batched_tokens}; "
                 f"{opts.max_requests} KDA state slots reserved before counting cache tokens")
    return notes


def plan_json(plan: dict) -> str:
    """Deterministic JSON text (sorted keys, no timestamps): identical inputs give identical bytes."""
    return json.dumps(plan, sort_keys=True, indent=1, ensure_ascii=True) + "\n"


# ---- text tables ---------------------------------------------------------------------------------
def table(headers: list[str], rows: list[list], indent: str = "  ") -> str:
    cells = [[str(c) for c in r] for r in [headers, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    num = [all(_numeric(r[i]) for r in cells[1:]) for i in range(len(headers))]

    def line(r):
        return indent + "  ".join(c.rjust(w) if n else c.ljust(w) for c, w, n in zip(r, widths, num)).rstrip()

    head = [] if not any(headers) else [line(cells[0]), indent + "  ".join("-" * w for w in widths)]
    return "\n".join(head + [line(r) for r in cells[1:]])


def _numeric(s: str) -> bool:
    return bool(s) and s.replace(",", "").replace(".", "").replace("%", "").replace(" GiB", "").replace(" MiB", "") \
        .replace(" ms", "").replace("-", "").isdigit()


def nbytes(n: float) -> str:
    return f"{n / GiB:,.2f} GiB" if abs(n) >= GiB else f"{n / 2**20:,.2f} MiB"


def _rate(v: float, key: str) -> str:
    """Bandwidth in TB/s or GB/s, FLOP rates in PFLOP/s, TFLOP/s or GFLOP/s."""
    if "bandwidth" in key:
        return f"{v / 1e12:,.2f} TB/s" if v >= 1e12 else f"{v / 1e9:,.0f} GB/s"
    for scale, unit in ((1e15, "PFLOP/s"), (1e12, "TFLOP/s"), (1e9, "GFLOP/s")):
        if v >= scale:
            return f"{v / scale:,.4g} {unit}"
    return f"{v:,.0f} FLOP/s"


def _count(n: int) -> str:
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.4g}{unit}"
    return str(n)


def format_plan(plan: dict) -> str:
    f, m, t, lay = plan["flags"], plan["model"], plan["target"], plan["layout"]
    out = [f"k31c plan: {m['name']} on {t['name']} (tp={lay['tp']}, dcp={lay['dcp']}, ep={lay['ep']})", "",
           "resolved flags"]
    out.append(table(["flag", "value", ""], [[f"--{k.replace('_', '-')}", v, "(default)" if k in f["defaulted"] else ""]
                                           for k, v in f.items() if k != "defaulted"]))
    p = plan["parameters"]
    out += ["", "model", table(["", ""], [
        ["source", m["source"]], ["config digest", m["config_digest"]],
        ["layers", f"{m['layers']} ({m['kda_layers']} KDA, {m['full_attention_layers']} MLA"
                   f"{' + DSA indexer' if m['has_indexer'] else ''})"],
        ["parameters", f"{_count(p['total'])} total, {_count(p['active'])} active "
                       f"({_count(p['active_with_embedding'])} with the embedding table)"],
        ["routed experts", f"{p['experts']} ({p['experts_per_token']} per token), {m['experts_format']}"]])]
    est = set(t["estimates"])
    mark = lambda k: " (estimate)" if k in est else ""  # noqa: E731
    rates = ", ".join(f"{k} {_rate(v, k)}{mark('peak_flops.' + k)}" for k, v in t["peak_flops"].items())
    cores = ", ".join(f"{n} {k}" for k, n in t["core_kinds"].items()) \
        or f"{t['compute_units'] or 'unpublished number of'} {t['compute_unit_kind']}"
    out += ["", "target", table(["", ""], [
        ["device", t["description"]], ["memory", f"{nbytes(t['memory_bytes'])}{mark('memory_bytes')}"],
        ["memory bandwidth", f"{_rate(t['hbm_bandwidth'], 'bandwidth')}{mark('hbm_bandwidth')}"],
        ["peak (dense)", rates], ["compute units", cores],
        ["native formats", ", ".join(t["native_formats"]) or "none"],
        ["scale-up", f"{t['scaleup_size']} devices, {t['link_bandwidth'] / 1e9:,.0f} GB/s per direction; "
                     f"{t['topology']}"],
        ["kernel backends", ", ".join(t["backends"]) or f"none (plan only: no kernel backend for {t['name']})"],
        ["source", t["source"]]])]
    w = plan["weights"]
    out += ["", "weights per rank", table(["format", "per rank", "whole model"],
            [[k, nbytes(v), nbytes(w["model_by_format"][k])] for k, v in w["per_rank_by_format"].items()]
            + [["total", nbytes(w["per_rank_bytes"]), nbytes(w["model_bytes"])]])]
    c = plan["cache"]
    out += ["", f"cache bytes per token ({c['full_attention_layers']} full-attention layers)",
            table(["latent", "index key", "per layer", "per token", "on target", ""],
                  [[r["latent"], r["key"] or "-", f"{r['per_layer']:,}", f"{r['per_token']:,}", r["on_target"],
                    "<- chosen" if r["chosen"] else ""] for r in c["table"]])]
    if "mxfp4_key_shrink" in c:
        out.append(f"  MXFP4 keys shrink the index-key cache by {c['mxfp4_key_shrink']:.1%}; per rank under "
                   f"dcp={lay['dcp']}: {c['per_token_per_rank']:,.0f} B per token")
    k = plan["kda_state"]
    out += ["", "KDA state per request", f"  {k['kda_layers']} layers x ({k['state_per_layer']:,} B state + "
            f"{k['conv_per_layer']:,} B conv tail) = {nbytes(k['per_request'])}; per rank "
            f"{nbytes(k['per_request_per_rank'])}"]
    mem = plan["memory"]
    rows = [["weights", nbytes(mem["weights_bytes"])],
            [f"activations ({f['max_batched_tokens']} tokens x {mem['activations_per_token_bytes']:,} B)",
             nbytes(mem["activations_bytes"])]]
    rows += [[f"workspace: {n}", nbytes(v)] for n, v in mem["workspaces"].items()]
    rows += [[f"reserve: {n}", nbytes(v)] for n, v in mem["reserves"].items()]
    rows += [["free for cache", nbytes(mem["free_for_cache_bytes"])], ["device memory", nbytes(mem["capacity_bytes"])]]
    out += ["", "memory per rank", table(["component", "bytes"], rows)]
    cap = plan["capacity"]
    ctx = cap["chosen"]["context_tokens"]
    out += ["", f"capacity (tp={lay['tp']})", table(
        ["dcp", "free for cache", "B/token/rank", "cache tokens", f"concurrent {ctx:,}-token contexts"],
        [[r["dcp"], nbytes(r["free_for_cache_bytes"]), f"{r['cache_bytes_per_token_per_rank']:,.0f}",
          f"{r['tokens']:,}", r["concurrent_contexts"]] for r in cap["by_dcp"]])]
    dt = plan["decode_traffic"]
    if m["has_indexer"]:
        out += ["", "decode cache reads per request per step (all MLA layers)", table(
            ["context", "dense MLA", "DSA", "DSA/dense", f"DSA per rank (dcp={lay['dcp']})"],
            [[f"{r['context']:,}", nbytes(r["dense_mla_bytes"]), nbytes(r["dsa_bytes"]), f"{r['dsa_over_dense']:.1%}",
              nbytes(r["dsa_bytes_per_rank"])] for r in dt["per_request_per_step"]]),
            f"  DSA/dense tends to {dt['dsa_over_dense_limit_text']} = {dt['dsa_over_dense_limit']:.1%}; KDA state "
            f"read+write per step {nbytes(dt['kda_state_bytes_per_step'])} per request"]
    else:
        out += ["", "decode cache reads per request per step (dense MLA)", table(
            ["context", "dense MLA"], [[f"{r['context']:,}", nbytes(r["dense_mla_bytes"])]
                                       for r in dt["per_request_per_step"]])]
    for name, ps in plan["prefill_sharding"].items():
        what = "fresh prompt" if name == "fresh_prompt" else f"chunk after {ps['context_before_chunk']:,} tokens"
        out += ["", f"prefill attention: head vs token sharding ({what}, tp={ps['tp']})"]
        if not ps["rows"]:
            out.append(f"  {ps['note']}")
            continue
        out.append(table(["tokens", "head GFLOP", "head MB", "head ms", "token GFLOP", "token MB", "all-to-all MB",
                          "token ms", "choice"],
                         [[f"{r['tokens']:,}", f"{r['head_flops'] / 1e9:,.1f}", f"{r['head_bytes'] / 1e6:,.1f}",
                           f"{r['head_ms']:.3f}", f"{r['token_flops'] / 1e9:,.1f}", f"{r['token_bytes'] / 1e6:,.1f}",
                           f"{r['all_to_all_bytes'] / 1e6:,.1f}", f"{r['token_ms']:.3f}", r["choice"]]
                          for r in ps["rows"]]))
        x = ps["crossover_tokens"]
        out.append(f"  crossover: token sharding from {x:,} tokens" if x else
                   "  crossover: none (head sharding wins at every size)")
    kn = plan["kernels"]
    out += ["", "kernels", f"  {kn['note']}"]
    if kn["selected"]:
        out.append(f"  cache: {kn['cache_hits']} hits, {kn['cache_misses']} misses, {kn['heuristic']} heuristic, "
                   f"{kn['fallbacks']} fallbacks")
        out.append(table(["kernel", "op", "backend", "cache"], [[k.get("name", ""), k.get("op", ""),
                                                                 k.get("backend", ""), k.get("cache", "")]
                                                                for k in kn["kernels"]]))
    out += ["", "notes"] + [f"  - {n}" for n in plan["notes"]]
    return "\n".join(out) + "\n"


def format_cache_layout(cl: dict) -> list[str]:
    """Lines describing plan.json's `cache_layout` (the packed block row, DESIGN §5 T1): row bytes, pages,
    alignment, the SPEC §7 bytes per token and the KDA slot."""
    per = cl["bytes_per_token_per_layer"]
    out = [f"  {cl['block_size']} tokens per block; one row = {cl['row_bytes']:,} B = {cl['payload_bytes_per_row']:,} B "
           f"of pages + {cl['padding_bytes_per_row']:,} B padding (pages aligned to {cl['alignment']} B)",
           f"  {cl['bytes_per_token']:,} B per token = {cl['full_attention_layers']} full-attention layers x "
           f"({per['latent']} B latent {cl['latent_format']} + {per['key']} B key {cl['key_format'] or '-'}); "
           f"{cl['row_bytes_per_token']:,.2f} B per token in rows",
           table(["layer", "page", "format", "offset", "bytes", "sections (name dtype[B, width] @offset)"],
                 [[p["layer"], p["kind"], p["format"], f"{p['offset']:,}", f"{p['bytes']:,}",
                   ", ".join(f"{s['name']} {s['dtype']}[B{'' if s['width'] is None else ', ' + str(s['width'])}] "
                             f"@{s['offset']}" for s in p["sections"])] for p in cl["pages"]])]
    st = cl.get("kda_state")
    if st:
        out.append(f"  KDA state: {st['slot_bytes']:,} B per request slot ({len(st['kda_layers'])} layers, "
                   f"{st['state_format']} state + {st.get('conv_format', 'f32')} conv tail), {st['placement']}")
    return out
