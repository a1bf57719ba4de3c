"""ONNX export of IR functions: onnx.checker accepts k31-tiny (every function) and the full-size
k31-pro decode graph (params as typed inputs, no data); attributes, dims, packed formats and fused
bodies are mapped as `ir/onnx_export.py` documents."""

from __future__ import annotations

import functools
import os

import onnx
import pytest
from onnx import TensorProto

from ir.core import Function, Node, Value
from ir.onnx_export import DOMAIN, OnnxExportError, export_function, function_to_onnx
from k31c.model.build import build_module
from k31c.model.presets import get_preset


@functools.lru_cache(maxsize=None)
def module(name: str):
    return build_module(get_preset(name))


def _attrs(node) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


@pytest.mark.parametrize("fn", ["prefill", "decode", "verify"])
def test_k31_tiny_functions_pass_the_checker(tmp_path, fn):
    path = tmp_path / f"{fn}.onnx"
    m = export_function(module("k31-tiny"), fn, str(path))
    onnx.checker.check_model(onnx.load(str(path)), full_check=True)
    assert all(n.domain == DOMAIN for n in m.graph.node)
    assert {o.domain: o.version for o in m.opset_import}[DOMAIN] == 1
    assert len(m.graph.node) == len(module("k31-tiny").functions[fn].nodes)
    assert not m.graph.initializer


def test_k31_pro_decode_without_weights_is_small_and_valid(tmp_path):
    path = tmp_path / "k31-pro.decode.onnx"
    m = export_function(module("k31-pro"), "decode", str(path))
    assert os.path.getsize(path) < 5 * 2**20  # 2.78T params, none of their data
    onnx.checker.check_model(onnx.load(str(path)))
    inputs = {i.name: i for i in m.graph.input}
    w1 = inputs["model.layers.1.block_sparse_moe.experts.w1.weight"]
    assert w1.type.tensor_type.elem_type == TensorProto.FLOAT4E2M1
    assert [d.dim_value for d in w1.type.tensor_type.shape.dim] == [896, 3072, 3584]
    assert "mxfp4" in w1.doc_string and "shard=expert" in w1.doc_string
    assert [d.dim_param for d in inputs["tokens"].type.tensor_type.shape.dim] == ["R"]
    assert [d.dim_param for d in inputs["cu_seqlens"].type.tensor_type.shape.dim] == ["R+1"]
    props = {p.key: p.value for p in m.metadata_props}
    assert props["k31c.function"] == "decode" and props["k31c.params_as"] == "inputs"


def test_attributes_are_mapped():
    m = function_to_onnx(module("k31-tiny"), "decode")
    by_op: dict[str, dict] = {}
    for n in m.graph.node:
        by_op.setdefault(n.op_type, _attrs(n))
    assert by_op["indexer_topk"]["topk"] == 16
    assert by_op["mla_attention"]["form"] == b"absorbed"
    assert by_op["rms_norm"]["eps"] == pytest.approx(1e-5)
    assert by_op["moe_router"]["renormalize"] == 1  # bool -> INT
    assert by_op["reshape"]["shape"] == [-1, 4, 64]  # list of ints -> INTS
    kl = function_to_onnx(module("kimi-linear-tiny"), "decode")
    gate = next(n for n in kl.graph.node if n.op_type == "kda_gate")
    assert "lower_bound" not in _attrs(gate)  # None attribute left out
    onnx.checker.check_model(kl)


def test_fused_body_becomes_a_graph_attribute():
    base = build_module(get_preset("k3-tiny"))
    f = base.functions["decode"]
    node = next(n for n in f.nodes if n.op == "sigmoid")
    a0 = Value("a0", node.inputs[0].type)
    inner = Node("sigmoid", [a0], {}, [])
    inner.outputs = [Value("y", node.outputs[0].type, inner)]
    node.body = Function("body", [a0], [inner], list(inner.outputs))
    m = function_to_onnx(base, "decode")
    onnx.checker.check_model(m)
    fused = next(n for n in m.graph.node if n.name == node.outputs[0].name)
    body = onnx.helper.get_attribute_value(next(a for a in fused.attribute if a.name == "body"))
    assert [n.op_type for n in body.node] == ["sigmoid"]
    assert body.input[0].name.endswith("::a0")  # body names are scoped under the fused node


def test_initializers_with_data_for_a_small_model():
    import torch

    mod = module("k3-tiny")
    gen = torch.Generator().manual_seed(0)
    weights = {n: torch.randn([int(d) for d in p.type.shape], generator=gen).to(p.type.dtype.torch_dtype)
               for n, p in mod.params.items()}
    m = function_to_onnx(mod, "prefill", weights=weights, params_as="initializers")
    onnx.checker.check_model(m)
    used = {v.name for n in mod.functions["prefill"].walk() for v in n.inputs if v.is_param}
    assert {i.name for i in m.graph.initializer} == used  # layer 0 has no AttnRes mix before it: 2 params unused
    emb = next(i for i in m.graph.initializer if i.name == "model.embed_tokens.weight")
    assert emb.data_type == TensorProto.BFLOAT16 and list(emb.dims) == [512, 256]
    with pytest.raises(OnnxExportError, match="need a torch tensor"):
        function_to_onnx(mod, "prefill", weights={}, params_as="initializers")


def test_bad_requests_are_clear():
    with pytest.raises(OnnxExportError, match="has no function @train; it has prefill, decode, verify"):
        function_to_onnx(module("k31-tiny"), "train")
    with pytest.raises(OnnxExportError, match="params_as"):
        function_to_onnx(module("k31-tiny"), "decode", params_as="external")


def test_graph_after_the_fusion_passes_exports_with_bodies():
    """Integration with passes/pipeline.py: fused nodes keep their replaced subgraph (DESIGN §3)."""
    from passes.pipeline import run_pipeline

    mod = build_module(get_preset("k31-tiny"))
    run_pipeline(mod)
    m = function_to_onnx(mod, "prefill")
    onnx.checker.check_model(m)
    fused = [n for n in m.graph.node if any(a.name == "body" for a in n.attribute)]
    assert fused, "the fusion passes produced no fused node"
    assert len(m.graph.node) < len(module("k31-tiny").functions["prefill"].nodes)
