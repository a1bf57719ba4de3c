"""`k31c run ARTIFACT --miss-policy/--tuning-store`: the runtime resolves each kernel's config as a tuned
artifact config > a record of the tuning store > the miss policy (readonly stops with the `k31c tune`
command, fallback uses the declared heuristic and reports it). CPU, tiny artifact, the interpreter."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from autotune_cache import CacheStore, Environment, make_record
from codegen.registry import all_templates
from k31c import cli_serve
from k31c.cli import main

RUN = ["--prompt-tokens", "5,9,14", "--max-new-tokens", "1", "--json"]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("miss") / "tiny")
    assert main(["compile", "--model", "k31-tiny", "-o", path]) == 0
    return path


def run(artifact, *extra):
    cli_serve._POLICIES.clear()
    code = main(["run", artifact, *RUN, *extra])
    return code, [p.stats() for p in cli_serve._POLICIES]


def test_readonly_stops_at_the_first_bucket_without_a_record(artifact, tmp_path, capsys):
    code, _ = run(artifact, "--miss-policy", "readonly", "--tuning-store", str(tmp_path / "empty.jsonl"))
    err = capsys.readouterr().err
    assert code == 2
    assert "no tuning record for kernel" in err and f"k31c tune {artifact} --kernel" in err, err


def test_fallback_uses_a_record_where_the_store_has_one(artifact, tmp_path, capsys):
    store = str(tmp_path / "store.jsonl")
    code, stats = run(artifact, "--tuning-store", store)
    first = capsys.readouterr()
    assert code == 0 and not stats[0]["record_launches"]
    misses = stats[0]["config_misses"]
    assert misses and f"{sum(misses.values())} from declared heuristics" in first.err
    # plant a record (the heuristic's config, measured "here") for one missing bucket
    bid = sorted(misses)[0]
    family, bucket = bid.split(":", 1)
    bucket = json.loads(bucket)
    t = next(t for t in all_templates() if t.family == family)
    cfg = t.heuristic(bucket, "cpu")
    CacheStore(store).put(make_record(t, bucket, cfg, median_us=1.0, spread_us=0.1, trials=1, created_by="test",
                                      live=Environment.current()))
    code, stats = run(artifact, "--tuning-store", store)
    second = capsys.readouterr()
    assert code == 0
    assert stats[0]["record_launches"] == {bid: misses[bid]} and bid not in stats[0]["config_misses"]
    assert f"{misses[bid]} launches from 1 tuning records" in second.err, second.err
    assert second.out == first.out, "the same config from a record must give the same tokens"


def test_tuned_artifact_configs_are_kept_and_compile_heuristics_are_not():
    art = SimpleNamespace(configs={"a:{}": {"X": 1}, "b:{}": {"X": 2}},
                          config_sources={"a:{}": "tuned", "b:{}": "heuristic"})
    assert cli_serve._tuned_configs(art) == {"a:{}": {"X": 1}}


def test_default_policy_is_readonly_for_gpu_targets_and_fallback_for_cpu(artifact, tmp_path, capsys):
    """Issue 6: readonly is the deploy default (an artifact compiled for a GPU target); the CPU target, the
    development path and the README demo, falls back to the heuristics and reports them."""
    assert [cli_serve.default_miss_policy(t) for t in ("h200", "gb300", "mi355x", "cpu")] == \
        ["readonly"] * 3 + ["fallback"]
    code, stats = run(artifact, "--tuning-store", str(tmp_path / "empty.jsonl"))  # cpu artifact, no -policy
    assert code == 0 and stats[0]["policy"] == "fallback" and stats[0]["config_misses"]
