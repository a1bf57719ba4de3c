"""The tuner on CPU (Triton interpreter, fp32): search-space pruning, a config faster than a slow default,
resume after an interruption without re-timing, and planted wrong / NaN / hanging candidates rejected.

The interpreter pays ~2 ms per program, so rms_norm's BLOCK_R (rows per program) changes a launch's
time by the program count: BLOCK_R=1 over 32 rows is 32 programs, BLOCK_R=32 one."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
import torch

from autotune_cache import tuner as tuner_mod
from autotune_cache.inputs import problem_from_sets
from autotune_cache.records import CacheStore, Environment, canonical_json
from autotune_cache.search import build_space
from codegen.kernel import Tunable
from codegen.registry import all_templates

ENV = Environment(device="cpu", arch="cpu", k31c_version="0.1.0", triton="3.7.1")


def _template(family):
    return {t.family: t for t in all_templates()}[family]


def _rms_problem(template, rows, d=32, n_sets=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    sets = [[torch.randn(rows, d, generator=g), 1 + 0.1 * torch.randn(d, generator=g)] for _ in range(n_sets)]
    return problem_from_sets(template, "rms_norm", sets, {"eps": 1e-5}, params=(1,))


def _study_trials(db, prob):
    import optuna

    return optuna.load_study(study_name=tuner_mod.study_name(prob, ENV), storage=f"sqlite:///{db}").trials


def test_space_drops_illegal_and_dominated_configs_and_keeps_the_heuristic():
    gemm = _template("gemm")
    key = {"M": 16, "N": 4096, "K": 7168, "x": "bf16", "w": "bf16", "gk": 0, "bi": 0}
    space = build_space(gemm, key, "h200")
    assert space.candidates[0] == gemm.heuristic(key, "h200")
    assert sum(space.illegal.values()) > 0, "the H200 shared-memory limit makes some tiles illegal"
    assert all(not gemm.constraints(c, key, "h200") for c in space.candidates)
    assert space.dominated > 0 and all(c["BLOCK_M"] <= 16 for c in space.candidates), \
        "BLOCK_M above next_pow2(M)=16 only adds masked rows"
    assert len(space.candidates) + sum(space.illegal.values()) + space.dominated <= space.product
    # an illegal heuristic is still the baseline (first), with its problems reported
    bad = dataclasses.replace(gemm, heuristic=lambda k, t: {**gemm.heuristic(k, t), "BLOCK_N": 256, "BLOCK_K": 256,
                                                             "num_stages": 5})
    s2 = build_space(bad, key, "h200")
    assert s2.base_problems and s2.candidates[0]["num_stages"] == 5
    assert all(not gemm.constraints(c, key, "h200") for c in s2.candidates[1:])
    # a declared cost estimate keeps the cheapest configs
    rms = _template("rms_norm")
    cheap = dataclasses.replace(rms, cost=lambda c, k, t: c["num_warps"])
    s3 = build_space(cheap, {"R": 64, "D": 32, "rot": 0, "bi": 0}, "cpu", keep_fraction=0.2, keep_min=1)
    assert s3.cost_pruned > 0 and {c["num_warps"] for c in s3.candidates[1:]} == {1}


def test_tuner_finds_a_config_faster_than_a_slow_default(tmp_path):
    rms = _template("rms_norm")
    slow = dataclasses.replace(rms, heuristic=lambda k, t: {**rms.heuristic(k, t), "BLOCK_R": 1})
    prob = _rms_problem(slow, rows=32)
    store = CacheStore(str(tmp_path / "s.jsonl"))
    r = tuner_mod.tune_problem(prob, target="cpu", env=ENV, store=store, trials=6, seed=0,
                               study_db=str(tmp_path / "st.db"), repeats=2, final_repeats=3)
    assert r.default_config["BLOCK_R"] == 1 and r.config["BLOCK_R"] > 1
    # 32 programs against at most 16: the margin is 2x on the re-measured medians, the real spread ~10x
    assert r.median_us < 0.5 * r.default_us, (r.median_us, r.default_us)
    assert r.record.config == r.config and r.record.median_us == r.median_us and r.record.trials == 6
    assert r.history and r.flops and r.bytes


def test_interrupted_study_resumes_without_re_timing(tmp_path, monkeypatch):
    prob = _rms_problem(_template("rms_norm"), rows=16)
    timed: list[tuple[str, int]] = []
    real = tuner_mod.measure
    def logged(p, c, repeats, warmup=1):
        timed.append((canonical_json(c), repeats))
        return real(p, c, repeats, warmup)

    monkeypatch.setattr(tuner_mod, "measure", logged)
    db = str(tmp_path / "st.db")
    kw = dict(target="cpu", env=ENV, trials=5, seed=3, study_db=db, repeats=1, final_repeats=2)

    def interrupt(study, trial):
        if len([t for t in study.trials if t.state.is_finished()]) >= 2:
            raise KeyboardInterrupt("simulated interruption")

    with pytest.raises(KeyboardInterrupt):
        tuner_mod.tune_problem(prob, callbacks=[interrupt], **kw)
    first = [t for t in _study_trials(db, prob) if t.state.is_finished()]
    assert len(first) == 2
    timed_first = {c for c, n in timed if n == 1}
    timed.clear()
    r = tuner_mod.tune_problem(prob, **kw)
    trials = _study_trials(db, prob)
    assert [t.number for t in trials] == list(range(5)) and r.trials == 5, "the trial count continues at 2"
    timed_second = [c for c, n in timed if n == 1]
    assert not set(timed_second) & timed_first, "a config measured before the interruption was timed again"
    assert len(timed_second) == len(set(timed_second))
    repeats = [t for t in trials if t.user_attrs.get("status") == "repeat"]
    assert all(trials[t.user_attrs["repeat_of"]].user_attrs["config"] == t.user_attrs["config"] for t in repeats)


def test_wrong_nan_and_hanging_candidates_are_rejected_and_never_recorded(tmp_path):
    rms = _template("rms_norm")

    def launch(a, attrs, config):
        y = rms.launch(a, attrs, config)
        if config["BLOCK_R"] == 4:
            return y * 1.5  # planted: wrong result
        if config["BLOCK_R"] == 2:
            return y * float("nan")
        if config["BLOCK_R"] == 8:
            time.sleep(5)  # planted: hangs past the per-candidate limit
        return y

    planted = dataclasses.replace(rms, launch=launch, tunables=(Tunable("BLOCK_R", (1, 2, 4, 8)),))
    prob = _rms_problem(planted, rows=8)
    store = CacheStore(str(tmp_path / "s.jsonl"))
    r = tuner_mod.tune_problems([prob], store=store, trials=5, progress=False, target="cpu", env=ENV,
                                study_db=str(tmp_path / "st.db"), repeats=1, final_repeats=2, timeout_s=1.0)[0]
    assert r.rejected == 2 and r.timeouts == 1
    assert r.config["BLOCK_R"] not in (2, 4, 8)
    statuses = {json.loads(t.user_attrs["config"])["BLOCK_R"]: t.user_attrs["status"]
                for t in _study_trials(str(tmp_path / "st.db"), prob) if "config" in t.user_attrs}
    assert statuses[4] == "rejected" and statuses[2] == "rejected" and statuses[8] == "timeout"
    recs = store.records()
    assert len(recs) == 1 and recs[0].config["BLOCK_R"] not in (2, 4, 8)


def test_a_finalist_timing_out_inside_the_interpreter_is_dropped_not_fatal(tmp_path, monkeypatch):
    """The interpreter re-raises a time-out inside a launch as its own InterpreterError: a finalist whose
    re-measurement times out that way is dropped with a note, the study still records its best finalist."""
    from triton.runtime.errors import InterpreterError

    rms = _template("rms_norm")
    planted = dataclasses.replace(rms, tunables=(Tunable("BLOCK_R", (1, 2, 4)),))
    prob = _rms_problem(planted, rows=8)
    real, seen = tuner_mod.measure, []

    def measure(problem, config, repeats, warmup=1):
        if config["BLOCK_R"] == 2 and config["BLOCK_R"] in seen:  # its second measurement: the finalist's
            try:
                raise tuner_mod.CandidateTimeout("finalist exceeded its limit")
            except tuner_mod.CandidateTimeout as e:
                raise InterpreterError(repr(e)) from e
        seen.append(config["BLOCK_R"])
        return real(problem, config, repeats, warmup)

    monkeypatch.setattr(tuner_mod, "measure", measure)
    store = CacheStore(str(tmp_path / "s.jsonl"))
    r = tuner_mod.tune_problems([prob], store=store, trials=3, progress=False, target="cpu", env=ENV,
                                study_db=str(tmp_path / "st.db"), repeats=1, final_repeats=2, timeout_s=30.0)[0]
    assert seen.count(2) == 1 and r.config["BLOCK_R"] != 2
    assert any('"BLOCK_R":2' in n and "re-measurement" in n for n in r.notes), r.notes
    assert len(store.records()) == 1


def test_new_study_is_warm_started_from_the_stored_record_then_the_heuristic(tmp_path):
    from autotune_cache.records import make_record

    rms = _template("rms_norm")
    prob = _rms_problem(rms, rows=8)
    store = CacheStore(str(tmp_path / "s.jsonl"))
    stored = {**rms.heuristic(prob.key, "cpu"), "BLOCK_R": 8, "num_warps": 2}
    store.put(make_record(rms, prob.bucket, stored, median_us=5.0, spread_us=0.1, trials=3, created_by="test",
                          live=ENV))
    db = str(tmp_path / "st.db")
    tuner_mod.tune_problem(prob, target="cpu", env=ENV, store=store, trials=2, study_db=db, repeats=1,
                           final_repeats=1)
    first, second = [json.loads(t.user_attrs["config"]) for t in _study_trials(db, prob)]
    assert first == stored and second == rms.heuristic(prob.key, "cpu")


def test_a_tunable_the_heuristic_leaves_unset_is_searched_and_never_forced_on_the_baseline(tmp_path):
    rms = _template("rms_norm")
    seen_configs = []

    def launch(a, attrs, config):  # like mla_sparse's SUB: absent from the heuristic, defaulted by the launcher
        seen_configs.append(dict(config))
        return rms.launch(a, attrs, {k: v for k, v in config.items() if k != "EXTRA"})

    t = dataclasses.replace(rms, launch=launch, tunables=(Tunable("BLOCK_R", (4, 8)), Tunable("EXTRA", (1, 2))))
    prob = _rms_problem(t, rows=8)
    r = tuner_mod.tune_problem(prob, target="cpu", env=ENV, trials=5, study_db=str(tmp_path / "st.db"), repeats=1,
                               final_repeats=1)
    assert {c.get("EXTRA") for c in seen_configs} == {None, 1, 2}, "the heuristic ran without EXTRA, the rest with it"
    assert r.default_config == rms.heuristic(prob.key, "cpu") and "EXTRA" not in r.default_config


def test_every_declared_search_space_can_be_enumerated():
    """A template whose tunables multiply past the enumeration limit is never tuned (`k31c tune` stops on
    it): every registered Triton and TVM template must stay within the limit."""
    from autotune_cache.search import MAX_ENUMERATE
    from codegen.registry import all_templates

    too_big = {t.family: t.space_size() for t in all_templates() if t.space_size() > MAX_ENUMERATE}
    assert too_big == {}, f"search spaces over {MAX_ENUMERATE} configs: {too_big}"


def test_candidates_measured_equal_are_ranked_by_their_config_not_compared_as_dicts(tmp_path, monkeypatch):
    """On the H200 two embedding configs once timed exactly 4.1 us each and ranking the finalists compared
    their config dicts (TypeError, the whole tune stopped): equal times now rank by the canonical config."""
    rms = _template("rms_norm")
    planted = dataclasses.replace(rms, tunables=(Tunable("BLOCK_R", (1, 2, 4)),))
    prob = _rms_problem(planted, rows=8)
    real = tuner_mod.measure

    def measure(problem, config, repeats, warmup=1):
        _, how = real(problem, config, 1, 0)   # still run: only the clock is replaced
        return [7.0] * repeats, how            # every candidate ties

    monkeypatch.setattr(tuner_mod, "measure", measure)
    store = CacheStore(str(tmp_path / "s.jsonl"))
    r = tuner_mod.tune_problems([prob], store=store, trials=3, progress=False, target="cpu", env=ENV,
                                study_db=str(tmp_path / "st.db"), repeats=2, final_repeats=2, timeout_s=30.0)[0]
    assert r.median_us == 7.0 and len(store.records()) == 1
