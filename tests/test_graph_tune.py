"""`k31c tune --in-graph` (autotune_cache/graph_tune.py, graph_tune_cli.py): neighbours, the coordinate descent
against a synthetic step whose true costs the test knows (with noise), the logits check, failures, the deadline,
records; on the tiny artifact (CPU, eager steps): the step's sites, overrides reaching the launches, the command's
records / artifact configs, usage errors."""

from __future__ import annotations

import json
import os
import random
import time

import pytest
import torch

from autotune_cache import graph_tune as gt
from autotune_cache.records import CacheStore, Environment, TuningRecord
from autotune_cache.tune_cli import cli
from codegen.kernel import KernelTemplate, Tunable


def _template(family: str, tunables, constraints=lambda c, k, t: []):
    return KernelTemplate(family=family, backend="triton", ops=("gemm",), launch=lambda a, at, c: None,
                          key_dims=lambda a, at: {}, heuristic=lambda k, t: {}, tunables=tuple(tunables),
                          bucket=lambda key: dict(key), constraints=constraints)


def _site(t, config, key=None):
    key = key or {"M": 1}
    return gt.Site(t, key, f"{t.family}:{json.dumps(key, sort_keys=True)}", dict(config), "gemm")


def test_neighbours_move_one_declared_tunable_one_step_and_drop_illegal():
    t = _template("fam", [Tunable("A", (1, 2, 4, 8)), Tunable("B", ("x", "y")), Tunable("C", (1, 2))],
                  constraints=lambda c, k, tg: ["A=8 with B=y"] if c["A"] == 8 and c["B"] == "y" else [])
    got = gt.neighbours(t, {}, {"A": 4, "B": "y", "D": 3}, "cpu")
    # A: 2 (8 is illegal with B=y); B: x; C unset in the config and D not a tunable: not moved
    assert got == [{"A": 2, "B": "y", "D": 3}, {"A": 4, "B": "x", "D": 3}]
    assert gt.neighbours(t, {}, {"A": 3, "B": "x"}, "cpu") == [{"A": 3, "B": "y"}]  # 3 is off A's list
    # span 0: anywhere on the list, nearest first; span 2: two steps
    assert [c["A"] for c in gt.neighbours(t, {}, {"A": 2, "B": "x"}, "cpu", span=0) if c["B"] == "x"] == [1, 4, 8]
    assert [c["A"] for c in gt.neighbours(t, {}, {"A": 1, "B": "x"}, "cpu", span=2) if c["B"] == "x"] == [2, 4]
    raising = _template("r", [Tunable("A", (1, 2))], constraints=lambda c, k, tg: 1 / 0)
    assert gt.neighbours(raising, {}, {"A": 1}, "cpu") == []


class _SyntheticStep:
    """A step whose time is 500 µs + each site's cost of its config + Gaussian noise; logits depend on nothing
    but are NaN for configs listed in `nan`, and configs in `boom` raise (a candidate that fails to launch)."""

    def __init__(self, sites, costs, noise=0.3, nan=(), boom=(), seed=0):
        self.sites, self.costs, self.noise = sites, costs, noise
        self.nan, self.boom = [dict(c) for c in nan], [dict(c) for c in boom]
        self.rng = random.Random(seed)
        self.calls = []

    def __call__(self, overrides):
        self.calls.append(dict(overrides))
        us = 500.0
        logits = torch.ones(4)
        for s in self.sites:
            cfg = overrides.get(s.bid, s.config)
            if cfg in self.boom:
                raise RuntimeError("out of resources")
            if cfg in self.nan:
                logits = torch.full((4,), float("nan"))
            us += self.costs[s.family](cfg)
        return us + self.rng.gauss(0, self.noise), logits


def test_search_takes_true_gains_keeps_flat_sites_and_rejects_bad_candidates():
    ta = _template("a", [Tunable("BLOCK", (8, 16, 32, 64))])
    tb = _template("b", [Tunable("W", (2, 4, 8))])
    tc = _template("c", [Tunable("S", (1, 2, 3))])
    sa, sb, sc = _site(ta, {"BLOCK": 16}), _site(tb, {"W": 4}), _site(tc, {"S": 2})
    costs = {"a": lambda c: {8: 5.0, 16: 4.0, 32: 1.0, 64: 3.0}[c["BLOCK"]],  # 32 saves 3 µs; then 64 is worse
             "b": lambda c: 2.0,                                            # flat: every config the same
             "c": lambda c: 0.0}
    step = _SyntheticStep([sa, sb, sc], costs, nan=[{"S": 1}], boom=[{"S": 3}])
    chosen, trials = gt.search([sa, sb, sc], step, target="cpu", rounds=4, min_gain_us=1.0)
    assert chosen == {sa.bid: {"BLOCK": 32}}
    acc = [t for t in trials if t.accepted]
    assert len(acc) == 1 and len(acc[0].gains_us) == 4 and min(acc[0].gains_us) > 1.5
    assert not any(t.accepted for t in trials if t.bid == sb.bid)
    why = {json.dumps(t.changed): t.why for t in trials if t.bid == sc.bid}
    assert why['{"S": 1}'].startswith("logits differ") and why['{"S": 3}'].startswith("failed: RuntimeError")
    # the BLOCK 32 candidate was timed on the incumbents of the time: later sites on top of it
    later = [c for c in step.calls if sb.bid in c]
    assert later and all(c.get(sa.bid) == {"BLOCK": 32} for c in later)
    fin = gt.final(step, chosen, 4)
    assert 2.0 < fin["start_median_us"] - fin["tuned_median_us"] < 4.0


def test_search_second_pass_walks_on_and_tries_extra_overrides():
    t = _template("a", [Tunable("BLOCK", (8, 16, 32, 64))])
    s = _site(t, {"BLOCK": 8, "X": 0})
    costs = {"a": lambda c: {8: 9.0, 16: 6.0, 32: 3.0, 64: 4.0}[c["BLOCK"]] - (2.0 if c["X"] == 1 else 0.0)}
    step = _SyntheticStep([s], costs, noise=0.1)
    one, _ = gt.search([s], step, target="cpu", passes=1, rounds=3)
    assert one[s.bid]["BLOCK"] == 16  # one step per pass along a tunable
    many, _ = gt.search([s], step, target="cpu", passes=4, rounds=3, tries={"a": [{"X": 1}]})
    assert many[s.bid] == {"BLOCK": 32, "X": 1}


def test_search_stops_at_the_deadline_and_noise_alone_is_not_accepted():
    t = _template("a", [Tunable("BLOCK", (8, 16, 32))])
    s = _site(t, {"BLOCK": 16})
    step = _SyntheticStep([s], {"a": lambda c: 0.0}, noise=0.4, seed=3)
    chosen, trials = gt.search([s], step, target="cpu", deadline=time.perf_counter() - 1)
    assert chosen == {} and trials == [] and len(step.calls) == 1  # the reference step only
    for seed in range(5):
        step = _SyntheticStep([s], {"a": lambda c: 0.0}, noise=0.4, seed=seed)
        assert gt.search([s], step, target="cpu", rounds=4)[0] == {}


def test_records_for_carry_the_step_time_and_confirming_pairs():
    t = _template("a", [Tunable("BLOCK", (8, 16, 32))])
    s = _site(t, {"BLOCK": 16})
    tr = gt.Trial(s.bid, {"BLOCK": 32}, {"BLOCK": 32}, 0.0, 3.0, [3.1, 2.9, 3.3], [497.0, 496.0, 498.0, 497.5],
                  accepted=True)
    env = Environment(device="cpu", arch="cpu", k31c_version="0.1.0")
    rec, = gt.records_for([s], {s.bid: {"BLOCK": 32}}, [tr], created_by="k31c tune x --in-graph", env=env)
    assert rec.config == {"BLOCK": 32} and rec.bucket == {"M": 1} and rec.trials == 3
    assert rec.median_us == pytest.approx(497.25) and rec.spread_us == pytest.approx(2.0)
    TuningRecord.from_json(json.loads(rec.to_line()))


def test_kernel_alone_tuning_keeps_a_bucket_chosen_in_graph(tmp_path, capsys):
    from types import SimpleNamespace

    from autotune_cache.records import chosen_in_graph, make_record
    from autotune_cache.tuner import tune_problems

    t = _template("a", [Tunable("BLOCK", (8, 16, 32))])
    env = Environment(device="cpu", arch="cpu", k31c_version="0.1.0")
    store = CacheStore(str(tmp_path / "s.jsonl"))
    alone = make_record(t, {"M": 1}, {"BLOCK": 8}, median_us=3.0, spread_us=0.1, trials=5,
                        created_by="k31c tune build --kernel a --trials 5", live=env)
    graph = make_record(t, {"M": 2}, {"BLOCK": 32}, median_us=510.0, spread_us=1.0, trials=4,
                        created_by="k31c tune build --in-graph --batch 2 --seed 0", live=env)
    store.put_many([alone, graph])
    assert not chosen_in_graph(alone) and chosen_in_graph(graph) and not chosen_in_graph(None)
    prob = SimpleNamespace(template=t, bucket={"M": 2}, bid='a:{"M": 2}')
    assert tune_problems([prob], store=store, trials=3, progress=False, env=env) == []  # no study started
    assert "kept its record chosen inside the decode step" in capsys.readouterr().err
    assert [r.config for r in store.records()] == [{"BLOCK": 8}, {"BLOCK": 32}]


# ---- the tiny artifact, CPU (eager steps: the interpreter's kernels, one step ~10 s) ----------------------------
@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    from k31c.cli import main as k31c_main

    path = str(tmp_path_factory.mktemp("graph_tune") / "tiny")
    assert k31c_main(["compile", "--model", "k31-tiny", "-o", path]) == 0
    return path


def test_step_sites_list_the_launches_and_overrides_reach_them(artifact, tmp_path):
    from autotune_cache.graph_tune_cli import step_runtime
    from k31c.compiler import load_artifact

    from codegen.triton import _pdl
    from k31c.runtime.executor import PLAIN

    pdl_before = _pdl.enabled()
    from k31c.compiler import artifact_config

    art = load_artifact(artifact)
    rt = step_runtime(art, artifact, batch=1, context=40, store=CacheStore(str(tmp_path / "s.jsonl")))
    timer = gt.StepTimer(rt, 1, artifact_config(artifact).vocab_size)
    sites = gt.step_sites(timer.launches({}))
    fams = [s.family for s in sites]
    assert "moe_latent_tail" in fams and len(fams) == len({s.bid for s in sites})
    assert all(s.launches >= 1 and s.config for s in sites)
    tail = next(s for s in sites if s.family == "moe_latent_tail")
    cand = {**tail.config, "G_warps": 2 if tail.config["G_warps"] != 2 else 4}
    seen = []  # what the template's launch gets with the executor's plain-launch option on top of cand
    launch = tail.template.launch

    def spy(a, attrs, config):
        seen.append((dict(config), _pdl.enabled()))
        return launch(a, attrs, config)
    object.__setattr__(tail.template, "launch", spy)
    try:
        times, logits = timer.measure({tail.bid: {**cand, PLAIN: 1}})
    finally:
        object.__setattr__(tail.template, "launch", launch)
    assert len(times) == 1 and times[0] > 0 and torch.isfinite(logits).all()
    assert seen and all(c == cand and not on for c, on in seen) and _pdl.enabled() == pdl_before
    log = timer.launches({tail.bid: cand})
    assert {json.dumps(c, sort_keys=True) for _, _, b, c, _ in log if b == tail.bid} == {json.dumps(cand, sort_keys=True)}
    assert rt.interp.configs == timer.base and rt.interp.launch_log is None  # the runtime's own configs are back
    assert all(r.length == 40 for r in rt.requests.values())


def test_in_graph_command_writes_records_and_json(artifact, tmp_path):
    """--min-gain-us far above any gain and a 1 s budget: per batch of --batch the command runs its step, lists the
    sites no earlier batch visited, stops at the budget and accepts nothing (no record, artifact unchanged); the
    JSON names each batch's sites."""
    store, out = str(tmp_path / "store.jsonl"), str(tmp_path / "r.json")
    before = open(os.path.join(artifact, "kernels", "configs.json")).read()
    argv = [artifact, "--in-graph", "--kernel", "moe_latent_tail", "--batch", "1,2", "--context", "40", "--rounds",
            "1", "--min-gain-us", "1e9", "--budget-s", "1", "--store", store, "--json", out, "--no-progress"]
    assert cli(argv) == 0
    doc = json.load(open(out))
    assert doc["context"] == 40 and [b["batch"] for b in doc["batches"]] == [1, 2]
    one, two = ({s["bid"] for s in b["sites"]} for b in doc["batches"])
    assert one and two and not one & two  # batch 2's T=2 buckets: its own sites
    for b in doc["batches"]:
        assert b["timed_as"].startswith("eager") and b["accepted"] == [] and b["final"] is None
        assert {s["family"] for s in b["sites"]} == {"moe_latent_tail"}
    assert CacheStore(store).records() == []
    assert open(os.path.join(artifact, "kernels", "configs.json")).read() == before


@pytest.mark.parametrize("argv, want", [
    (["x", "--batch", "2"], "--batch applies to --in-graph tuning only"),
    (["x", "--try", "{}"], "--try applies to --in-graph tuning only"),
    (["x", "--in-graph", "--bucket", "{}", "--kernel", "gemm"], "--bucket applies to kernel-alone tuning"),
    (["x", "--in-graph", "--rounds", "0", "--context", "0"], "--rounds must be >= 1"),
    (["x", "--in-graph", "--batch", "1,x"], "--batch must be batch sizes separated by commas"),
    (["x", "--in-graph", "--batch", "0"], "--batch sizes must be >= 1"),
    (["x", "--in-graph", "--min-gain-us", "-1"], "--min-gain-us must be positive"),
    (["x", "--in-graph", "--try", "{bad"], "--try is not valid JSON"),
    (["x", "--in-graph", "--try", '{"gemm": 3}'], "expected a config override or a list of them"),
    (["x", "--in-graph", "--kernel", "gemm", "--try", '{"rms_norm": {"num_warps": 2}}'], "outside --kernel"),
])
def test_in_graph_usage_errors_name_the_problem(argv, want, capsys):
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert want in err
    if "--context" in argv:
        assert "--context must be >= 1" in err  # every problem at once
