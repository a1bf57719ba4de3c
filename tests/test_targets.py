"""The target database: every issue-9 target present and sane, every figure sourced, unknown targets
list the known ones, and a user target from JSON is validated with every problem reported."""

from __future__ import annotations

import json
import os
import re

import pytest

from k31c.targets import TARGETS, TargetError, get_target, known_targets, load_target_file
from k31c.targets import database

ISSUE_TARGETS = {"gb300", "b300", "b200", "rubin", "h200", "h100", "mi355x", "tpu-v7x", "ppu-810e", "ppu-m890", "cpu"}

GOOD = {"name": "my-npu", "vendor": "Acme", "description": "Acme NPU-1", "source": "Acme datasheet v1",
        "memory_bytes": 64 * 10**9, "hbm_bandwidth": 2e12, "compute_units": 64, "compute_unit_kind": "core",
        "peak_flops": {"bf16": 4e14, "fp8": 8e14}, "native_formats": ["fp8"], "link_bandwidth": 2e11,
        "scaleup_size": 16, "topology": "ring of 16", "backends": [], "estimates": ["hbm_bandwidth"]}


def test_every_issue_target_is_known_and_sane():
    assert set(known_targets()) == ISSUE_TARGETS
    for name, t in TARGETS.items():
        assert t.name == name and t.memory_bytes > 0 and t.hbm_bandwidth > 0 and t.link_bandwidth > 0
        assert t.peak_flops["bf16"] > 0 and t.scaleup_size >= 1 and t.source
        for f in t.native_formats:
            assert t.peak_flops[f] >= t.peak_flops["bf16"], f"{name}: native {f} slower than bf16"


def test_every_figure_line_in_the_database_carries_a_source_comment():
    src = open(database.__file__, encoding="utf-8").read().splitlines()
    figure = re.compile(r'(memory_bytes|hbm_bandwidth|compute_units|link_bandwidth|scaleup_size|"fp32"|"bf16"|'
                        r'"fp8"|"mxfp4"|"nvfp4"|"hbm_bandwidth")\s*[=:]\s*[\d(]')
    lines = [ln for ln in src if figure.search(ln)]
    assert len(lines) > 60
    missing = [ln.strip() for ln in lines if "#" not in ln]
    assert not missing, f"figures without a source comment: {missing}"


def test_kinds_of_hardware():
    assert TARGETS["h200"].native_formats == ("fp8",) and TARGETS["h100"].native_formats == ("fp8",)
    for n in ("b200", "b300", "gb300", "rubin"):
        assert set(TARGETS[n].native_formats) == {"fp8", "mxfp4", "nvfp4"}
    assert set(TARGETS["mi355x"].native_formats) == {"fp8", "mxfp4"}
    assert TARGETS["gb300"].scaleup_size == 72 and TARGETS["h200"].scaleup_size == 8
    assert TARGETS["tpu-v7x"].core_kinds == {"SparseCore": 4, "TensorCore": 2}
    assert "triton-nvidia:sm_90a" in TARGETS["h200"].backends
    assert "triton-amd:gfx950" in TARGETS["mi355x"].backends
    for n in ("tpu-v7x", "ppu-810e", "ppu-m890", "rubin"):
        assert TARGETS[n].plan_only and "plan only" in TARGETS[n].backend_summary()
    assert not TARGETS["cpu"].plan_only and TARGETS["cpu"].emulates_all_formats


def test_h200_uses_the_measured_figures():
    h = TARGETS["h200"]
    assert h.memory_bytes == 143771 * 2**20
    assert h.rate("bf16") == 779e12 and h.rate("fp8") == 1337e12 and h.bandwidth == 4.2e12
    assert h.rate("mxfp4") == 779e12  # no native MXFP4: dequantised, runs at the bf16 rate
    assert TARGETS["gb300"].rate("nvfp4") == 15e15


def test_unknown_target_lists_the_known_ones():
    with pytest.raises(TargetError) as e:
        get_target("h300")
    for n in ISSUE_TARGETS:
        assert n in str(e.value)
    assert "--target-file" in str(e.value)


def test_user_target_from_json(tmp_path):
    path = tmp_path / "my-npu.json"
    path.write_text(json.dumps(GOOD))
    t = load_target_file(str(path))
    assert t.name == "my-npu" and t.plan_only and t.is_native("fp8") and t.estimates == ("hbm_bandwidth",)
    assert get_target(str(path)) == t
    nameless = dict(GOOD)
    del nameless["name"]
    (tmp_path / "npu2.json").write_text(json.dumps(nameless))
    assert load_target_file(str(tmp_path / "npu2.json")).name == "npu2"


def test_bad_user_target_reports_every_problem(tmp_path):
    bad = dict(GOOD, memory=1, native_formats=["fp8", "int4", "nvfp4"], backends=["cuda"], scaleup_size=0,
               measured={"hbm": 1})
    del bad["topology"]
    bad["peak_flops"] = {"fp8": -1, "fp16": 1}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(TargetError) as e:
        load_target_file(str(path))
    msg = str(e.value)
    for want in ("unknown key 'memory'", "missing key 'topology'"):
        assert want in msg
    # the first round stops at structure; fix it and the value problems are all listed together
    bad["topology"] = "x"
    del bad["memory"]
    path.write_text(json.dumps(bad))
    with pytest.raises(TargetError) as e:
        load_target_file(str(path))
    msg = str(e.value)
    for want in ("scaleup_size must be positive", "peak_flops: unknown format 'fp16'", "peak_flops.fp8 must be",
                 "needs a 'bf16' rate", "'int4' is not one of", "native format nvfp4 has no peak_flops",
                 "backends: 'cuda'", "measured: unknown key 'hbm'"):
        assert want in msg, want
    assert len(e.value.problems) >= 8


def test_target_file_errors(tmp_path):
    with pytest.raises(TargetError, match="does not exist"):
        load_target_file(str(tmp_path / "none.json"))
    p = tmp_path / "broken.json"
    p.write_text("{not json")
    with pytest.raises(TargetError, match="not valid JSON"):
        load_target_file(str(p))
    p.write_text("[1, 2]")
    with pytest.raises(TargetError, match="JSON object"):
        load_target_file(str(p))
    assert os.path.basename(database.__file__) == "database.py"
