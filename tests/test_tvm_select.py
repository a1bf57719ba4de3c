"""`--target cpu` selects a TVM template exactly where the CPU bench measured it faster than the torch
reference (codegen/tvm/_build.cpu_rule, codegen/select.py), and a k31-tiny artifact run through the TVM
kernels gives the reference interpreter's logits (prefill, then decode steps through fused.kda_decode)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("tvm", reason="apache-tvm is a test extra; the TVM backend needs it")

from safetensors.torch import load_file  # noqa: E402

from codegen.registry import all_templates  # noqa: E402
from codegen.select import select_kernels  # noqa: E402
from codegen.tvm import _build, gemm, kda_decode, norms  # noqa: E402
from k31c.cli import main  # noqa: E402
from tests.helpers import assert_close_rel  # noqa: E402

TVM_OPS = {"linear": "tvm_gemm", "fused.packed_linear": "tvm_packed_gemm", "rms_norm": "tvm_rms_norm",
           "attn_res_mix": "tvm_attn_res_mix", "fused.attn_res_mix_norm": "tvm_attn_res_mix_norm",
           "fused.kda_decode": "tvm_kda_decode", "fused.embedding_rms_norm": "tvm_embedding_rms_norm"}
TOKENS = "3,141,59,265,358,97,93,238,46,264,338"


@pytest.fixture(scope="module")
def tiny_cpu_module():
    from k31c.model.build import build_module
    from k31c.model.presets import get_preset
    from passes.base import PassContext
    from passes.pipeline import run_pipeline

    module = build_module(get_preset("k31-tiny"))
    run_pipeline(module, PassContext(target="cpu"))
    return module


def _families(choices) -> dict:
    out: dict = {}
    for c in choices:
        if c.op in TVM_OPS:
            out.setdefault(c.op, set()).add(c.kernel)
    return out


def test_selection_follows_a_preference_file(tiny_cpu_module, tmp_path, monkeypatch):
    pref = {"preference": {"tvm_rms_norm": {"prefer": True, "speedup": 2.5},
                           "tvm_gemm": {"prefer": False, "speedup": 0.4}}}
    path = tmp_path / "tvm.json"
    path.write_text(json.dumps(pref))
    monkeypatch.setenv("K31C_TVM_PREFERENCE", str(path))
    choices = select_kernels(tiny_cpu_module, "cpu")
    fams = _families(choices)
    assert fams["rms_norm"] == {"tvm_rms_norm"} and fams["linear"] == {"gemm"}
    assert fams["fused.kda_decode"] == {"kda_decode"}  # not measured in this file: the Triton template
    lin = next(c for c in choices if c.op == "linear")
    assert _build.cpu_rule("tvm_gemm", "cpu").startswith("measured slower than the torch reference on cpu "
                                                         "(speedup 0.40x")
    assert lin.template.backend == "triton"
    assert _families(select_kernels(tiny_cpu_module, "h200"))["rms_norm"] == {"rms_norm"}


def test_committed_measurements_decide_the_cpu_selection(tiny_cpu_module):
    with open(_build.PREFERENCE_FILE, encoding="utf-8") as f:
        pref = json.load(f)["preference"]
    families = {t.family for t in all_templates() if t.backend == "tvm"}
    assert families == set(TVM_OPS.values()) | {"tvm_gemm_mxfp4", "tvm_attn_res_mix"}
    assert families <= set(pref), "every TVM family has a CPU measurement"
    fams = _families(select_kernels(tiny_cpu_module, "cpu"))
    for op, family in TVM_OPS.items():
        if op in fams:
            assert (family in fams[op]) == bool(pref[family]["prefer"]), (op, fams[op], pref[family])


def test_tiny_artifact_through_tvm_kernels_matches_reference(tmp_path, monkeypatch):
    monkeypatch.setenv("K31C_TVM", "all")
    art = tmp_path / "tiny-tvm"
    assert main(["compile", "--model", "k31-tiny", "--target", "cpu", "-o", str(art)]) == 0
    used = {s["kernel"] for s in json.loads((art / "kernels" / "selection.json").read_text())}
    assert set(TVM_OPS.values()) - {"tvm_attn_res_mix"} <= used  # every mix is fused with its norm in k31-tiny
    ref, dec = tmp_path / "ref.st", tmp_path / "dec.st"
    assert main(["logits", "--model", "k31-tiny", "--tokens", TOKENS, "--out", str(ref)]) == 0
    calls = {}
    for mod, fn in ((gemm, "gemm"), (norms, "rms_norm"), (norms, "attn_res_mix"), (kda_decode, "kda_decode")):
        def counted(*a, _f=getattr(mod, fn), _n=fn, **k):
            calls[_n] = calls.get(_n, 0) + 1
            return _f(*a, **k)
        monkeypatch.setattr(mod, fn, counted)
    assert main(["logits", "--artifact", str(art), "--tokens", TOKENS, "--out", str(dec), "--decode-from", "9"]) == 0
    assert set(calls) == {"gemm", "rms_norm", "attn_res_mix", "kda_decode"}, calls  # every TVM family ran
    assert_close_rel(load_file(str(dec))["logits"], load_file(str(ref))["logits"], 2e-5, "TVM prefill + decode")
