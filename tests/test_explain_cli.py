"""The `explain`, `inspect` and `export-onnx` commands through an argparse parser built from the
functions k31c/cli.py wires in (add_explain_parser, add_inspect_parser, add_export_onnx_parser,
add_plan_args + resolve_plan_options)."""

from __future__ import annotations

import argparse
import json
import os

import onnx

from k31c.plan import add_plan_args, make_plan, plan_options, resolve_plan_options
from k31c.plan.cli import add_explain_parser, add_export_onnx_parser, add_inspect_parser
from tests.test_artifact_manifest import make_artifact


def run(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="k31c")
    sub = ap.add_subparsers(dest="command", required=True)
    add_explain_parser(sub)
    add_inspect_parser(sub)
    add_export_onnx_parser(sub)
    args = ap.parse_args(argv)
    return args.func(args)


def test_explain_json_round_trips(capsys):
    assert run(["explain", "--model", "k31-pro", "--target", "gb300", "--tp", "8", "--dcp", "8", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan == make_plan(plan_options("k31-pro", target="gb300", tp=8, dcp=8))
    assert plan["cache"]["per_token"] == 16_992 and plan["layout"] == {**plan["layout"], "tp": 8, "dcp": 8, "ep": 8}
    assert "ep" in plan["flags"]["defaulted"] and "tp" not in plan["flags"]["defaulted"]


def test_explain_prints_resolved_flags_first_then_tables(capsys):
    assert run(["explain", "--model", "k31-pro", "--target", "gb300", "--tp", "8", "--dcp", "8"]) == 0
    out = capsys.readouterr().out
    sections = ["resolved flags", "\nmodel\n", "\ntarget\n", "weights per rank", "cache bytes per token",
                "KDA state", "memory per rank", "capacity", "decode cache reads", "head vs token sharding",
                "\nkernels\n", "\nnotes\n"]
    at = [out.index(s) for s in sections]
    assert at == sorted(at)
    for want in ("--tp                  8", "16,992", "10,080", "48.5%", "132/576", "crossover: token sharding from",
                 "kernels: not selected (compile selects them)", "2.78T total"):
        assert want in out, want


def test_explain_plan_only_target(capsys):
    assert run(["explain", "--model", "k31-pro", "--target", "tpu-v7x", "--tp", "16", "--dcp", "16"]) == 0
    out = capsys.readouterr().out
    assert "plan only: no kernel backend for tpu-v7x" in out and "2 TensorCore" in out and "4 SparseCore" in out


def test_explain_reports_every_problem_and_exits_2(capsys):
    rc = run(["explain", "--model", "k31-tiny", "--target", "h300", "--tp", "3", "--dcp", "2",
              "--max-context", "9999"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("k31c explain: error:")
    for want in ("unknown target 'h300'", "--dcp 2 does not divide --tp 3", "KDA heads", "longer than the model's"):
        assert want in err, want


def test_explain_custom_target_file(tmp_path, capsys):
    from tests.test_targets import GOOD

    path = tmp_path / "npu.json"
    path.write_text(json.dumps(GOOD))
    assert run(["explain", "--model", "k31-tiny", "--target-file", str(path), "--tp", "2", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["target"]["name"] == "my-npu" and plan["kernels"]["note"] == "plan only: no kernel backend for my-npu"


def test_plan_args_on_another_parser():
    """What `k31c compile` does: add_plan_args to its own parser, resolve_plan_options on the result."""
    p = argparse.ArgumentParser()
    add_plan_args(p)
    p.add_argument("-o", "--out")
    opts = resolve_plan_options(p.parse_args(["--model", "k31-tiny", "--tp", "2", "--key-cache", "mxfp4", "-o", "x"]))
    assert (opts.tp, opts.dcp, opts.ep, opts.key_cache, opts.target.name) == (2, 1, 2, "mxfp4", "cpu")


def test_inspect_shows_manifest_memory_kernels(tmp_path, capsys):
    root = make_artifact(tmp_path / "art")
    assert run(["inspect", root]) == 0
    out = capsys.readouterr().out
    for want in ("model", "k31-tiny", "layout", "tp=1 dcp=1 ep=1", "passes", "fuse_packed_projection",
                 "integrity: OK", "per-rank memory (plan.json)", "free for cache", "kernels (kernels/configs.json)",
                 "rms_norm_D256_BLOCK256_w4", '{"BLOCK": 256, "num_warps": 4}', "gemm_M8_N512_BN64_w4", "heuristic"):
        assert want in out, want
    assert run(["inspect", root, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["problems"] == [] and doc["memory"]["weights_bytes"] > 0
    assert "kda_decode_H4_D64_BV64_w4" in doc["kernels"]


def test_inspect_tampered_and_missing(tmp_path, capsys):
    root = make_artifact(tmp_path / "art")
    with open(os.path.join(root, "plan.json"), "a") as f:
        f.write(" ")
    assert run(["inspect", root]) == 1
    assert "plan.json was modified" in capsys.readouterr().out
    assert run(["inspect", str(tmp_path)]) == 2
    assert "manifest.json is missing" in capsys.readouterr().err


def test_export_onnx_from_model_and_artifact(tmp_path, capsys):
    out = tmp_path / "tiny.onnx"
    assert run(["export-onnx", "--model", "k31-tiny", "--function", "prefill", "-o", str(out)]) == 0
    onnx.checker.check_model(onnx.load(str(out)))
    root = make_artifact(tmp_path / "art")
    out2 = tmp_path / "phase.onnx"
    assert run(["export-onnx", "--artifact", root, "--phase", "model", "-o", str(out2)]) == 0
    assert onnx.load(str(out2)).graph.name == "k31-tiny.decode"
    capsys.readouterr()
    assert run(["export-onnx", "--artifact", root, "--phase", "fuse", "-o", str(out2)]) == 2
    assert "no such IR dump" in capsys.readouterr().err
    assert run(["export-onnx", "--model", "k31-tiny", "--phase", "bogus", "-o", str(tmp_path / "no" / "x.onnx")]) == 2
    err = capsys.readouterr().err
    assert "--phase 'bogus' is neither 'model', a phase (parallel, fuse" in err and "folder" in err
    assert run(["export-onnx", "--model", "k31-tiny", "--function", "train", "-o", str(out)]) == 2
    assert "--function 'train': the module has prefill, decode, verify" in capsys.readouterr().err
