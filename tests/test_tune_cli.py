"""`k31c tune` on a tiny compiled artifact (CPU, interpreter): records written, kernels/configs.json and the
manifest updated so the artifact still loads, PNGs written; the MissPolicy tune hook; usage errors."""

from __future__ import annotations

import json
import os

import pytest

from autotune_cache.records import CacheStore, Environment, TuningRecord
from autotune_cache.tune_cli import cli

SHAPES = json.dumps({"prefill": {"B": 4, "R": 2}, "decode": {"R": 2}})


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    from k31c.cli import main as k31c_main

    path = str(tmp_path_factory.mktemp("tune") / "tiny")
    assert k31c_main(["compile", "--model", "k31-tiny", "-o", path]) == 0
    return path


def _norm_family(artifact) -> str:
    """The kernel family the artifact runs rms_norm with (a Triton or a TVM template)."""
    sel = json.load(open(os.path.join(artifact, "kernels", "selection.json")))
    return next(s["kernel"] for s in sel if s["op"] == "rms_norm" and s["function"] == "decode")


def test_tune_artifact_writes_records_configs_and_plots(artifact, tmp_path):
    from k31c.artifact import verify
    from k31c.compiler import load_artifact

    store, plots = str(tmp_path / "store.jsonl"), str(tmp_path / "plots")
    fam = _norm_family(artifact)
    argv = [artifact, "--kernel", fam, "--function", "decode", "--trials", "3", "--shapes", SHAPES,
            "--store", store, "--plot", plots, "--json", str(tmp_path / "r.json"), "--no-progress"]
    assert cli(argv) == 0
    recs = CacheStore(store).records()
    # one bucket at R=2: the indexer's 96-wide norm (hidden 256's input norm runs in the embedding's kernel,
    # passes/embedding_norm.py; the other hidden norms in the AttnRes kernels)
    assert len(recs) == 1 and {r.family for r in recs} == {fam}
    for r in recs:
        TuningRecord.from_json(r.to_json())
        assert r.device == Environment.current().device and r.trials == 3
    configs = json.load(open(os.path.join(artifact, "kernels", "configs.json")))
    tuned = {k: v for k, v in configs.items() if v["source"] == "tuned"}
    assert {v["record"] for v in tuned.values()} == {r.key for r in recs}
    assert all(tuned[f"{fam}:{json.dumps(r.bucket, sort_keys=True)}"]["config"] == r.config for r in recs)
    plan = json.load(open(os.path.join(artifact, "plan.json")))
    assert sum(1 for k in plan["kernels"]["kernels"] if k.get("cache") == "hit") == 1
    assert verify(artifact)[1] == [], "the manifest must hash the updated configs, plan and tuning/ files"
    art = load_artifact(artifact)
    assert all(art.configs[k] == v["config"] for k, v in tuned.items())
    pngs = sorted(f for f in os.listdir(plots) if f.endswith(".png"))
    assert len(pngs) == 2 and "ceilings.png" in pngs  # the study's plot and the ceilings
    assert all(os.path.getsize(os.path.join(plots, f)) > 1000 for f in pngs)
    doc = json.load(open(tmp_path / "r.json"))
    assert len(doc["results"]) == 1 and doc["ceilings"]["bandwidth"] > 0
    # a second run resumes the finished studies: no new trial, the same records' configs
    assert cli(argv) == 0
    import optuna

    db = f"sqlite:///{os.path.join(artifact, 'tuning', 'studies.db')}"
    assert all(len(optuna.load_study(study_name=s.study_name, storage=db).trials) == 3
               for s in optuna.get_all_study_summaries(storage=db))


def test_miss_policy_tune_hook_produces_a_record(artifact, tmp_path):
    from autotune_cache import MissPolicy
    from autotune_cache.inputs import capture_problems
    from autotune_cache.tuner import make_tuner
    from k31c.compiler import load_artifact

    art = load_artifact(artifact)
    fam = _norm_family(artifact)
    choices = [c for c in art.choices if c.function == "decode"]
    prob = capture_problems(art.module, art.weights, choices, families={fam}, shapes=json.loads(SHAPES))[0]
    hook = make_tuner(art.module, art.weights, choices, target="cpu", trials=2, shapes=json.loads(SHAPES),
                      study_db=str(tmp_path / "st.db"))
    policy = MissPolicy("tune", CacheStore(str(tmp_path / "s.jsonl")), tuner=hook)
    cfg = policy.config(prob.template, prob.key)
    assert policy.stats()["tuned"] == {prob.bid: 1}
    assert policy.store.records()[0].config == cfg and policy.store.records()[0].bucket == prob.bucket


@pytest.mark.parametrize("argv, want", [
    (["--no-progress"], "give an artifact directory or --target T"),
    (["x", "--target", "h200"], "not both"),
    (["x", "--bucket", "{bad"], "--bucket needs --kernel"),
    (["x", "--kernel", "gemm", "--bucket", "[1]"], "must be a JSON object"),
    (["x", "--trials", "0"], "--trials must be >= 1"),
])
def test_usage_errors_name_the_problem(argv, want, capsys):
    assert cli(argv) == 2
    assert want in capsys.readouterr().err


def test_tune_target_compiles_in_a_temp_dir_and_writes_records_only(artifact, tmp_path):
    store = str(tmp_path / "cpu.jsonl")
    fam = _norm_family(artifact)  # the same selection as a fresh compile for cpu
    argv = ["--target", "cpu", "--model", "k31-tiny", "--kernel", fam, "--function", "decode", "--trials", "2",
            "--shapes", SHAPES, "--store", store, "--no-progress"]
    assert cli(argv) == 0
    recs = CacheStore(store).records()
    assert len(recs) == 1 and {r.family for r in recs} == {fam}
    assert recs[0].created_by.startswith(f"k31c tune --target cpu --model k31-tiny --kernel {fam}")


def test_decode_context_shape_sets_the_captured_context(artifact):
    """{"decode": {"R": 1, "context": n}}: the decode step is captured after a prefill of n tokens, so the
    context-keyed kernels (indexer top-k, sparse MLA) are tuned at a serving context, not the short default."""
    from autotune_cache.inputs import capture_problems
    from k31c.compiler import load_artifact

    art = load_artifact(artifact)
    choices = [c for c in art.choices if c.function == "decode"]
    sel = next(c.template.family for c in choices if c.op == "fused.indexer_select")
    short, = capture_problems(art.module, art.weights, choices, families={sel}, shapes={"decode": {"R": 1}})[:1]
    long_, = capture_problems(art.module, art.weights, choices, families={sel},
                              shapes={"decode": {"R": 1, "context": 100}})[:1]
    assert short.key["L"] == 17 and long_.key["L"] == 101, (short.key, long_.key)
