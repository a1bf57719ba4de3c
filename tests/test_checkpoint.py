"""Checkpoint loader and init-weights (SPEC §8, shared/CHECKPOINT.md)."""

from __future__ import annotations

import argparse
import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ir.packed import PackedMXFP4
from k31c.model.checkpoint import CheckpointError, load_checkpoint
from k31c.model.init_weights import add_init_weights_parser, init_weights, run_init_weights
from k31c.model.params import param_specs
from k31c.model.presets import get_preset

TINY = get_preset("k31-tiny")
KL_TINY = get_preset("kimi-linear-tiny")
_DT = {"bf16": torch.bfloat16, "f32": torch.float32}


# ------------------------------------------------------------------------------- file helpers

def _raw(path: Path, name: str) -> tuple[str, list[int], bytes]:
    """(dtype, shape, bytes) of one tensor, parsed straight from the safetensors file."""
    data = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    info = header[name]
    a, b = info["data_offsets"]
    return info["dtype"], info["shape"], data[8 + n + a:8 + n + b]


def _all_tensors(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _rewrite(d: Path, fn, file: str = "model.safetensors"):
    """Apply fn(dict) -> dict to one safetensors file of checkpoint dir d."""
    p = d / file
    tensors = fn(dict(load_file(str(p))))
    save_file(tensors, str(p), metadata={"format": "pt"})


def _write(cfg, tmp_path, sub="ck", **kw) -> Path:
    return init_weights(cfg, tmp_path / sub, **kw)


_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _decode_mxfp4_py(packed: bytes, scales: bytes, rows: int, k: int) -> list[list[float]]:
    """Pure-python MXFP4 decoder: low nibble = even column, value = E2M1 * 2^(scale - 127)."""
    out = []
    for r in range(rows):
        row = []
        for c in range(k):
            byte = packed[r * (k // 2) + c // 2]
            code = byte & 0xF if c % 2 == 0 else byte >> 4
            mag = _E2M1[code & 7]
            val = -mag if code & 8 else mag
            s = scales[r * (k // 32) + c // 32]
            row.append(val * 2.0 ** (s - 127))
        out.append(row)
    return out


def _expected_from_disk(cfg, d: Path, prefix: str) -> dict:
    """Canonical params rebuilt directly from the files (independent of the loader)."""
    disk = _all_tensors(d)
    exp = {}
    for s in param_specs(cfg):
        name = prefix + s.name
        if s.name.endswith((".experts.w1.weight", ".experts.w2.weight", ".experts.w3.weight")):
            stem = name[:-len("w1.weight")]
            w = s.name[-len("w1.weight"):-len(".weight")]
            E = s.shape[0]
            if s.format == "mxfp4":
                exp[s.name] = (torch.stack([disk[f"{stem}{e}.{w}.weight_packed"] for e in range(E)]),
                               torch.stack([disk[f"{stem}{e}.{w}.weight_scale"] for e in range(E)]))
            else:
                exp[s.name] = torch.stack([disk[f"{stem}{e}.{w}.weight"] for e in range(E)])
        elif s.init == "a_log":
            exp[s.name] = disk[name].reshape(-1)[: s.shape[0]]
        else:
            exp[s.name] = disk[name].reshape(s.shape)
    return exp


# ------------------------------------------------------------------------------- round trips

ROUND_TRIPS = [
    # cfg, prefix, conv, shards, nested, experts
    (TINY, "model.", "3d", 1, False, "bf16"),
    (TINY, "language_model.", "2d", 3, True, "mxfp4"),
    (TINY, "language_model.", "3d", 1, True, "bf16"),
    (TINY, "model.", "2d", 3, False, "mxfp4"),
    (TINY, "language_model.", "3d", 3, False, "bf16"),
    (TINY, "model.", "3d", 1, True, "mxfp4"),
    (KL_TINY, "model.", "3d", 1, False, "bf16"),
    (KL_TINY, "language_model.", "2d", 3, True, "mxfp4"),
]


@pytest.mark.parametrize("cfg,prefix,conv,shards,nested,experts", ROUND_TRIPS,
                         ids=[f"{c.name}-{p[:-1]}-{cv}-{s}sh-{'nested' if n else 'flat'}-{e}"
                              for c, p, cv, s, n, e in ROUND_TRIPS])
def test_round_trip(tmp_path, cfg, prefix, conv, shards, nested, experts):
    d = _write(cfg, tmp_path, seed=3, prefix=prefix, conv_shape=conv, experts_format=experts,
               num_shards=shards, nest_text_config=nested)
    files = sorted(p.name for p in d.iterdir())
    if shards == 1:
        assert files == ["config.json", "model.safetensors"]
    else:
        assert files == ["config.json", *[f"model-0000{i}-of-0000{shards}.safetensors" for i in (1, 2, 3)],
                         "model.safetensors.index.json"]
        index = json.loads((d / "model.safetensors.index.json").read_text())
        disk = _all_tensors(d)
        assert set(index["weight_map"]) == set(disk)
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in disk.values())
    raw_cfg = json.loads((d / "config.json").read_text())
    assert ("text_config" in raw_cfg) == nested
    if prefix == "language_model.":
        assert any(k.startswith("language_model.model.layers.") for k in _all_tensors(d))

    ck = load_checkpoint(d)
    assert ck.prefix == ("language_model." if prefix == "language_model." else "")
    assert ck.ignored == 0 and ck.notes == []
    assert ck.config.experts_format == experts
    assert ck.config == cfg.replace(experts_format=experts, name=ck.config.name)
    specs = param_specs(ck.config)
    assert set(ck.weights) == {s.name for s in specs}
    exp = _expected_from_disk(ck.config, d, ck.prefix)
    for s in specs:
        w = ck.weights[s.name]
        assert tuple(w.shape) == s.shape, s.name
        if s.format == "mxfp4":
            assert isinstance(w, PackedMXFP4), s.name
            assert torch.equal(w.packed, exp[s.name][0]) and torch.equal(w.scales, exp[s.name][1]), s.name
        else:
            assert w.dtype == _DT[s.format], s.name
            assert torch.equal(w, exp[s.name]), s.name


def test_written_layout_matches_checkpoint_md(tmp_path):
    H, P, K = TINY.kda_num_heads, TINY.kda_proj_dim, TINY.conv_kernel_size
    d = _write(TINY, tmp_path, prefix="language_model.", experts_format="mxfp4")
    t = load_file(str(d / "model.safetensors"))
    a = "language_model.model.layers.0.self_attn."
    assert t[a + "A_log"].shape == (128,) and t[a + "A_log"].dtype == torch.float32
    assert torch.all(t[a + "A_log"][H:] == 0) and torch.all(t[a + "A_log"][:H] != 0)
    assert t[a + "q_conv1d.weight"].shape == (P, 1, K) and t[a + "q_conv1d.weight"].dtype == torch.float32
    for n in ("dt_bias", "o_norm.weight"):
        assert t[a + n].dtype == torch.float32
    assert t[a + "q_proj.weight"].dtype == torch.bfloat16
    m = "language_model.model.layers.1.block_sparse_moe."
    assert t[m + "gate.e_score_correction_bias"].dtype == torch.float32
    ell, inter = TINY.latent_dim, TINY.moe_intermediate_size
    assert t[m + "experts.0.w1.weight_packed"].shape == (inter, ell // 2)
    assert t[m + "experts.0.w1.weight_scale"].shape == (inter, ell // 32)
    assert t[m + "experts.15.w2.weight_packed"].shape == (ell, inter // 2)
    assert t[m + "experts.0.w1.weight_packed"].dtype == torch.uint8
    assert "language_model.lm_head.weight" in t and not any(k.endswith("experts.0.w1.weight") for k in t)


def test_dtype_cast(tmp_path):
    d = _write(TINY, tmp_path, experts_format="mxfp4")
    ck = load_checkpoint(d, dtype=torch.float32)
    for s in param_specs(ck.config):
        w = ck.weights[s.name]
        if s.format == "mxfp4":
            assert isinstance(w, PackedMXFP4) and w.packed.dtype == torch.uint8
        else:
            assert w.dtype == torch.float32, s.name


def test_values_are_healthy(tmp_path):
    """Distributions per ParamSpec.init: finite, sensible scales (well-conditioned tiny model)."""
    ck = load_checkpoint(_write(TINY, tmp_path))
    w = {k: v.float() for k, v in ck.weights.items()}
    a = "model.layers.0.self_attn."
    assert all(torch.isfinite(v).all() for v in w.values())
    assert 0.9 < w["model.embed_tokens.weight"].std() < 1.1
    assert abs(w["model.norm.weight"].mean() - 1) < 0.05
    A = torch.exp(w[a + "A_log"])
    assert torch.all((A >= 1) & (A < 16))
    dt = torch.nn.functional.softplus(w[a + "dt_bias"].double())
    assert torch.all((dt > 0.9e-3) & (dt < 0.11))
    q = w[a + "q_proj.weight"]
    assert 0.3 < q.std() * TINY.hidden_size ** 0.5 < 1.0  # N(0, 1/in) * gain
    x = torch.randn(64, TINY.hidden_size)
    logits = x @ w["lm_head.weight"].T
    assert 0.3 < logits.std() < 2.0  # some spread, nothing saturating


def test_determinism(tmp_path):
    kw = dict(seed=7, prefix="language_model.", experts_format="mxfp4", num_shards=3, nest_text_config=True)
    a, b = _write(TINY, tmp_path, "a", **kw), _write(TINY, tmp_path, "b", **kw)
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for n in names:
        assert (a / n).read_bytes() == (b / n).read_bytes(), n
    c = _write(TINY, tmp_path, "c", **{**kw, "seed": 8})
    shard = "model-00001-of-00003.safetensors"
    assert (a / shard).read_bytes() != (c / shard).read_bytes()


# ------------------------------------------------------------------------------------- MXFP4

def test_mxfp4_matches_python_decoder(tmp_path):
    d = _write(TINY, tmp_path, experts_format="mxfp4")
    ck = load_checkpoint(d)
    f = d / "model.safetensors"
    ell, inter = TINY.latent_dim, TINY.moe_intermediate_size
    for layer, e, w, rows, k in ((1, 0, "w1", inter, ell), (2, 5, "w2", ell, inter), (7, 15, "w3", inter, ell)):
        stem = f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}."
        dt, shape, packed = _raw(f, stem + "weight_packed")
        assert dt == "U8" and shape == [rows, k // 2]
        dt, shape, scales = _raw(f, stem + "weight_scale")
        assert dt == "U8" and shape == [rows, k // 32]
        ref = torch.tensor(_decode_mxfp4_py(packed, scales, rows, k), dtype=torch.float64)
        got = ck.weights[f"model.layers.{layer}.block_sparse_moe.experts.{w}.weight"]
        deq = got.dequantize(torch.float64)[e]
        assert ref.abs().max() > 0
        assert torch.equal(deq, ref), (layer, e, w)


def test_gptoss_layout_loads_identically(tmp_path):
    d = _write(TINY, tmp_path, experts_format="mxfp4")
    before = load_checkpoint(d)

    def to_gptoss(t):
        out = {}
        for k, v in t.items():
            if k.endswith(".weight_packed"):
                out[k[:-len("weight_packed")] + "weight_blocks"] = v.reshape(v.shape[0], -1, 16).clone()
            elif k.endswith(".weight_scale"):
                out[k[:-len("weight_scale")] + "weight_scales"] = v
            else:
                out[k] = v
        return out

    _rewrite(d, to_gptoss)
    assert any(k.endswith("weight_blocks") for k in load_file(str(d / "model.safetensors")))
    after = load_checkpoint(d)
    assert after.config.experts_format == "mxfp4"
    for name, w in before.weights.items():
        if isinstance(w, PackedMXFP4):
            assert torch.equal(after.weights[name].dequantize(), w.dequantize()), name
            assert torch.equal(after.weights[name].packed, w.packed)
        else:
            assert torch.equal(after.weights[name], w), name


@pytest.mark.parametrize("stored,config_says", [("mxfp4", "bf16"), ("bf16", "mxfp4")])
def test_loaded_experts_format_wins(tmp_path, stored, config_says):
    d = _write(TINY, tmp_path, experts_format=stored)
    raw = TINY.replace(experts_format=config_says).to_hf()
    (d / "config.json").write_text(json.dumps(raw))
    ck = load_checkpoint(d)
    assert ck.config.experts_format == stored
    assert any("experts_format" in n for n in ck.notes)
    w = ck.weights["model.layers.1.block_sparse_moe.experts.w1.weight"]
    assert isinstance(w, PackedMXFP4) == (stored == "mxfp4")
    assert set(ck.weights) == {s.name for s in param_specs(ck.config)}


# ------------------------------------------------------------------------------------- A_log

def test_a_log_padded_128(tmp_path):
    H = TINY.kda_num_heads
    d = _write(TINY, tmp_path, prefix="language_model.")
    raw = load_file(str(d / "model.safetensors"))["language_model.model.layers.0.self_attn.A_log"]
    assert raw.shape == (128,)
    a = load_checkpoint(d).weights["model.layers.0.self_attn.A_log"]
    assert a.shape == (H,) and a.dtype == torch.float32 and torch.equal(a, raw[:H])


def test_a_log_kimi_linear_4d(tmp_path):
    H = KL_TINY.kda_num_heads
    d = _write(KL_TINY, tmp_path)
    flat = load_file(str(d / "model.safetensors"))["model.layers.0.self_attn.A_log"].clone()
    assert flat.shape == (H,)
    _rewrite(d, lambda t: {k: (v.reshape(1, 1, H, 1).clone() if k.endswith("A_log") else v) for k, v in t.items()})
    assert load_file(str(d / "model.safetensors"))["model.layers.0.self_attn.A_log"].shape == (1, 1, H, 1)
    a = load_checkpoint(d).weights["model.layers.0.self_attn.A_log"]
    assert a.shape == (H,) and torch.equal(a, flat)


def test_ignored_non_text_tensors(tmp_path):
    d = _write(TINY, tmp_path, prefix="language_model.")
    _rewrite(d, lambda t: {**t, "vision_tower.patch_embed.weight": torch.zeros(4, 4, dtype=torch.bfloat16),
                           "multi_modal_projector.linear_1.weight": torch.zeros(2, 2, dtype=torch.bfloat16)})
    ck = load_checkpoint(d)
    assert ck.ignored == 2 and ck.prefix == "language_model."


# ------------------------------------------------------------------------------------ errors

def _err(d, *needles) -> CheckpointError:
    with pytest.raises(CheckpointError) as ei:
        load_checkpoint(d)
    msg = str(ei.value)
    for n in needles:
        assert n in msg, f"{n!r} not in:\n{msg}"
    return ei.value


def _drop(name):
    return lambda t: {k: v for k, v in t.items() if k != name}


def test_missing_tensor_single_file(tmp_path):
    d = _write(TINY, tmp_path)
    name = "model.layers.3.self_attn.q_a_proj.weight"
    _rewrite(d, _drop(name))
    e = _err(d, repr(name), "model.safetensors")
    assert len(e.problems) == 1


def test_missing_tensor_sharded_names_file_from_index(tmp_path):
    d = _write(TINY, tmp_path, prefix="language_model.", num_shards=3)
    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    name = "language_model.model.layers.5.self_attn.dt_bias"
    shard = index[name]
    _rewrite(d, _drop(name), file=shard)
    e = _err(d, repr(name), shard)
    assert len(e.problems) == 1


def test_missing_expert_tensor(tmp_path):
    d = _write(TINY, tmp_path, experts_format="mxfp4")
    name = "model.layers.2.block_sparse_moe.experts.7.w2.weight_packed"
    _rewrite(d, lambda t: {k: v for k, v in t.items() if not k.startswith(name[:-len("weight_packed")])})
    _err(d, repr(name), "model.safetensors")


def test_wrong_shape(tmp_path):
    d = _write(TINY, tmp_path)
    name = "model.layers.3.self_attn.kv_b_proj.weight"
    _rewrite(d, lambda t: {**t, name: torch.zeros(10, 64, dtype=torch.bfloat16)})
    _err(d, repr(name), "model.safetensors", "[10, 64]", "[256, 64]")  # H*(nope+v) = 4*(32+32)


def test_wrong_conv_shape(tmp_path):
    d = _write(TINY, tmp_path)
    name = "model.layers.0.self_attn.k_conv1d.weight"
    _rewrite(d, lambda t: {**t, name: torch.zeros(256, 2, 4)})
    _err(d, repr(name), "[256, 2, 4]", "[256, 1, 4]", "[256, 4]")


def test_missing_shard_file(tmp_path):
    d = _write(TINY, tmp_path, num_shards=3)
    (d / "model-00002-of-00003.safetensors").unlink()
    _err(d, "model-00002-of-00003.safetensors", "does not exist")


def test_bad_json(tmp_path):
    d = _write(TINY, tmp_path)
    (d / "config.json").write_text('{"vocab_size": 512,,}')
    _err(d, str(d / "config.json"), "invalid JSON")


def test_no_config(tmp_path):
    d = _write(TINY, tmp_path)
    (d / "config.json").unlink()
    _err(d, "missing config.json")


def test_missing_directory(tmp_path):
    _err(tmp_path / "nope", "does not exist", str(tmp_path / "nope"))


def test_pickle_only_directory(tmp_path):
    d = tmp_path / "pt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(TINY.to_hf()))
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    _err(d, "pytorch_model.bin", "never unpickles", "safetensors")


def test_misnamed_extra_tensor(tmp_path):
    d = _write(TINY, tmp_path)
    _rewrite(d, lambda t: {**t, "model.layers.0.self_attn.q_proj.wieght": torch.zeros(2, dtype=torch.bfloat16)})
    e = _err(d, "model.layers.0.self_attn.q_proj.wieght", "match no parameter")
    assert len(e.problems) == 1


def test_many_unknown_tensors_listed_up_to_ten(tmp_path):
    d = _write(TINY, tmp_path)
    extra = {f"model.extra.{i:02d}.weight": torch.zeros(1, dtype=torch.bfloat16) for i in range(13)}
    _rewrite(d, lambda t: {**t, **extra})
    e = _err(d, "13 tensor(s)", "model.extra.09.weight", "and 3 more")
    assert "model.extra.12.weight" not in str(e)


def test_mixed_prefixes(tmp_path):
    d = _write(TINY, tmp_path)
    _rewrite(d, lambda t: {("language_model." + k if k.startswith("model.layers.7.") else k): v
                           for k, v in t.items()})
    _err(d, "mixes", "language_model.", "model.")


def test_contradicting_config_keys(tmp_path):
    d = _write(TINY, tmp_path)
    raw = json.loads((d / "config.json").read_text())
    raw["n_routed_experts"] = 8
    (d / "config.json").write_text(json.dumps(raw))
    _err(d, "n_routed_experts", "num_experts", "contradict", str(d / "config.json"))


def test_nested_config_contradiction(tmp_path):
    d = _write(TINY, tmp_path, nest_text_config=True)
    raw = json.loads((d / "config.json").read_text())
    raw["hidden_size"] = 512
    (d / "config.json").write_text(json.dumps(raw))
    _err(d, "hidden_size", "text_config")


def test_several_problems_reported_together(tmp_path):
    d = _write(TINY, tmp_path)
    gone, bad = "model.norm.weight", "model.layers.1.block_sparse_moe.gate.weight"

    def damage(t):
        t = {k: v for k, v in t.items() if k != gone}
        t[bad] = torch.zeros(3, 3, dtype=torch.bfloat16)
        t["model.layers.0.mlp.gate_prj.weight"] = torch.zeros(1, dtype=torch.bfloat16)
        return t

    _rewrite(d, damage)
    e = _err(d, repr(gone), repr(bad), "[3, 3]", "[16, 256]", "gate_prj")
    assert len(e.problems) == 3
    assert "3 problem(s)" in str(e)


def test_config_and_index_problems_together(tmp_path):
    d = _write(TINY, tmp_path, num_shards=3)
    (d / "config.json").write_text("not json")
    (d / "model-00003-of-00003.safetensors").unlink()
    e = _err(d, "invalid JSON", "model-00003-of-00003.safetensors")
    assert len(e.problems) == 2


# --------------------------------------------------------------------------------------- CLI

def _parser():
    p = argparse.ArgumentParser(prog="k31c")
    add_init_weights_parser(p.add_subparsers(dest="cmd"))
    return p


def test_cli_init_weights(tmp_path, capsys):
    out = tmp_path / "cli"
    args = _parser().parse_args(["init-weights", "--preset", "k31-tiny", "-o", str(out), "--mxfp4",
                                 "--k3-names", "--shards", "2", "--seed", "5"])
    assert args.func is run_init_weights
    assert args.func(args) == 0
    ck = load_checkpoint(out)
    assert ck.prefix == "language_model." and ck.config.experts_format == "mxfp4"
    assert "text_config" in json.loads((out / "config.json").read_text())
    assert len(list(out.glob("model-*-of-00002.safetensors"))) == 2
    assert str(out) in capsys.readouterr().out
    # existing non-empty directory: refused without --force, fine with it
    with pytest.raises(CheckpointError, match="--force"):
        run_init_weights(args)
    args = _parser().parse_args(["init-weights", "--preset", "k31-tiny", "-o", str(out), "--force"])
    assert run_init_weights(args) == 0
    ck = load_checkpoint(out)  # stale shards/index of the previous run were replaced
    assert ck.prefix == "" and ck.config.experts_format == "bf16"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


def test_cli_missing_parent(tmp_path):
    missing = tmp_path / "no" / "such"
    args = _parser().parse_args(["init-weights", "--preset", "k31-tiny", "-o", str(missing / "ck")])
    with pytest.raises(CheckpointError) as ei:
        run_init_weights(args)
    assert str(missing) in str(ei.value) and "does not exist" in str(ei.value)
    assert not (tmp_path / "no").exists()


def test_cli_help_has_example():
    p = _parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    assert "k31c init-weights --preset" in sub.choices["init-weights"].format_help()
