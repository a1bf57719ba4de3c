"""The tuner: one optuna study per (kernel template, shape bucket), every candidate checked, then timed.

    results = tune_problems(problems, target="h200", store=CacheStore(), study_db="tuning/studies.db")
    policy = MissPolicy("tune", tuner=make_tuner(module, weights, choices, target="cpu"))  # tune on a miss
Per problem (`autotune_cache/inputs.py` captures its operand sets and reference results):

1. space: `search.build_space` (legal configs, tile-padding dominance, template cost estimate);
2. study: `optuna.create_study(storage=sqlite:///<study_db>, load_if_exists=True)`, sampler
   `TPESampler(seed=seed)`, named `<family>:<bucket>:<template sha[:12]>:<device slug>` (a changed
   template or device starts a new study). A new study is warm-started: the stored record's config
   (committed or earlier tunes) and the declared heuristic are enqueued first; when the whole space
   is no larger than the trial budget every candidate is enqueued (exhaustive). `--trials N` is the
   study's total: a resumed study runs only N minus the trials it already holds, and a sampled config
   that an earlier trial measured (or rejected) is answered from that trial's attributes, not re-timed;
3. each new candidate: its results on fresh clones of two operand sets must match the reference
   (error limit: `max(floor, 4 x the heuristic's own error)`, capped; floats by relative L2 error,
   integer results by the fraction of differing elements) or it is rejected (pruned trial, counted,
   never recorded); then timed: warm-up, `repeats` measurements rotating over all operand sets,
   median. CUDA: device events around one pass over the sets (per-launch time = pass / sets); CPU:
   `time.perf_counter` around each launch;
4. time-out: `timeout_s` per candidate (check with compile, and timing) by SIGALRM in the main thread:
   Python code (the Triton interpreter, the compile driver, waits on ptxas) stops at the limit; one
   native call that never returns (an LLVM pass in libtriton) stops only when it returns. Off the main
   thread the limit is checked afterwards. A timed-out candidate is pruned and counted;
5. finalists: the 3 fastest measured configs and the heuristic are re-measured (`final_repeats`); the
   fastest median and its spread (max - min of its repeats) become `TuneResult.record` (make_record).
"""

from __future__ import annotations

import json
import math
import os
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field, fields

import torch

from .inputs import Problem, result_error
from .policy import bucket_id
from .records import (RECORDS_DIR, CacheStore, Environment, canonical_json, chosen_in_graph, device_slug, make_record,
                      template_sha256)
from .search import SearchSpace, build_space

FINALISTS = 3
ERROR_CAP = 0.1  # no candidate differing from the reference by more than this is accepted, whatever the heuristic does
INT_FLOOR = 0.01  # integer results (ids, selections): fraction of elements allowed to differ (ties)


class CandidateTimeout(Exception):
    """A candidate ran past its time limit."""


class Deadline:
    """`with Deadline(seconds, what):` raises CandidateTimeout when the block runs past `seconds`."""

    def __init__(self, seconds: float | None, what: str):
        self.seconds, self.what = seconds, what
        self.alarm = bool(seconds) and threading.current_thread() is threading.main_thread()

    def _fire(self, signum, frame):
        raise CandidateTimeout(f"{self.what} exceeded its {self.seconds:g} s limit")

    def __enter__(self):
        self.t0 = time.perf_counter()
        if self.alarm:
            self.old = signal.signal(signal.SIGALRM, self._fire)
            signal.setitimer(signal.ITIMER_REAL, self.seconds)
        return self

    def __exit__(self, exc_type, exc, tb):
        if self.alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.old)
        elif self.seconds and exc_type is None and time.perf_counter() - self.t0 > self.seconds:
            raise CandidateTimeout(f"{self.what} took {time.perf_counter() - self.t0:.1f} s, over its "
                                   f"{self.seconds:g} s limit (checked afterwards: not on the main thread)")
        return False


# ---- measuring ---------------------------------------------------------------------------------------
def measure(problem: Problem, config: dict, repeats: int, warmup: int = 1) -> tuple[list[float], str]:
    """(microseconds per launch, `repeats` times, rotating over every operand set (pools cloned once); how
    they were timed).

    On a GPU the launches over the operand sets are captured once as a CUDA graph and the graph is replayed
    between events: the device time of the kernels alone, as the runtime's graph replay runs them (timed
    launch by launch, a decode-sized kernel measures the Python launcher instead: 80-600 us per launch
    for kernels whose byte floor is 0.01-70 us, H200 2026-11-29). A launcher that cannot be captured
    (it reads device data on the host) is timed by events around eager launches."""
    args = [problem.fresh(i) for i in range(len(problem.sets))]
    dev = _device(problem)

    def launch_all():
        for i, a in enumerate(args):
            problem.launch(i, a, config)

    for _ in range(warmup):
        launch_all()
    if dev.type != "cuda":
        out = []
        for r in range(repeats):
            i = r % len(args)
            t0 = time.perf_counter()
            problem.launch(i, args[i], config)
            out.append((time.perf_counter() - t0) * 1e6)
        return out, "host clock"
    torch.cuda.synchronize(dev)
    graph = _captured(launch_all, dev)
    out = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay() if graph is not None else launch_all()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1e3 / len(args))
    return out, "cuda graph" if graph is not None else "events, eager launches"


def _captured(fn, dev):
    """fn's launches as a CUDA graph (after one run on a side stream, as capture requires), or None when
    they cannot be captured."""
    try:
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(dev).wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        g.replay()
        torch.cuda.synchronize(dev)
        return g
    except Exception:  # noqa: BLE001  a host read or a sync inside the launcher: time it eagerly
        torch.cuda.synchronize(dev)
        return None


def _device(problem: Problem) -> torch.device:
    return next((t.device for t in problem.sets[0].kernel_args if isinstance(t, torch.Tensor)), torch.device("cpu"))


def check(problem: Problem, config: dict) -> dict:
    """{"float": worst rel. error, "int": worst mismatch fraction} over one operand set of every captured
    node variant (distinct attrs) and at least two sets."""
    worst = {"float": 0.0, "int": 0.0}
    variants = {}
    for i, s in enumerate(problem.sets):
        variants.setdefault(repr(sorted((s.attrs or {}).items())), i)
    for i in sorted(set(variants.values()) | {0, min(1, len(problem.sets) - 1)}):
        err = result_error(problem.launch(i, problem.fresh(i), config), problem.sets[i].expected)
        worst = {k: max(worst[k], err[k]) for k in worst}
    return worst


def error_limits(problem: Problem, heuristic_err: dict | None) -> dict:
    narrow = any(isinstance(t, torch.Tensor) and t.dtype in (torch.bfloat16, torch.float16)
                 for t in problem.sets[0].kernel_args)  # 16-bit activations: bf16 rounding differs by order
    floors = {"float": 2e-2 if narrow else 1e-3, "int": INT_FLOOR}
    h = heuristic_err or {"float": 0.0, "int": 0.0}
    return {k: min(ERROR_CAP, max(floors[k], 4 * h[k])) for k in floors}


# ---- results -------------------------------------------------------------------------------------------
@dataclass
class TuneResult:
    family: str
    bucket: dict
    key: dict
    config: dict
    default_config: dict
    median_us: float
    spread_us: float
    default_us: float
    trials: int
    measured: int
    rejected: int
    timeouts: int
    seconds: float
    space: str
    sites: list
    flops: float | None
    bytes: float | None
    history: list = field(default_factory=list)  # (trial number, median us or None) in trial order
    record: object = None  # the TuningRecord of the winner
    notes: list = field(default_factory=list)
    op: str = ""  # the IR op the kernel implements

    @property
    def bid(self) -> str:
        return bucket_id(self.family, self.bucket)

    @property
    def speedup(self) -> float:
        return self.default_us / self.median_us

    def to_json(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("record", "history")}
        return {**out, "bucket_id": self.bid, "speedup_vs_default": self.speedup, "tuning_s": self.seconds,
                "record_key": self.record.key if self.record else None}


class Progress:
    """One status line on stderr: trials done of all planned, current study, best, ETA."""

    def __init__(self, total: int, stream=None, width: int = 24):
        self.total, self.done, self.t0, self.width = max(1, total), 0, time.perf_counter(), width
        self.stream = stream if stream is not None else sys.stderr

    def step(self, label: str, best: float | None):
        self.done += 1
        el = time.perf_counter() - self.t0
        eta = el / self.done * max(0, self.total - self.done)
        fill = int(self.width * min(1.0, self.done / self.total))
        best_s = f"best {best:.1f} us" if best is not None and math.isfinite(best) else "best -"
        self.stream.write(f"\r[{'#' * fill}{'.' * (self.width - fill)}] {self.done}/{self.total} trials "
                          f"{_fmt_s(el)} elapsed, ETA {_fmt_s(eta)}  {label[:60]}  {best_s}\x1b[K")
        self.stream.flush()

    def close(self):
        self.stream.write("\n")
        self.stream.flush()


def _fmt_s(s: float) -> str:
    return f"{int(s // 60)}m{int(s % 60):02d}s" if s >= 60 else f"{s:.0f}s"


# ---- one study -----------------------------------------------------------------------------------------
def study_name(problem: Problem, env: Environment) -> str:
    sha = template_sha256(problem.template)[:12]
    return f"{problem.template.family}:{canonical_json(problem.bucket)}:{sha}:{env.slug}"


def tune_problem(problem: Problem, *, target: str, env: Environment, store: CacheStore | None = None,
                 trials: int = 20, seed: int = 0, study_db: str | None = None, timeout_s: float | None = 60.0,
                 repeats: int = 10, final_repeats: int = 20, progress: Progress | None = None,
                 created_by: str = "k31c tune", callbacks=()) -> TuneResult:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    t_start = time.perf_counter()
    fam = problem.template.family
    space = build_space(problem.template, problem.key, target)
    names = space.names
    heur = space.base
    try:
        with Deadline(timeout_s, f"{fam} heuristic check"):
            h_err = check(problem, heur)
    except Exception as e:  # the baseline itself fails: report, and keep tuning against the floor limits
        h_err = None
        heur_note = f"heuristic config {heur} failed: {type(e).__name__}: {e}"
    limits = error_limits(problem, h_err)
    notes = [] if h_err is not None else [heur_note]
    if h_err is not None and any(h_err[k] > limits[k] for k in limits):
        notes.append(f"the heuristic config's own error {h_err} exceeds the cap {ERROR_CAP}: candidates are "
                     f"held to {limits}")
    storage = f"sqlite:///{study_db}" if study_db else None
    study = optuna.create_study(study_name=study_name(problem, env), storage=storage, direction="minimize",
                                sampler=optuna.samplers.TPESampler(seed=seed), load_if_exists=True)
    if not study.trials:
        _warm_start(study, space, problem, env, store, trials)
    seen: dict[str, tuple] = {}  # canonical config -> (median or None, trial number, status)
    for t in study.trials:
        if "config" in t.user_attrs and t.user_attrs.get("status") in ("measured", "rejected", "timeout", "failed"):
            seen.setdefault(t.user_attrs["config"], (t.user_attrs.get("median_us"), t.number, t.user_attrs["status"]))

    def objective(trial):
        sampled = {n: trial.suggest_categorical(n, space.values(n)) for n in names}
        config = space.nearest(sampled)
        cj = canonical_json(config)
        trial.set_user_attr("config", cj)
        if cj in seen:  # measured (or rejected) before, in this run or an interrupted one: not re-timed
            value, number, status = seen[cj]
            trial.set_user_attr("status", "repeat")
            trial.set_user_attr("repeat_of", number)
            if value is None:
                raise optuna.TrialPruned(f"repeat of trial {number} ({status})")
            trial.set_user_attr("median_us", value)
            return value
        t0 = time.perf_counter()
        try:
            with Deadline(timeout_s, f"{fam} candidate {cj}"):
                err = check(problem, config)
                if any(err[k] > limits[k] for k in limits):
                    status, detail = "rejected", f"wrong result: error {err} over the limit {limits}"
                else:
                    times, _ = measure(problem, config, repeats)
                    status, detail = "measured", ""
        except Exception as e:  # a config that does not compile or launch: counted as failed, never recorded
            timeout = _timeout_in(e)  # a launcher may wrap the alarm's exception in its own error
            status, detail = ("timeout", str(timeout)) if timeout else ("failed", f"{type(e).__name__}: {str(e)[:300]}")
        trial.set_user_attr("status", status)
        trial.set_user_attr("seconds", time.perf_counter() - t0)
        if status != "measured":
            trial.set_user_attr("detail", detail)
            seen[cj] = (None, trial.number, status)
            raise optuna.TrialPruned(detail)
        med = statistics.median(times)
        trial.set_user_attr("median_us", med)
        trial.set_user_attr("spread_us", max(times) - min(times))
        trial.set_user_attr("error", err)
        seen[cj] = (med, trial.number, status)
        return med

    def on_trial(study_, trial):
        if progress is not None:
            best = min((v for v, _, s in seen.values() if v is not None), default=None)
            progress.step(f"{fam} {canonical_json(problem.bucket)}", best)

    finished = [t for t in study.trials if t.state.is_finished()]  # enqueued (waiting) trials are not done
    remaining = max(0, trials - len(finished))
    if remaining:
        study.optimize(objective, n_trials=remaining, callbacks=[on_trial, *callbacks], catch=())
    heur_ok = h_err is not None and all(h_err[k] <= limits[k] for k in limits)
    return _finish(problem, study, space, env, heur_ok, seen, final_repeats, timeout_s, created_by,
                   time.perf_counter() - t_start, notes)


def _timeout_in(e: BaseException | None) -> CandidateTimeout | None:
    while e is not None and not isinstance(e, CandidateTimeout):
        e = e.__cause__ or e.__context__
    return e


def _warm_start(study, space: SearchSpace, problem: Problem, env: Environment, store, trials: int):
    """Enqueue the config of the newest usable record (the store being written, then the committed
    `autotune_cache/records/<device>.jsonl`), the heuristic, and every candidate when they fit."""
    configs = []
    for s in [store, CacheStore(os.path.join(RECORDS_DIR, f"{env.slug}.jsonl"))]:
        stored = s.lookup(problem.template, problem.bucket, env)[0] if s is not None else None
        if stored is not None and space.contains(stored):
            configs.append(stored)
    configs.append(space.base)
    if len(space.candidates) <= trials:
        configs += space.candidates
    done = set()
    for c in configs:
        params = {n: c.get(n) for n in space.names}
        if canonical_json(params) not in done:
            done.add(canonical_json(params))
            study.enqueue_trial(params)


def _finish(problem, study, space, env, heur_ok, seen, final_repeats, timeout_s, created_by, seconds, notes):
    import optuna

    fam = problem.template.family
    # ties (equal medians: coarse timers, or a search space whose configs run the same code) go to the
    # config's canonical JSON: never a comparison of two dicts
    ranked = sorted((v, cj) for cj, (v, _, s) in seen.items() if s == "measured")
    measured = [(v, json.loads(cj)) for v, cj in ranked]
    if not measured:
        raise RuntimeError(f"{fam} {canonical_json(problem.bucket)}: no candidate passed the reference check "
                           f"and ran ({len(study.trials)} trials); see the study's trial attributes")
    finalists = [c for _, c in measured[:FINALISTS]]
    heur = space.base
    if heur_ok and canonical_json(heur) not in {canonical_json(c) for c in finalists}:
        finalists.append(heur)  # always re-measured beside the finalists: the tuned/default ratio
    remeasured = []
    for c in finalists:
        try:
            with Deadline(timeout_s, f"{fam} finalist {canonical_json(c)}"):
                ts, how = measure(problem, c, final_repeats)
                remeasured.append((statistics.median(ts), ts, c, how))
        except Exception as e:  # a time-out may reach here wrapped (the interpreter re-raises it as its own error)
            if not (_timeout_in(e) or isinstance(e, RuntimeError)):
                raise
            notes.append(f"finalist {canonical_json(c)} failed its re-measurement: {_timeout_in(e) or e}")
    if not remeasured:
        raise RuntimeError(f"{fam} {canonical_json(problem.bucket)}: every finalist failed its re-measurement")
    med, times, best, how = min(remeasured, key=lambda r: r[0])
    notes.append(f"timed by {how}")
    default = next((r for r in remeasured if canonical_json(r[2]) == canonical_json(heur)), None)
    if default is None:
        notes.append("the heuristic config did not pass the check: no default time")
    states = [t.state for t in study.trials]
    statuses = [t.user_attrs.get("status") for t in study.trials]
    flops, nbytes = problem.cost()
    record = make_record(problem.template, problem.bucket, best, median_us=med, spread_us=max(times) - min(times),
                         trials=max(1, len(study.trials)), created_by=created_by, live=env)
    history = [(t.number, t.value if t.state == optuna.trial.TrialState.COMPLETE else None) for t in study.trials]
    return TuneResult(fam, dict(problem.bucket), dict(problem.key), dict(best), dict(heur), med,
                      max(times) - min(times), default[0] if default else float("nan"), len(states),
                      statuses.count("measured"), statuses.count("rejected") + statuses.count("failed"),
                      statuses.count("timeout"), seconds, space.summary(), problem.sites, flops, nbytes,
                      history, record, notes, problem.node.op)


def kept_in_graph(store: CacheStore, p: Problem, env) -> bool:
    """True (and said on stderr) when the store's record for the problem's bucket was chosen inside the decode step
    (`records.chosen_in_graph`): timing the kernel alone would overwrite a choice the whole step's time made."""
    _, status = store.lookup(p.template, p.bucket, env)
    if not chosen_in_graph(status.record):
        return False
    print(f"\nk31c tune: {p.bid}: kept its record chosen inside the decode step ({status.record.created_by[:80]}); "
          f"`k31c tune ARTIFACT --in-graph` revisits it", file=sys.stderr)
    return True


def tune_problems(problems: list[Problem], *, store: CacheStore | None, trials: int, progress: bool = True,
                  deadline: float | None = None, **kw) -> list[TuneResult]:
    """Tune each problem in turn, storing each record as its study ends; a problem no candidate passes is
    reported on stderr and left out; no study starts after `deadline` (a `time.perf_counter()` value)."""
    bar = Progress(trials * len(problems)) if progress else None
    out = []
    try:
        for i, p in enumerate(problems):
            if deadline is not None and time.perf_counter() > deadline:
                print(f"\nk31c tune: time budget spent: {len(problems) - i} studies not started "
                      f"({', '.join(q.bid for q in problems[i:])})", file=sys.stderr)
                break
            if store is not None and kept_in_graph(store, p, kw.get("env")):
                continue
            try:
                r = tune_problem(p, store=store, trials=trials, progress=bar, **kw)
            except (RuntimeError, ValueError) as e:
                print(f"\nk31c tune: {p.bid}: not tuned: {e}", file=sys.stderr)
                continue
            if store is not None:
                store.put(r.record)
            out.append(r)
    finally:
        if bar is not None:
            bar.close()
    return out


def make_tuner(module, weights, choices, *, target: str, device="cpu", compute_dtype=torch.float32,
               trials: int = 12, study_db: str | None = None, timeout_s: float | None = 60.0, seed: int = 0,
               shapes: dict | None = None, batch_invariant: bool = False):
    """A `MissPolicy(mode="tune", tuner=...)` hook over a compiled module: on a miss it captures the
    operands of the nodes of that kernel whose bucket is the missing one and tunes them."""
    from .inputs import capture_problems

    def tuner(template, key, bucket, env):
        probs = capture_problems(module, weights, choices, device=device, compute_dtype=compute_dtype,
                                 batch_invariant=batch_invariant, families={template.family}, bucket=bucket,
                                 seed=seed, shapes=shapes)
        if not probs:
            raise RuntimeError(f"no node of {template.family} in this module has bucket {canonical_json(bucket)} "
                               "at the capture shapes; tune it from an artifact with `k31c tune`")
        return tune_problem(probs[0], target=target, env=env, trials=trials, seed=seed, study_db=study_db,
                            timeout_s=timeout_s, created_by=f"MissPolicy(tune) {device_slug(env.device)}").record

    return tuner
