"""Tuning-record store (autotune_cache/): canonical keys, validation, hard/soft matching, locked atomic
writes under concurrent writers, miss policies, and `k31c cache ls|verify|prune` on a temporary store."""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp

import pytest

from autotune_cache import (CacheStore, Environment, MissPolicy, TuningMiss, default_store_path,
                            make_record, tune_command)
from autotune_cache.cli import add_cache_parser
from autotune_cache.records import KEYED_FIELDS, parse_lines

H200 = Environment(device="NVIDIA H200", arch="9.0", k31c_version="0.1.0", triton="3.6.0", tvm=None, cuda="13.0")


class FakeTemplate:
    """The parts of a KernelTemplate the store uses; `src` stands for the code the template runs."""

    def __init__(self, family="gemm", src="def kernel(): pass\n", backend="triton"):
        self.family, self.src, self.backend = family, src, backend

    def code(self):
        return self.src

    def bucket(self, key):
        return {k: 1 << (v - 1).bit_length() for k, v in key.items()}

    def heuristic(self, key, target):
        return {"BLOCK_N": 64, "num_warps": 4}


def rec(t=None, bucket=None, env=H200, config=None, median=10.0, created_at="2026-01-01T00:00:00Z", **kw):
    t = t or FakeTemplate()
    r = make_record(t, bucket or {"M": 16, "N": 64}, config or {"BLOCK_N": 128, "num_warps": 8}, median_us=median,
                    spread_us=0.5, trials=40, created_by="k31c tune build/x", live=env, **kw)
    return dataclasses.replace(r, created_at=created_at)


# ---- keys ---------------------------------------------------------------------------------------
def test_key_changes_with_every_keyed_field_and_only_those():
    base = rec()
    changed = {"family": "gemm2", "template_sha256": "0" * 64, "k31c_version": "0.1.1", "triton": "3.6.1",
               "tvm": "0.20.0", "cuda": "13.1", "device": "NVIDIA H100", "arch": "9.1", "bucket": {"M": 32, "N": 64}}
    assert set(changed) == set(KEYED_FIELDS)
    keys = {base.key}
    for name, value in changed.items():
        k = dataclasses.replace(base, **{name: value}).key
        assert k != base.key, f"key did not change with {name}"
        keys.add(k)
    assert len(keys) == len(KEYED_FIELDS) + 1
    for name, value in {"config": {"BLOCK_N": 32}, "median_us": 99.0, "spread_us": 3.0, "trials": 7,
                        "created_by": "other", "created_at": "2030-01-01T00:00:00Z"}.items():
        assert dataclasses.replace(base, **{name: value}).key == base.key, f"key changed with unkeyed {name}"
    assert dataclasses.replace(base, bucket={"N": 64, "M": 16}).key == base.key  # canonical: dict order irrelevant


def test_record_round_trips_through_a_line():
    r = rec()
    (ln,) = parse_lines(r.to_line())
    assert ln.error is None and ln.record == r and json.loads(r.to_line())["key"] == r.key


def test_corrupted_lines_are_rejected_with_reasons():
    good = rec().to_line()
    obj = json.loads(good)
    edited = dict(obj, bucket={"M": 32, "N": 64})  # content changed, key not recomputed
    missing = {k: v for k, v in obj.items() if k != "trials"}
    badtype = dict(obj, median_us=-1.0)
    lines = parse_lines("\n".join([good[:-20], json.dumps(edited), json.dumps(missing), json.dumps(badtype),
                                   "[1, 2]", good]))
    errs = [ln.error for ln in lines]
    assert "not valid JSON" in errs[0]
    assert "does not match the content" in errs[1]
    assert "missing field 'trials'" in errs[2]
    assert "'median_us' must be a positive number" in errs[3]
    assert "expected a JSON object" in errs[4]
    assert errs[5] is None and lines[5].lineno == 6


# ---- lookup -------------------------------------------------------------------------------------
def test_lookup_hit_hard_and_soft_mismatches(tmp_path):
    t = FakeTemplate()
    store = CacheStore(str(tmp_path / "s.jsonl"))
    bucket = {"M": 16, "N": 64}
    assert store.lookup(t, bucket, H200)[0] is None  # no file yet: a miss, not an error
    store.put(rec(t))
    cfg, st = store.lookup(t, bucket, H200)
    assert st.outcome == "hit" and cfg == {"BLOCK_N": 128, "num_warps": 8}

    def outcome(env=H200, template=t, b=bucket):
        c, s = store.lookup(template, b, env)
        return s.outcome, str(s)

    rep = dataclasses.replace
    # hard: template source, device, arch, triton major.minor, CUDA major, k31c minor -> rejected
    for env, why in [(rep(H200, device="NVIDIA H100"), "measured on NVIDIA H200 (9.0), this machine is NVIDIA H100"),
                     (rep(H200, arch="10.0"), "this machine is NVIDIA H200 (10.0)"),
                     (rep(H200, triton="3.7.1"), "triton 3.6.0 in the record, 3.7.1 here"),
                     (rep(H200, cuda="12.8"), "cuda 13.0 in the record, 12.8 here"),
                     (rep(H200, k31c_version="0.2.0"), "k31c 0.1.0 in the record, 0.2.0 here")]:
        o, msg = outcome(env)
        assert o == "miss" and "rejected" in msg and why in msg, (env, msg)
    o, msg = outcome(template=FakeTemplate(src="def kernel(): return 1\n"))
    assert o == "miss" and "template source changed" in msg
    assert outcome(b={"M": 32, "N": 64})[0] == "miss"
    # soft: k31c patch, CUDA minor, triton patch, tvm for a triton template -> used and reported
    for env, why in [(rep(H200, k31c_version="0.1.3"), "k31c 0.1.0 in the record, 0.1.3 here"),
                     (rep(H200, cuda="13.1"), "cuda 13.0 in the record, 13.1 here"),
                     (rep(H200, triton="3.6.2"), "triton 3.6.0"), (rep(H200, tvm="0.21"), "tvm None")]:
        o, msg = outcome(env)
        assert o == "soft" and "used despite" in msg and why in msg, (env, msg)
    # a tvm template is hard on tvm major.minor
    tv = FakeTemplate("gemm_tvm", backend="tvm")
    store.put(rec(tv, env=rep(H200, tvm="0.20.0")))
    assert store.lookup(tv, bucket, rep(H200, tvm="0.21.0"))[1].outcome == "miss"
    assert store.lookup(tv, bucket, rep(H200, tvm="0.20.1"))[1].outcome == "soft"


def test_lookup_takes_newest_and_skips_corrupt_lines(tmp_path):
    t = FakeTemplate()
    path = tmp_path / "s.jsonl"
    store = CacheStore(str(path))
    store.put(rec(t, config={"BLOCK_N": 32}, created_at="2026-01-01T00:00:00Z"))
    with open(path, "a") as f:
        f.write('{"family": "gemm", truncated\n')
    store.put(rec(t, config={"BLOCK_N": 256}, created_at="2026-03-01T00:00:00Z"))
    store.put(rec(t, config={"BLOCK_N": 64}, created_at="2026-02-01T00:00:00Z"))
    assert store.lookup(t, {"N": 64, "M": 16}, H200)[0] == {"BLOCK_N": 256}
    assert sum(ln.error is not None for ln in store.lines()) == 1


# ---- concurrent writers -------------------------------------------------------------------------
def _writer(path: str, wid: int, n: int):
    store = CacheStore(path)
    for i in range(n):
        store.put(rec(bucket={"M": wid, "N": i}, median=1.0 + i))


def test_concurrent_writers_do_not_corrupt_the_store(tmp_path):
    path = str(tmp_path / "c.jsonl")
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(path, w, 50)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    lines = CacheStore(path).lines()
    assert all(ln.error is None for ln in lines) and len(lines) == 200
    assert {(ln.record.bucket["M"], ln.record.bucket["N"]) for ln in lines} == {(w, i) for w in range(4) for i in range(50)}
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


# ---- store path ---------------------------------------------------------------------------------
def test_default_store_path(tmp_path, monkeypatch):
    monkeypatch.delenv("K31C_TUNING_CACHE", raising=False)
    assert default_store_path(H200).endswith("autotune_cache/records/nvidia-h200.jsonl")
    monkeypatch.setenv("K31C_TUNING_CACHE", str(tmp_path))
    assert default_store_path(H200) == str(tmp_path / "nvidia-h200.jsonl")
    monkeypatch.setenv("K31C_TUNING_CACHE", str(tmp_path / "mine.jsonl"))
    assert CacheStore().path == str(tmp_path / "mine.jsonl")


# ---- miss policies ------------------------------------------------------------------------------
def test_readonly_miss_names_kernel_bucket_and_tune_command(tmp_path):
    t = FakeTemplate("kda_decode")
    pol = MissPolicy("readonly", CacheStore(str(tmp_path / "s.jsonl")), live=H200, target="h200", artifact="build/k31")
    with pytest.raises(TuningMiss) as e:
        pol.config(t, {"M": 10, "N": 60})
    msg = str(e.value)
    cmd = "k31c tune build/k31 --kernel kda_decode --bucket '{\"M\":16,\"N\":64}'"
    assert "kernel kda_decode" in msg and '{"M":16,"N":64}' in msg and cmd in msg and e.value.command == cmd
    assert tune_command("gemm", {"K": 8}, target="h200") == "k31c tune --target h200 --kernel gemm --bucket '{\"K\":8}'"


def test_fallback_counts_misses_and_uses_records(tmp_path):
    t = FakeTemplate()
    store = CacheStore(str(tmp_path / "s.jsonl"))
    store.put(rec(t, bucket={"M": 16, "N": 64}))
    pol = MissPolicy("fallback", store, live=H200)
    assert pol.config(t, {"M": 3, "N": 3}) == t.heuristic(None, None)
    assert pol.config(t, {"M": 4, "N": 4}) == t.heuristic(None, None)
    assert pol.config(t, {"M": 9, "N": 50}) == {"BLOCK_N": 128, "num_warps": 8}
    assert pol.misses == {'gemm:{"M": 4, "N": 4}': 2} and sum(pol.hits.values()) == 1


def test_tune_policy_calls_the_hook_and_stores_the_record(tmp_path):
    t, calls = FakeTemplate(), []
    store = CacheStore(str(tmp_path / "s.jsonl"))

    def tuner(template, key, bucket, env):
        calls.append(bucket)
        return rec(template, bucket=bucket, env=env, config={"BLOCK_N": 16})

    assert MissPolicy("tune", store, live=H200, tuner=tuner).config(t, {"M": 5, "N": 7}) == {"BLOCK_N": 16}
    assert MissPolicy("tune", store, live=H200, tuner=tuner).config(t, {"M": 6, "N": 8}) == {"BLOCK_N": 16}
    assert calls == [{"M": 8, "N": 8}] and len(store.records()) == 1
    with pytest.raises(ValueError, match="tuner hook"):
        MissPolicy("tune", store, live=H200)


# ---- CLI ----------------------------------------------------------------------------------------
def _cli(argv):
    ap = argparse.ArgumentParser(prog="k31c")
    add_cache_parser(ap.add_subparsers(dest="command", required=True))
    args = ap.parse_args(argv)
    return args.func(args)


def test_cache_cli_ls_verify_prune(tmp_path, capsys):
    from codegen.registry import all_templates

    here = Environment.current()
    gemm = {t.family: t for t in all_templates()}["gemm"]
    path = tmp_path / "s.jsonl"
    store = CacheStore(str(path))
    store.put(rec(gemm, env=here, config={"BLOCK_N": 32}, created_at="2026-01-01T00:00:00Z"))  # older duplicate
    store.put(rec(gemm, env=here, config={"BLOCK_N": 64}, created_at="2026-02-01T00:00:00Z"))  # newest: kept
    store.put(rec(gemm, env=dataclasses.replace(here, device="NVIDIA H200", arch="9.0")))  # foreign
    store.put(rec(FakeTemplate("gemm", src="old source"), env=here))  # stale template source
    store.put(rec(FakeTemplate("no_such_kernel"), env=here))  # stale family
    with open(path, "a") as f:
        f.write("{not json\n")
    s = str(path)

    assert _cli(["cache", "ls", "--store", s]) == 0
    out = capsys.readouterr().out
    assert "ok" in out and "foreign" in out and "BLOCK_N=64" in out and "6 line(s)" in out

    assert _cli(["cache", "verify", "--store", s]) == 1
    out = capsys.readouterr().out
    assert f"{s}:6: corrupt: not valid JSON" in out and f"{s}:3: foreign: measured on NVIDIA H200" in out
    assert "template source of gemm changed" in out and "no kernel template named 'no_such_kernel'" in out
    assert f"{s}:1: duplicate" in out

    assert _cli(["cache", "prune", "--store", s, "--dry-run"]) == 0
    assert "would drop 4 line(s)" in capsys.readouterr().out and len(store.lines()) == 6
    assert _cli(["cache", "prune", "--store", s]) == 0
    kept = store.records()
    assert [r.config for r in kept] == [{"BLOCK_N": 64}, {"BLOCK_N": 128, "num_warps": 8}]
    assert all(ln.error is None for ln in store.lines())
    assert _cli(["cache", "verify", "--store", s, "--strict"]) == 0
    assert _cli(["cache", "prune", "--store", s, "--drop-foreign"]) == 0
    assert [r.device for r in store.records()] == [here.device]
    capsys.readouterr()
    assert _cli(["cache", "ls", "--store", str(tmp_path / "none.jsonl")]) == 2
    assert "no tuning store at" in capsys.readouterr().err


def test_cache_help_has_examples(capsys):
    for argv in (["cache", "--help"], ["cache", "ls", "--help"], ["cache", "verify", "--help"],
                 ["cache", "prune", "--help"]):
        with pytest.raises(SystemExit):
            _cli(argv)
        assert "examples:" in capsys.readouterr().out


def _load_as(name: str, path):
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_template_hash_covers_the_helper_modules_its_kernel_uses(tmp_path):
    """A kernel's record key hashes the helpers it calls (e.g. `_paging`), not only its own file; their
    docstrings and comments are not part of it."""
    import sys

    from autotune_cache.records import template_sha256
    from codegen.kernel import KernelTemplate

    helper = tmp_path / "helper.py"
    main = tmp_path / "main.py"
    main.write_text("from codegen.triton._hash_probe_helper import scale\n\n"
                    "def launch(a, attrs, config):\n    return scale(a)\n")
    hashes = []
    try:
        for body in ("def scale(x):\n    return 2 * x\n", "def scale(x):\n    return 3 * x\n",
                     '"""Module doc."""\n\n\ndef scale(x):\n    """Doubles."""\n    # a comment\n    return 2 * x  # why\n'):
            helper.write_text(body)
            _load_as("codegen.triton._hash_probe_helper", helper)
            mod = _load_as("codegen.triton._hash_probe_main", main)
            t = KernelTemplate(family="probe", backend="triton", ops=("rms_norm",), launch=mod.launch,
                               key_dims=lambda a, at: {}, heuristic=lambda k, t: {})
            assert "return 2 * x" in t.source() or "return 3 * x" in t.source()
            hashes.append(template_sha256(t))
    finally:
        sys.modules.pop("codegen.triton._hash_probe_helper", None)
        sys.modules.pop("codegen.triton._hash_probe_main", None)
    assert hashes[0] != hashes[1], "a code change in a helper stales the records"
    assert hashes[0] == hashes[2], "a docstring or comment edit does not"


def test_code_only_drops_docstrings_and_comments_but_keeps_strings():
    from codegen.kernel import code_only

    src = ('"""Module.\n\nMore."""\n\nimport os  # why\n\n\nclass A:\n    """Class doc."""\n\n'
           '    def f(self, x):\n        \'\'\'Method doc.\'\'\'\n        s = "# kept"  # dropped\n'
           '        return f"{x!r} # {s}", """not a docstring"""\n')
    assert code_only(src) == ('import os\nclass A:\n    def f(self, x):\n        s = "# kept"\n'
                              '        return f"{x!r} # {s}", """not a docstring"""')
