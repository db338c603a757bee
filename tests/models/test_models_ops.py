"""One small single-node graph per op (family by family) against onnxruntime, in fp32, and the
decomposed paths (taken under any non-Exact arithmetic) against the same reference."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest
from _model_helpers import (
    F32,
    I64,
    PassThrough,
    Recorder,
    assert_close,
    run_ort,
    run_ours,
    single_node,
)
from onnx import TensorProto, numpy_helper

from kcverify.kernels.spec import DEFAULT_ULPS
from kcverify.models.ops import lookup

rng = np.random.default_rng(0)


def f(*shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def pos(*shape: int) -> np.ndarray:
    return (rng.random(shape) + 0.1).astype(np.float32)


def i64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


# (id, op, inputs, constant inputs, outputs, opset, attrs)
Case = tuple[str, str, dict[str, np.ndarray], dict[str, Any], list[tuple[str, int]], int, dict[str, Any]]
CASES: list[Case] = [
    # linear
    ("matmul_2d", "MatMul", {"a": f(3, 4)}, {"b": f(4, 5)}, [("y", F32)], 17, {}),
    ("matmul_bcast", "MatMul", {"a": f(2, 3, 4, 6)}, {"b": f(6, 5)}, [("y", F32)], 17, {}),
    ("matmul_batched", "MatMul", {"a": f(2, 3, 4, 6), "b": f(2, 3, 6, 5)}, {}, [("y", F32)], 17, {}),
    ("matmul_vec", "MatMul", {"a": f(2, 4, 6), "b": f(6)}, {}, [("y", F32)], 17, {}),
    ("gemm", "Gemm", {"a": f(3, 4)}, {"b": f(5, 4), "c": f(5)}, [("y", F32)], 17,
     {"transB": 1, "alpha": 0.5, "beta": 2.0}),
    ("gemm_transA", "Gemm", {"a": f(4, 3)}, {"b": f(4, 5)}, [("y", F32)], 13, {"transA": 1}),
    ("gemm_opset9", "Gemm", {"a": f(3, 4)}, {"b": f(4, 5), "c": f(3, 5)}, [("y", F32)], 9, {}),
    # conv and pooling
    ("conv2d", "Conv", {"x": f(2, 3, 8, 8)}, {"w": f(4, 3, 3, 3), "b": f(4)}, [("y", F32)], 17,
     {"pads": [1, 0, 2, 1], "strides": [2, 1]}),
    ("conv2d_same", "Conv", {"x": f(1, 2, 7, 7)}, {"w": f(4, 1, 3, 3)}, [("y", F32)], 17,
     {"auto_pad": "SAME_UPPER", "group": 2, "strides": [2, 2]}),
    ("conv1d_dil", "Conv", {"x": f(2, 3, 10)}, {"w": f(2, 3, 3)}, [("y", F32)], 13,
     {"dilations": [2]}),
    ("maxpool", "MaxPool", {"x": f(1, 2, 6, 6)}, {}, [("y", F32)], 17,
     {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ("avgpool", "AveragePool", {"x": f(1, 2, 6, 6)}, {}, [("y", F32)], 17,
     {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ("gmp", "GlobalMaxPool", {"x": f(2, 3, 4, 4)}, {}, [("y", F32)], 17, {}),
    ("gap", "GlobalAveragePool", {"x": f(2, 3, 4, 4)}, {}, [("y", F32)], 17, {}),
    # elementwise
    ("add_bcast", "Add", {"a": f(2, 3, 4), "b": f(4)}, {}, [("y", F32)], 17, {}),
    ("sub", "Sub", {"a": f(2, 3)}, {"b": f(1, 3)}, [("y", F32)], 9, {}),
    ("mul", "Mul", {"a": f(2, 3), "b": f(2, 1)}, {}, [("y", F32)], 17, {}),
    ("div", "Div", {"a": f(2, 3), "b": pos(2, 3)}, {}, [("y", F32)], 17, {}),
    ("div_int", "Div", {"a": i64(7, -7, 9), "b": i64(2, 2, -4)}, {}, [("y", I64)], 17, {}),
    ("pow", "Pow", {"a": pos(2, 3)}, {"b": np.array(3.0, np.float32)}, [("y", F32)], 17, {}),
    ("pow_half", "Pow", {"a": pos(5)}, {"b": np.array(0.5, np.float32)}, [("y", F32)], 13, {}),
    ("sqrt", "Sqrt", {"x": pos(3, 4)}, {}, [("y", F32)], 17, {}),
    ("reciprocal", "Reciprocal", {"x": pos(3, 4)}, {}, [("y", F32)], 17, {}),
    ("neg", "Neg", {"x": f(3, 4)}, {}, [("y", F32)], 17, {}),
    ("abs", "Abs", {"x": f(3, 4)}, {}, [("y", F32)], 17, {}),
    ("exp", "Exp", {"x": f(3, 4)}, {}, [("y", F32)], 17, {}),
    ("log", "Log", {"x": pos(3, 4)}, {}, [("y", F32)], 17, {}),
    ("sin", "Sin", {"x": f(3, 4)}, {}, [("y", F32)], 17, {}),
    ("cos", "Cos", {"x": f(3, 4)}, {}, [("y", F32)], 17, {}),
    ("max", "Max", {"a": f(3, 4), "b": f(4)}, {}, [("y", F32)], 17, {}),
    ("min3", "Min", {"a": f(3, 4), "b": f(4), "c": f(3, 1)}, {}, [("y", F32)], 17, {}),
    ("sum3", "Sum", {"a": f(3, 4), "b": f(4), "c": f(3, 1)}, {}, [("y", F32)], 17, {}),
    ("clip", "Clip", {"x": f(3, 4)}, {"lo": np.array(-0.5, np.float32),
                                     "hi": np.array(0.7, np.float32)}, [("y", F32)], 17, {}),
    ("clip_attr", "Clip", {"x": f(3, 4)}, {}, [("y", F32)], 9, {"min": -0.2, "max": 0.3}),
    ("equal", "Equal", {"a": i64(1, 2, 3), "b": i64(1, 0, 3)}, {}, [("y", TensorProto.BOOL)], 17, {}),
    ("less", "Less", {"a": f(2, 3), "b": f(3)}, {}, [("y", TensorProto.BOOL)], 17, {}),
    ("greater_eq", "GreaterOrEqual", {"a": f(2, 3), "b": f(3)}, {}, [("y", TensorProto.BOOL)], 17, {}),
    ("not", "Not", {"x": np.array([True, False])}, {}, [("y", TensorProto.BOOL)], 17, {}),
    ("and", "And", {"a": np.array([True, False, True]), "b": np.array([True, True, False])}, {},
     [("y", TensorProto.BOOL)], 17, {}),
    ("where", "Where", {"c": rng.random((2, 3)) > 0.5, "a": f(2, 3), "b": f(3)}, {},
     [("y", F32)], 17, {}),
    ("mod", "Mod", {"a": i64(7, -7, 9), "b": i64(3, 3, -4)}, {}, [("y", I64)], 17, {}),
    ("sign", "Sign", {"x": np.array([-2.0, 0.0, 3.5], np.float32)}, {}, [("y", F32)], 17, {}),
    ("floor", "Floor", {"x": f(3, 4, scale=3)}, {}, [("y", F32)], 17, {}),
    ("ceil", "Ceil", {"x": f(3, 4, scale=3)}, {}, [("y", F32)], 17, {}),
    ("round_even", "Round", {"x": np.array([0.5, 1.5, 2.5, -0.5, -1.7], np.float32)}, {},
     [("y", F32)], 17, {}),
    ("greater", "Greater", {"a": f(2, 3), "b": f(3)}, {}, [("y", TensorProto.BOOL)], 17, {}),
    ("less_eq", "LessOrEqual", {"a": i64(1, 2, 3), "b": i64(2, 2, 2)}, {},
     [("y", TensorProto.BOOL)], 17, {}),
    ("or", "Or", {"a": np.array([True, False, False]), "b": np.array([True, True, False])}, {},
     [("y", TensorProto.BOOL)], 17, {}),
    ("xor", "Xor", {"a": np.array([True, False, False]), "b": np.array([True, True, False])}, {},
     [("y", TensorProto.BOOL)], 17, {}),
    ("isnan", "IsNaN", {"x": np.array([1.0, np.nan, np.inf], np.float32)}, {},
     [("y", TensorProto.BOOL)], 17, {}),
    ("isinf_pos", "IsInf", {"x": np.array([1.0, np.nan, np.inf, -np.inf], np.float32)}, {},
     [("y", TensorProto.BOOL)], 17, {"detect_negative": 0}),
    # activations
    ("relu", "Relu", {"x": f(3, 4)}, {}, [("y", F32)], 17, {}),
    ("relu_opset8", "Relu", {"x": f(3, 4)}, {}, [("y", F32)], 8, {}),
    ("leaky", "LeakyRelu", {"x": f(3, 4)}, {}, [("y", F32)], 17, {"alpha": 0.2}),
    ("gelu", "Gelu", {"x": f(3, 4, scale=3)}, {}, [("y", F32)], 20, {}),
    ("gelu_tanh", "Gelu", {"x": f(3, 4, scale=3)}, {}, [("y", F32)], 20, {"approximate": "tanh"}),
    ("prelu", "PRelu", {"x": f(2, 3, 4)}, {"s": f(3, 1)}, [("y", F32)], 17, {}),
    ("hardsigmoid", "HardSigmoid", {"x": f(3, 4, scale=4)}, {}, [("y", F32)], 17, {}),
    ("erf", "Erf", {"x": f(3, 4)}, {}, [("y", F32)], 17, {}),
    ("tanh", "Tanh", {"x": f(3, 4)}, {}, [("y", F32)], 17, {}),
    ("sigmoid", "Sigmoid", {"x": f(3, 4)}, {}, [("y", F32)], 17, {}),
    ("softplus", "Softplus", {"x": f(3, 4)}, {}, [("y", F32)], 17, {}),
    ("softmax", "Softmax", {"x": f(2, 3, 5, scale=4)}, {}, [("y", F32)], 17, {}),
    ("softmax_axis1", "Softmax", {"x": f(2, 3, 5)}, {}, [("y", F32)], 13, {"axis": 1}),
    ("softmax_opset11", "Softmax", {"x": f(2, 3, 5)}, {}, [("y", F32)], 11, {"axis": 1}),
    ("logsoftmax", "LogSoftmax", {"x": f(2, 3, 5, scale=4)}, {}, [("y", F32)], 17, {}),
    ("logsoftmax_opset11", "LogSoftmax", {"x": f(2, 3, 5)}, {}, [("y", F32)], 11, {}),
    # normalisation
    ("layernorm", "LayerNormalization", {"x": f(2, 3, 8)}, {"g": f(8), "b": f(8)}, [("y", F32)],
     17, {"epsilon": 1e-5}),
    ("layernorm_axis", "LayerNormalization", {"x": f(2, 3, 8)}, {"g": f(3, 8)}, [("y", F32)], 17,
     {"axis": 1}),
    ("layernorm_stats", "LayerNormalization", {"x": f(2, 3, 8)}, {"g": f(8), "b": f(8)},
     [("y", F32), ("mean", F32), ("inv", F32)], 17, {}),
    ("rmsnorm", "RMSNormalization", {"x": f(2, 3, 8)}, {"g": f(8)}, [("y", F32)], 23,
     {"epsilon": 1e-6}),
    ("batchnorm", "BatchNormalization", {"x": f(2, 3, 4, 4)},
     {"s": f(3), "b": f(3), "m": f(3), "v": pos(3)}, [("y", F32)], 15, {}),
    # reductions: attribute form, input form, keepdims, empty axes
    ("reducemean_attr", "ReduceMean", {"x": f(2, 3, 4)}, {}, [("y", F32)], 13, {"axes": [-1]}),
    ("reducemean_input", "ReduceMean", {"x": f(2, 3, 4)}, {"axes": i64(1, 2)}, [("y", F32)], 18,
     {"keepdims": 0}),
    ("reducemean_all", "ReduceMean", {"x": f(2, 3, 4)}, {}, [("y", F32)], 18, {}),
    ("reducesum_attr", "ReduceSum", {"x": f(2, 3, 4)}, {}, [("y", F32)], 11, {"axes": [0, 2]}),
    ("reducesum_input", "ReduceSum", {"x": f(2, 3, 4)}, {"axes": i64(-1)}, [("y", F32)], 13, {}),
    ("reducesum_noop", "ReduceSum", {"x": f(2, 3)}, {}, [("y", F32)], 13,
     {"noop_with_empty_axes": 1}),
    ("reducemax_attr", "ReduceMax", {"x": f(2, 3, 4)}, {}, [("y", F32)], 13,
     {"axes": [1], "keepdims": 0}),
    ("reducemax_input", "ReduceMax", {"x": f(2, 3, 4)}, {"axes": i64(1)}, [("y", F32)], 21, {}),
    ("reducemin", "ReduceMin", {"x": f(2, 3, 4)}, {"axes": i64(0)}, [("y", F32)], 18, {}),
    ("reducel2", "ReduceL2", {"x": f(2, 3, 4)}, {"axes": i64(2)}, [("y", F32)], 18, {}),
    ("reduceprod", "ReduceProd", {"x": pos(2, 3, 4)}, {"axes": i64(1, 2)}, [("y", F32)], 18, {}),
    ("reducesumsquare", "ReduceSumSquare", {"x": f(2, 3, 4)}, {}, [("y", F32)], 13,
     {"axes": [0]}),
    ("argmin_last", "ArgMin", {"x": np.array([[1.0, 0.0, 0.0, 2.0]], np.float32)}, {},
     [("y", I64)], 13, {"axis": 1, "select_last_index": 1}),
    ("argmax", "ArgMax", {"x": f(2, 3, 4)}, {}, [("y", I64)], 13, {"axis": -1, "keepdims": 0}),
    # shape and data movement
    ("reshape", "Reshape", {"x": f(2, 3, 4)}, {"s": i64(0, -1, 2)}, [("y", F32)], 17, {}),
    ("transpose", "Transpose", {"x": f(2, 3, 4)}, {}, [("y", F32)], 17, {"perm": [2, 0, 1]}),
    ("transpose_default", "Transpose", {"x": f(2, 3, 4)}, {}, [("y", F32)], 17, {}),
    ("squeeze", "Squeeze", {"x": f(2, 1, 4, 1)}, {"axes": i64(-1)}, [("y", F32)], 17, {}),
    ("squeeze_all", "Squeeze", {"x": f(2, 1, 4, 1)}, {}, [("y", F32)], 17, {}),
    ("squeeze_attr", "Squeeze", {"x": f(2, 1, 4, 1)}, {}, [("y", F32)], 11, {"axes": [1]}),
    ("unsqueeze", "Unsqueeze", {"x": f(2, 4)}, {"axes": i64(0, -1)}, [("y", F32)], 17, {}),
    ("unsqueeze_attr", "Unsqueeze", {"x": f(2, 4)}, {}, [("y", F32)], 11, {"axes": [1]}),
    ("concat", "Concat", {"a": f(2, 3), "b": f(2, 1)}, {}, [("y", F32)], 17, {"axis": -1}),
    ("split_input", "Split", {"x": f(2, 6)}, {"s": i64(1, 2, 3)},
     [("a", F32), ("b", F32), ("c", F32)], 13, {"axis": 1}),
    ("split_num", "Split", {"x": f(7, 2)}, {}, [("a", F32), ("b", F32), ("c", F32)], 18,
     {"num_outputs": 3}),
    ("split_equal", "Split", {"x": f(2, 6)}, {}, [("a", F32), ("b", F32)], 13, {"axis": 1}),
    ("split_attr", "Split", {"x": f(2, 6)}, {}, [("a", F32), ("b", F32)], 11,
     {"axis": 1, "split": [4, 2]}),
    ("slice", "Slice", {"x": f(5, 6)}, {"st": i64(1, -4), "en": i64(4, 100), "ax": i64(0, 1),
                                        "sp": i64(2, 1)}, [("y", F32)], 17, {}),
    ("slice_neg_step", "Slice", {"x": f(5, 6)}, {"st": i64(-1), "en": i64(-100), "ax": i64(1),
                                                 "sp": i64(-2)}, [("y", F32)], 17, {}),
    ("slice_attr", "Slice", {"x": f(5, 6)}, {}, [("y", F32)], 9,
     {"starts": [1], "ends": [3], "axes": [1]}),
    ("gather", "Gather", {"t": f(5, 4), "i": np.array([[0, 3], [-1, 2]], np.int64)}, {},
     [("y", F32)], 17, {}),
    ("gather_axis1", "Gather", {"x": f(3, 5, 2)}, {"i": i64(4, 0)}, [("y", F32)], 13, {"axis": 1}),
    ("gather_scalar", "Gather", {"x": f(3, 5)}, {"i": np.array(1, np.int64)}, [("y", F32)], 13, {}),
    ("gathernd_batch", "GatherND", {"x": f(2, 3, 4)}, {"i": np.array([[[1], [2]], [[0], [0]]])},
     [("y", F32)], 13, {"batch_dims": 1}),
    ("gather_elements", "GatherElements", {"x": f(3, 4)},
     {"i": np.array([[0, 1, 2, 0], [2, 2, 1, 0]], np.int64)}, [("y", F32)], 13, {"axis": 0}),
    ("shape", "Shape", {"x": f(2, 3, 4)}, {}, [("y", I64)], 17, {}),
    ("shape_slice", "Shape", {"x": f(2, 3, 4)}, {}, [("y", I64)], 17, {"start": 1, "end": -1}),
    ("size", "Size", {"x": f(2, 3, 4)}, {}, [("y", I64)], 17, {}),
    ("constant", "Constant", {}, {}, [("y", F32)], 17,
     {"value": numpy_helper.from_array(np.array([[1.5, -2.0]], np.float32), "value")}),
    ("constant_ints", "Constant", {}, {}, [("y", I64)], 17, {"value_ints": [3, 1, 4]}),
    ("constantofshape", "ConstantOfShape", {"s": i64(2, 3)}, {}, [("y", F32)], 17,
     {"value": numpy_helper.from_array(np.array([1.5], np.float32), "value")}),
    ("cast_int", "Cast", {"x": f(3, 4, scale=5)}, {}, [("y", I64)], 17, {"to": TensorProto.INT64}),
    ("cast_bool", "Cast", {"x": np.array([0.0, 2.0, -1.0], np.float32)}, {},
     [("y", TensorProto.BOOL)], 17, {"to": TensorProto.BOOL}),
    ("cast_float", "Cast", {"x": i64(3, -2)}, {}, [("y", F32)], 17, {"to": TensorProto.FLOAT}),
    ("castlike_fp16", "CastLike", {"x": f(3, 4, scale=100)}, {"like": np.zeros(1, np.float16)},
     [("y", TensorProto.FLOAT16)], 17, {}),
    ("expand", "Expand", {"x": f(3, 1)}, {"s": i64(2, 1, 4)}, [("y", F32)], 17, {}),
    ("identity", "Identity", {"x": f(3, 1)}, {}, [("y", F32)], 17, {}),
    ("flatten", "Flatten", {"x": f(2, 3, 4)}, {}, [("y", F32)], 17, {"axis": 2}),
    ("flatten_opset9", "Flatten", {"x": f(2, 1, 1, 5)}, {}, [("y", F32)], 9, {}),
    ("trilu_lower", "Trilu", {"x": f(2, 4, 5)}, {"k": np.array(1, np.int64)}, [("y", F32)], 17,
     {"upper": 0}),
    ("trilu_upper", "Trilu", {"x": f(4, 4)}, {}, [("y", F32)], 17, {}),
    ("range_int", "Range", {}, {"a": np.array(2, np.int64), "b": np.array(11, np.int64),
                                "d": np.array(3, np.int64)}, [("y", I64)], 17, {}),
    ("range_float", "Range", {"a": np.array(0.5, np.float32)},
     {"b": np.array(3.0, np.float32), "d": np.array(0.7, np.float32)}, [("y", F32)], 17, {}),
    ("tile", "Tile", {"x": f(2, 3)}, {"r": i64(2, 1)}, [("y", F32)], 17, {}),
    ("pad", "Pad", {"x": f(2, 3)}, {"p": i64(1, 0, 0, 2), "v": np.array(0.5, np.float32)},
     [("y", F32)], 17, {}),
    ("pad_attr", "Pad", {"x": f(2, 3)}, {}, [("y", F32)], 9, {"pads": [0, 1, 1, 0], "value": 2.0}),
    ("pad_edge", "Pad", {"x": f(1, 2, 3, 3)}, {"p": i64(0, 0, 1, 1, 0, 0, 1, 2)}, [("y", F32)], 17,
     {"mode": "edge"}),
    ("dropout", "Dropout", {"x": f(2, 3)}, {}, [("y", F32)], 17, {}),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_op_matches_onnxruntime(case: Case) -> None:
    _, op, inputs, consts, outputs, opset, attrs = case
    model = single_node(op, inputs, outputs, opset, consts, **attrs)
    ref = run_ort(model, inputs)
    ours = run_ours(model, inputs)
    for a, b in zip(ours, ref):
        assert_close(a, b, rtol=2e-6, atol=1e-7)


def test_every_registered_op_has_a_case() -> None:
    """A new op is tested against onnxruntime the day it is registered."""
    from kcverify.models.ops import registered

    elsewhere = {"Attention", "QuantizeLinear", "DequantizeLinear", "Cast"}  # tests below
    assert set(registered()) - {c[1] for c in CASES} - elsewhere == set()


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_decomposed_path_matches_onnxruntime(case: Case) -> None:
    """Under a non-Exact arithmetic composite ops run as tagged primitives: same values, and
    every tag is a primitive kernel specs know."""
    _, op, inputs, consts, outputs, opset, attrs = case
    model = single_node(op, inputs, outputs, opset, consts, **attrs)
    ref = run_ort(model, inputs)
    rec = Recorder()
    ours = run_ours(model, inputs, arithmetic=rec)
    for a, b in zip(ours, ref):
        assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert {p for _, p in rec.rounds} <= set(DEFAULT_ULPS)


def test_registry_is_opset_data() -> None:
    assert lookup("Softmax", "", 11).since_opset == 1
    assert lookup("Softmax", "", 13).since_opset == 13
    assert lookup("ReduceMean", "", 17).since_opset == 1
    assert lookup("ReduceMean", "", 18).since_opset == 18
    assert lookup("Gelu", "", 19) is None
    assert lookup("LayerNormalization", "", 16) is None
    assert lookup("NoSuchOp", "", 20) is None


# --- quantization and narrow-float casts -------------------------------------------------------
def _fp8_values() -> np.ndarray:
    v = np.concatenate([rng.standard_normal(200) * 50, [0.0, -0.0, 447.0, 464.0, 465.0, 500.0,
                                                       1e-4, -3e-3, 57344.0, 61439.0, 61440.0,
                                                       1e6, np.inf, -np.inf]])
    return v.astype(np.float32)


@pytest.mark.parametrize("to", [TensorProto.FLOAT16, TensorProto.BFLOAT16,
                                TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT8E5M2])
@pytest.mark.parametrize("saturate", [0, 1])
def test_cast_to_narrow_float_and_back_matches_onnxruntime(to: int, saturate: int) -> None:
    from onnx import helper

    x = _fp8_values()
    attrs = {"to": to}
    if to in (TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT8E5M2):
        attrs["saturate"] = saturate
    elif saturate:
        pytest.skip("saturate only applies to float8")
    n1 = helper.make_node("Cast", ["x"], ["q"], **attrs)
    n2 = helper.make_node("Cast", ["q"], ["y"], to=TensorProto.FLOAT)
    g = helper.make_graph([n1, n2], "c", [helper.make_tensor_value_info("x", F32, x.shape)],
                          [helper.make_tensor_value_info("y", F32, x.shape)])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)
    (ref,) = run_ort(model, {"x": x})
    (ours,) = run_ours(model, {"x": x})
    if to == TensorProto.FLOAT8E5M2 and not saturate:
        # onnxruntime turns the exact tie max + ulp/2 = 61440 into NaN; ONNX's reference (and
        # ml_dtypes, round to nearest even) give inf, as the executor does
        tie = x == 61440.0
        assert np.all(np.isposinf(ours[tie]))
        ours, ref = ours[~tie], ref[~tie]
    np.testing.assert_array_equal(ours, ref)
    # and bit-exact against ml_dtypes where the cast is plain (saturating casts clamp first)
    dt = {TensorProto.FLOAT16: np.float16, TensorProto.BFLOAT16: ml_dtypes.bfloat16,
          TensorProto.FLOAT8E4M3FN: ml_dtypes.float8_e4m3fn,
          TensorProto.FLOAT8E5M2: ml_dtypes.float8_e5m2}[to]
    if not saturate:
        (mine,) = run_ours(model, {"x": x})
        with np.errstate(over="ignore"):
            expect = x.astype(dt).astype(np.float32)
        np.testing.assert_array_equal(mine, expect)


def _qdq_model(qtype: int, scale: np.ndarray, zp: np.ndarray | None, axis: int, opset: int,
               shape: tuple[int, ...], block_size: int = 0, expose_q: bool = True) -> Any:
    from onnx import helper, numpy_helper

    inits = [numpy_helper.from_array(scale, "s")]
    ins = ["x", "s"]
    if zp is not None:
        inits.append(numpy_helper.from_array(zp, "z"))
        ins.append("z")
    extra = {"block_size": block_size} if block_size else {}
    q = helper.make_node("QuantizeLinear", ins, ["q"], axis=axis, **extra)
    d = helper.make_node("DequantizeLinear", ["q"] + ins[1:], ["y"], axis=axis, **extra)
    g = helper.make_graph([q, d], "qdq", [helper.make_tensor_value_info("x", F32, shape)],
                          ([helper.make_tensor_value_info("q", qtype, shape)] if expose_q else [])
                          + [helper.make_tensor_value_info("y", F32, shape)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)],
                             ir_version=10 if opset >= 21 else 9)


@pytest.mark.parametrize("name,qtype,zp", [
    ("int8", TensorProto.INT8, np.array(3, np.int8)),
    ("uint8", TensorProto.UINT8, np.array(128, np.uint8)),
    ("e4m3", TensorProto.FLOAT8E4M3FN, np.array(0, ml_dtypes.float8_e4m3fn)),
    ("e5m2", TensorProto.FLOAT8E5M2, np.array(0, ml_dtypes.float8_e5m2)),
])
def test_qdq_per_tensor_matches_onnxruntime(name: str, qtype: int, zp: np.ndarray) -> None:
    x = (rng.standard_normal((4, 6)) * 4).astype(np.float32)
    x[0, :3] = [1000.0, -1000.0, 0.0]  # saturation
    fp8 = {TensorProto.FLOAT8E4M3FN: ml_dtypes.float8_e4m3fn,
           TensorProto.FLOAT8E5M2: ml_dtypes.float8_e5m2}.get(qtype)
    # onnxruntime cannot hand float8 tensors to numpy: compare q only for integer types
    model = _qdq_model(qtype, np.array(0.05, np.float32), zp, 1, 19, x.shape, expose_q=fp8 is None)
    ref = run_ort(model, {"x": x})
    ours = run_ours(model, {"x": x})
    if fp8 is None:
        np.testing.assert_array_equal(ours[0], ref[0])
    else:  # and the float8 values against ml_dtypes (saturating)
        top = float(ml_dtypes.finfo(fp8).max)
        expect = np.clip(x / np.float32(0.05), -top, top).astype(fp8).astype(np.float32) * np.float32(0.05)
        np.testing.assert_array_equal(ours[-1], expect)
    np.testing.assert_array_equal(ours[-1], ref[-1])


def test_qdq_per_axis_int8_matches_onnxruntime() -> None:
    x = (rng.standard_normal((3, 5)) * 4).astype(np.float32)
    scale = np.array([0.02, 0.05, 0.1], np.float32)
    zp = np.array([0, -3, 5], np.int8)
    model = _qdq_model(TensorProto.INT8, scale, zp, 0, 13, x.shape)
    ref_q, ref_y = run_ort(model, {"x": x})
    ours_q, ours_y = run_ours(model, {"x": x})
    np.testing.assert_array_equal(ours_q, ref_q)
    np.testing.assert_array_equal(ours_y, ref_y)


def test_qdq_blocked_matches_reference_formula() -> None:
    """Opset 21 per-block scales: y = s[block] * round(x / s[block]) (checked by hand, since
    onnxruntime's blocked kernels vary by version)."""
    x = (rng.standard_normal((2, 6)) * 4).astype(np.float32)
    scale = np.array([[0.1, 0.5], [0.2, 0.05]], np.float32)  # blocks of 3 along axis 1
    model = _qdq_model(TensorProto.INT8, scale, np.zeros((2, 2), np.int8), 1, 21, x.shape, 3)
    _, ours_y = run_ours(model, {"x": x})
    s = np.repeat(scale, 3, axis=1)
    expect = np.clip(np.round(x / s), -128, 127) * s
    np.testing.assert_array_equal(ours_y, expect.astype(np.float32))


def test_int4_weight_dequantize_matches_onnxruntime() -> None:
    """Opset 21 int4 weights (per output channel), dequantized and multiplied: as onnxruntime."""
    from onnx import helper

    q = rng.integers(-8, 8, size=(6, 4)).astype(ml_dtypes.int4)
    scale = np.array([0.1, 0.2, 0.05, 0.3], np.float32)
    x = f(3, 6)
    inits = [numpy_helper.from_array(q, "wq"), numpy_helper.from_array(scale, "s")]
    nodes = [helper.make_node("DequantizeLinear", ["wq", "s"], ["w"], axis=1),
             helper.make_node("MatMul", ["x", "w"], ["y"])]
    g = helper.make_graph(nodes, "int4", [helper.make_tensor_value_info("x", F32, x.shape)],
                          [helper.make_tensor_value_info("y", F32, None)], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    (ref,) = run_ort(model, {"x": x}, optimize=False)
    (ours,) = run_ours(model, {"x": x})
    assert_close(ours, ref, rtol=1e-6)
    expect = x @ (q.astype(np.float32) * scale)
    assert_close(ours, expect, rtol=1e-6)


# --- fused Attention (opset 23) ----------------------------------------------------------------
ATTENTION_CASES: list[tuple[str, dict[str, np.ndarray], dict[str, Any], int]] = [
    ("causal_4d", {"q": f(2, 3, 5, 4), "k": f(2, 3, 5, 4), "v": f(2, 3, 5, 4)}, {"is_causal": 1}, 1),
    ("plain_4d_cross", {"q": f(2, 2, 3, 4), "k": f(2, 2, 6, 4), "v": f(2, 2, 6, 5)},
     {"scale": 0.3}, 1),
    ("gqa_3d", {"q": f(2, 5, 12), "k": f(2, 5, 6), "v": f(2, 5, 6)},
     {"q_num_heads": 4, "kv_num_heads": 2, "is_causal": 1}, 1),
    ("bool_mask", {"q": f(1, 2, 4, 4), "k": f(1, 2, 4, 4), "v": f(1, 2, 4, 4),
                   "m": np.array([[True, True, False, True]] * 4)}, {}, 1),
    ("float_mask", {"q": f(1, 2, 4, 4), "k": f(1, 2, 4, 4), "v": f(1, 2, 4, 4),
                    "m": f(1, 1, 4, 4)}, {}, 1),
    ("past_kv", {"q": f(1, 2, 2, 4), "k": f(1, 2, 2, 4), "v": f(1, 2, 2, 4), "m": None,
                 "pk": f(1, 2, 3, 4), "pv": f(1, 2, 3, 4)}, {"is_causal": 1}, 3),
    ("softcap", {"q": f(1, 2, 4, 4, scale=3), "k": f(1, 2, 4, 4, scale=3), "v": f(1, 2, 4, 4)},
     {"softcap": 2.0}, 1),
]


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=[c[0] for c in ATTENTION_CASES])
@pytest.mark.parametrize("decomposed", [False, True])
def test_attention_matches_onnxruntime(case: Any, decomposed: bool) -> None:
    from onnx import helper

    _, inputs, attrs, n_out = case
    names = [k if v is not None else "" for k, v in inputs.items()]
    feeds = {k: v for k, v in inputs.items() if v is not None}
    outs = ["y", "present_k", "present_v"][:n_out]
    node = helper.make_node("Attention", names, outs, name="attn", **attrs)
    g = helper.make_graph(
        [node], "a",
        [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
         for k, v in feeds.items()],
        [helper.make_tensor_value_info(o, F32, None) for o in outs])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)], ir_version=10)
    ref = run_ort(model, feeds)
    ours = run_ours(model, feeds, arithmetic=PassThrough() if decomposed else None)
    for a, b in zip(ours, ref):
        assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_cast_from_float64_rounds_once() -> None:
    """1 + 2^-11 + 2^-40 lies above the fp16 midpoint: nearest is 1 + 2^-10 (torch's own cast
    via float32 rounds twice and gives 1)."""
    import torch

    from kcverify.models.ops._util import round_to

    x = torch.tensor([1 + 2**-11 + 2**-40, 1 + 2**-8 + 2**-30], dtype=torch.float64)
    assert round_to(x[:1], torch.float16).item() == 1 + 2**-10
    assert round_to(x[1:], torch.bfloat16).item() == 1 + 2**-7
