"""`k31c tune ARTIFACT --in-graph`: kernel configs chosen inside the decode step they run in.

    k31c tune build/h200 --in-graph --batch 1 --context 8192 --rounds 4
    k31c tune build/h200 --in-graph --kernel moe_latent_tail --try '{"moe_latent_tail": [{"G_warps": 8}]}'

Why. The kernel-alone tuner (`tuner.py`) times each kernel by itself. Inside a decode step a kernel shares
the SMs with what runs beside it: the side stream's branch, and kernels launched early by programmatic
dependent launch that hold SM slots while they wait. On the H200 (rank preset, batch 1, 8K; session 18,
benches/results/h200-2026-12-01-s18/) four batch-1 configs, each neutral or slower alone, made the step
~22 µs faster (552.0 -> 529.6 µs), and the latent tail's fastest config alone (15.0 vs 17 µs) made the step
10 µs slower. A batch-1 step's configs are therefore chosen by timing the step.

How:
  1. the artifact's runtime (`GraphedRuntime`: on cuda its decode steps replay CUDA graphs) admits `batch`
     requests at `context` tokens over random cache rows and states (`fill_random`);
  2. one decode step lists its sites (`step_sites`): each (kernel family, bucket) it launches, with the
     config it launched (the artifact's tuned config, a record of the store, or the declared heuristic), in
     launch order;
  3. coordinate descent over the sites (`search`), `passes` times: a site's candidates are its neighbours
     (each declared tunable `span` steps along its value list, default 1, 0: the whole list; legal per the
     template's constraints: `neighbours`), the `--try` overrides of its family and, where kernels launch with
     programmatic dependent launch, the launch without it (`_plain`, k31c/runtime/executor.py PLAIN: whether a
     kernel should overlap its predecessor is a property of the step, like its tile sizes). Per candidate:
       - screen: the step timed once with it and once with the incumbent configs;
       - check: the step's logits with it vs with the configs the search started from, from the same state:
         finite, relative L2 error <= `tol` (else rejected and named); a candidate that fails to compile or
         launch is rejected and named too;
       - confirm, when the screen gained >= half of `min_gain_us`: `rounds` more (incumbent, candidate)
         pairs, their order alternating; accepted when the median paired gain is >= `min_gain_us` and most
         pairs gain. An accepted candidate is the incumbent from then on: later candidates are timed on top.
  4. the step with every accepted config vs the step as it started, `rounds` pairs (`final`), and the
     winners: one record per accepted bucket in the store (`median_us` / `spread_us`: the whole step's time
     with it, `trials`: its confirming pairs, `created_by`: the command, with --in-graph), and, for an
     artifact, kernels/configs.json (source "tuned") so its loader uses them before the store's records. The
     kernel-alone tuner leaves a bucket whose record was chosen this way alone (`records.chosen_in_graph`).

Measured (H200, rank preset, batch 1, 8K; session 19, benches/results/h200-2026-12-01-s19/): over the kernel-alone
records, 23 sites and ~200 candidates a pass (~1 minute; every value of every tunable: ~400, ~4 minutes), six
records changed: the router at num_stages 2 instead of its record's 1 (-11.6 µs over its three launches), the dense
gate/up at BLOCK_K 256, the MLA and KDA packed projections at BLOCK_N 8 / 2 warps, the shared expert's down at
BLOCK_K 512, the KDA decode in Gluon (GLUON 3): 530.2 -> 513.6 µs a step in one call (1.285x -> 1.244x the byte
floor at that call's 4204 GB/s). No site gained launched without PDL. A 0.5 µs bar accepted noise (a tunable the
launched path never reads passed 6 pairs), hence the 1 µs default.

A step's time (`StepTimer`): on cuda the bucket's graph is captured under the configs and `replays` replays
are timed, each behind a ~1 ms `torch.cuda._sleep`, so the events see device time only, not the host's
submission (median); elsewhere the eager step's wall time (median of `steps`). Between measurements the
requests' lengths and recurrent states are restored, so every step reads and writes the same rows.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from k31c.runtime.executor import PLAIN

SLEEP_CYCLES = 2_000_000  # `torch.cuda._sleep` before a timed replay: ~1 ms on the H200
LAUNCH_TRIES = ({PLAIN: 1},)  # tried at every site where kernels launch with PDL (the executor's launch option)


@dataclass
class Site:
    """One (kernel family, bucket) of the step, as first launched; `launches` counts its launches in the listing
    step (a CUDA graph's capture runs the step three times: two warm-ups and the capture)."""
    template: object
    key: dict
    bid: str
    config: dict
    op: str
    launches: int = 1

    @property
    def family(self) -> str:
        return self.template.family


@dataclass
class Trial:
    """One candidate's measurements: paired gains are incumbent − candidate (µs, positive = faster)."""
    bid: str
    config: dict
    changed: dict
    rel_err: float | None = None
    screen_gain_us: float | None = None
    gains_us: list = field(default_factory=list)
    candidate_us: list = field(default_factory=list)
    accepted: bool = False
    why: str = ""

    def to_json(self) -> dict:
        return asdict(self)


def fill_random(rt, lengths: dict, seed: int = 1):
    """Admit requests (id -> (length, capacity)) over random cache rows and recurrent states (finite values;
    index-key scales positive)."""
    for rid, n in lengths.items():
        rt.add_request(rid, n[1])
        rt.requests[rid].length = n[0]
    fill_pools(rt, seed)


def fill_pools(rt, seed: int):
    """Random cache rows and recurrent states in every pool (finite values; index-key scales positive)."""
    g = torch.Generator(rt.device).manual_seed(seed)
    for name, t in rt.pools.items():
        x = torch.randn(t.shape, generator=g, device=rt.device) * (0.05 if name in rt.state_pools else 0.5)
        t.copy_(x.abs() + 0.5 if name.startswith("index_scales") else x)


def replay_us(graph, n: int, sleep_cycles: int = SLEEP_CYCLES) -> list[float]:
    """Device times (µs, CUDA events) of n replays of a captured graph, each behind a sleep of sleep_cycles (0:
    none; then the events also see the host's submission of the graph)."""
    out = []
    for _ in range(n):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if sleep_cycles:
            torch.cuda._sleep(sleep_cycles)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        out.append(s.elapsed_time(e) * 1e3)
    return out


def neighbours(template, key: dict, config: dict, target: str, span: int = 1) -> list[dict]:
    """Configs up to `span` steps away from `config` along one declared tunable (its value list's order; span 0:
    anywhere on the list), nearest first, legal per the template's constraints. Tunables the config leaves unset,
    or sets outside their list, are not moved."""
    out = []
    for tun in template.tunables:
        vals = list(tun.values)
        if tun.name not in config or config[tun.name] not in vals:
            continue
        i = vals.index(config[tun.name])
        reach = span or len(vals)
        for j in sorted((j for j in range(i - reach, i + reach + 1) if j != i), key=lambda j: (abs(j - i), j)):
            if 0 <= j < len(vals):
                cand = {**config, tun.name: vals[j]}
                if not _illegal(template, cand, key, target):
                    out.append(cand)
    return out


def _illegal(template, config: dict, key: dict, target: str) -> list[str]:
    try:  # the executor's launch option is not the template's to judge
        return list(template.constraints({k: v for k, v in config.items() if k != PLAIN}, key, target))
    except Exception as e:  # a constraint that raises makes the config illegal (as in search.py)
        return [f"{type(e).__name__}: {e}"]


class StepTimer:
    """Times the decode step of `batch` requests at `context` tokens under per-bucket config overrides (module
    doc, "A step's time"); `rt` is a GraphedRuntime whose Executor is `rt.interp`."""

    def __init__(self, rt, batch: int, vocab: int, *, replays: int = 30, steps: int = 1,
                 sleep_cycles: int = SLEEP_CYCLES):
        self.rt, self.eng = rt, rt.interp
        self.toks = {rid: (7 * i + 3) % vocab for i, rid in enumerate(sorted(rt.requests)[:batch])}
        if len(self.toks) != batch:
            raise ValueError(f"the runtime holds {len(rt.requests)} requests, the step needs {batch}")
        self.lengths = {rid: rt.requests[rid].length for rid in self.toks}
        self.states = {rid: rt.snapshot_state(rid) for rid in self.toks}
        self.base = dict(self.eng.configs)
        self.graphs = bool(getattr(rt, "use_graphs", False))
        self.replays, self.steps, self.sleep_cycles = replays, steps, sleep_cycles

    def _restore(self):
        for rid, st in self.states.items():
            self.rt.restore_state(rid, st)
            self.rt.requests[rid].length = self.lengths[rid]

    def _sync(self):
        if self.rt.device.type == "cuda":
            torch.cuda.synchronize(self.rt.device)

    def launches(self, overrides: dict) -> list:
        """(template, key, bucket id, config, op) of every kernel launch of one step under `overrides` (the CUDA
        graph's capture included)."""
        log = self.eng.launch_log = []
        try:
            self.measure(overrides, timed=False)
        finally:
            self.eng.launch_log = None
        return log

    def measure(self, overrides: dict, timed: bool = True) -> tuple[list[float], torch.Tensor]:
        """(step times in µs, the step's logits) with `overrides` (bucket id -> config) on top of the configs the
        runtime resolves; the runtime's own configs are back afterwards."""
        self.eng.configs = {**self.base, **overrides}
        if self.graphs:
            self.rt.drop_graphs()
        self.rt.replays.clear()
        try:
            self._restore()
            self._sync()
            t0 = time.perf_counter()
            logits = self.rt.decode(self.toks).float()
            self._sync()
            times = [(time.perf_counter() - t0) * 1e6]
            if self.graphs:
                self._graph_used()
                if timed:
                    times = replay_us(self.rt.graphs[next(iter(self.rt.replays))].graph, self.replays,
                                      self.sleep_cycles)
            elif timed:
                for _ in range(self.steps - 1):
                    self._restore()
                    t0 = time.perf_counter()
                    self.rt.decode(self.toks)
                    self._sync()
                    times.append((time.perf_counter() - t0) * 1e6)
        finally:
            self.eng.configs = dict(self.base)
            self.rt.replays.clear()
            self._restore()
        return times, logits

    def _graph_used(self):
        """Raise when the step ran eagerly instead of replaying its graph (a capture that failed under these
        configs: the runtime would otherwise run that bucket eagerly from now on)."""
        if self.rt.replays:
            return
        failed = dict(self.rt.failed)
        self.rt.failed.clear()
        why = "; ".join(failed.values()) or json.dumps(dict(self.rt.fallbacks))
        raise RuntimeError(f"the decode step did not replay a CUDA graph: {why}")


def step_sites(launch_log: list) -> list[Site]:
    """The distinct (family, bucket) sites of a launch log, in first-launch order, with launch counts."""
    sites: dict[str, Site] = {}
    for t, key, bid, cfg, op in launch_log:
        if bid in sites:
            sites[bid].launches += 1
        else:
            sites[bid] = Site(t, dict(key), bid, dict(cfg), op)
    return list(sites.values())


def pdl_launches(rt) -> bool:
    """Whether the runtime's kernels launch with programmatic dependent launch (CUDA sm_90+, PDL on)."""
    if rt.device.type != "cuda":
        return False
    from codegen.triton import _pdl

    return bool(_pdl.launch_kwargs().get("PDL"))


def tunable_sites(timer: "StepTimer", *, kernels=(), tries: dict | None = None, skip=()) -> list[Site]:
    """The sites of the timer's step worth searching: of `kernels`' families (all when empty), not in `skip` (bucket
    ids), with declared tunables or `tries` overrides."""
    tries = tries or {}
    return [s for s in step_sites(timer.launches({})) if s.bid not in skip
            and (not kernels or s.family in kernels) and (s.template.tunables or s.family in tries)]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    if not bool(torch.isfinite(a).all()):
        return math.inf
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def search(sites: list[Site], measure: Callable, *, target: str, tries: dict | None = None, rounds: int = 4,
           min_gain_us: float = 1.0, tol: float = 1e-2, passes: int = 1, span: int = 1, launch_tries=(),
           deadline: float | None = None, say: Callable = lambda m: None) -> tuple[dict, list[Trial]]:
    """Coordinate descent (module doc, step 3). `measure(overrides) -> (µs, logits)` times one step under
    overrides (bucket id -> config); `tries`: family -> list of config overrides tried at each of its sites;
    `launch_tries`: overrides tried at every site (LAUNCH_TRIES: the launch without PDL).
    Returns (accepted overrides: bucket id -> config, every trial)."""
    tries = tries or {}
    chosen: dict = {}
    trials: list[Trial] = []
    _, ref = measure({})
    for _ in range(passes):
        moved = False
        for site in sites:
            start = chosen.get(site.bid, site.config)
            changes = [{k: v for k, v in c.items() if start.get(k) != v}
                       for c in neighbours(site.template, site.key, start, target, span)]
            changes += tries.get(site.family, []) + list(launch_tries)
            seen = set()
            for change in changes:  # each applied to the incumbent of the moment (earlier ones may be accepted)
                if deadline is not None and time.perf_counter() > deadline:
                    say("graph tune: budget spent; stopping")
                    return chosen, trials
                current = chosen.get(site.bid, site.config)
                cand = {**current, **change}
                text = json.dumps(cand, sort_keys=True)
                if cand == current or text in seen:
                    continue
                seen.add(text)
                tr = Trial(site.bid, cand, {k: v for k, v in cand.items() if current.get(k) != v})
                trials.append(tr)
                _trial(tr, site, measure, chosen, ref, target=target, rounds=rounds, min_gain_us=min_gain_us,
                       tol=tol)
                say(f"graph tune: {site.bid} {tr.changed}: {tr.why}" + (" -> accepted" if tr.accepted else ""))
                if tr.accepted:
                    chosen[site.bid] = cand
                    moved = True
        if not moved:
            break
    return chosen, trials


def _trial(tr: Trial, site: Site, measure: Callable, chosen: dict, ref, *, target: str, rounds: int,
           min_gain_us: float, tol: float):
    """Legality, screen, logits check and confirmation of one candidate (`tr.config`) on top of `chosen`; fills
    `tr` (accepted, why, measurements)."""
    problems = _illegal(site.template, tr.config, site.key, target)
    if problems:
        tr.why = "illegal: " + "; ".join(problems)
        return
    over = {**chosen, site.bid: tr.config}
    try:
        inc_us, _ = measure(chosen)
        cand_us, logits = measure(over)
    except Exception as e:  # a config that fails to compile or launch is rejected, not fatal
        tr.why = f"failed: {type(e).__name__}: {str(e)[:300]}"
        return
    tr.rel_err = rel_err(logits, ref)
    if not tr.rel_err <= tol:
        tr.why = f"logits differ from the starting configs': rel. error {tr.rel_err:.3g} > {tol:g}"
        return
    tr.screen_gain_us = inc_us - cand_us
    tr.candidate_us.append(cand_us)
    if tr.screen_gain_us < min_gain_us / 2:
        tr.why = "screen: no gain"
        return
    for r in range(rounds):  # (incumbent, candidate) pairs, the order alternating
        if r % 2 == 0:
            i_us, c_us = measure(chosen)[0], measure(over)[0]
        else:
            c_us, i_us = measure(over)[0], measure(chosen)[0]
        tr.gains_us.append(i_us - c_us)
        tr.candidate_us.append(c_us)
    gain = statistics.median(tr.gains_us)
    wins = sum(g > 0 for g in tr.gains_us)
    tr.accepted = gain >= min_gain_us and wins * 3 >= 2 * len(tr.gains_us)
    tr.why = f"confirm: median gain {gain:.2f} us, {wins}/{len(tr.gains_us)} pairs faster"


def final(measure: Callable, chosen: dict, rounds: int) -> dict:
    """The step as it started vs with every accepted config: `rounds` pairs, order alternating (µs)."""
    times: dict = {"start": [], "tuned": []}
    for r in range(rounds):
        pair = [("start", {}), ("tuned", chosen)]
        for label, over in (pair if r % 2 == 0 else pair[::-1]):
            times[label].append(measure(over)[0])
    return {"start_us": times["start"], "tuned_us": times["tuned"],
            "start_median_us": statistics.median(times["start"]) if rounds else None,
            "tuned_median_us": statistics.median(times["tuned"]) if rounds else None}


def timed_measure(timer: StepTimer) -> Callable:
    """`search`'s measure over a StepTimer: (median µs, logits)."""
    def measure(overrides):
        times, logits = timer.measure(overrides)
        return statistics.median(times), logits
    return measure


def records_for(sites: list[Site], chosen: dict, trials: list[Trial], *, created_by: str, env) -> list:
    """One TuningRecord per accepted bucket: its config, the step's time with it (median of its confirming
    measurements), spread = max − min of them, trials = its confirming pairs."""
    from .records import make_record

    by_bid = {s.bid: s for s in sites}
    out = []
    for bid, cfg in chosen.items():
        tr = [t for t in trials if t.bid == bid and t.accepted and t.config == cfg][-1]
        s = by_bid[bid]
        out.append(make_record(s.template, s.template.bucket(s.key), cfg, median_us=statistics.median(tr.candidate_us),
                               spread_us=max(tr.candidate_us) - min(tr.candidate_us), trials=len(tr.gains_us),
                               created_by=created_by, live=env))
    return out


def say_to(stream=sys.stderr, quiet: bool = False) -> Callable:
    return (lambda m: None) if quiet else (lambda m: print(m, file=stream, flush=True))
