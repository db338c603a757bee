"""The models under attack: the shipped ones and a torch-exported TransformerEncoderLayer.

``encoder_layer(exporter)``: ``nn.TransformerEncoderLayer(d_model=32, nhead=4, batch_first=True)``
followed by ``Linear(32, 10)``, seeded, exported by the dynamo exporter (opset 20) or the legacy
TorchScript one (opset 17). With batch_first the graph input is (batch, seq, 32) but torch's
attention transposes to seq-first inside the graph: axis 0 of the attention MatMuls' operands is
the position, not the sample. Exported once per process (lru_cache); the exporter's error text
when it fails on this torch build (the tests then skip with the reason). The TorchScript export
gets its integer constant subgraphs folded (``fold_integer_constants``).
"""

from __future__ import annotations

import functools
import io
import warnings
from pathlib import Path

import onnx

ROOT = Path(__file__).resolve().parents[3]
SHIPPED = ("mlp_tiny", "mlp_small", "tiny_encoder", "tiny_decoder")


def shipped(name: str) -> onnx.ModelProto:
    return onnx.load(str(ROOT / "models" / f"{name}.onnx"))


@functools.lru_cache(maxsize=4)
def encoder_layer(exporter: str, seq: int = 8) -> onnx.ModelProto | str:
    """The exported encoder layer + head, or the exporter's error message."""
    import torch

    torch.manual_seed(1234)

    class EncoderHead(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc = torch.nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64,
                                                        dropout=0.0, batch_first=True)
            self.head = torch.nn.Linear(32, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.enc(x))

    m = EncoderHead().eval()
    x = torch.randn(1, seq, 32)
    buf = io.BytesIO()
    try:
        # grad enabled: torch's fused fast path (_transformer_encoder_layer_fwd, which the
        # TorchScript exporter cannot export) runs only without autograd
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if exporter == "dynamo":
                prog = torch.onnx.export(m, (x,), dynamo=True, opset_version=20,
                                         input_names=["x"], output_names=["y"], verbose=False)
                prog.save(buf) if hasattr(prog, "save") else None
                model = prog.model_proto if hasattr(prog, "model_proto") else onnx.load_from_string(buf.getvalue())
            else:
                torch.onnx.export(m, (x,), buf, dynamo=False, opset_version=17,
                                  input_names=["x"], output_names=["y"])
                model = fold_integer_constants(onnx.load_from_string(buf.getvalue()))
    except Exception as e:  # noqa: BLE001 - an exporter that cannot export is a skip reason
        return f"{exporter} exporter failed: {type(e).__name__}: {e}"[:300]
    model.graph.name = f"encoder_layer_{exporter}"
    return model


def fold_integer_constants(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with every node whose inputs are all constants and whose outputs are integer
    tensors replaced by Constant nodes (the TorchScript exporter leaves a Mod of two constants
    that the bound engine has no exact evaluator for; the float computation is untouched)."""
    import numpy as np
    from onnx import helper, numpy_helper
    from onnx.reference import ReferenceEvaluator

    m = onnx.ModelProto()
    m.CopyFrom(model)
    values = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
    nodes = []
    for n in m.graph.node:
        if n.op_type == "Constant":
            values[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)
            nodes.append(n)
            continue
        ins = [i for i in n.input if i]
        if ins and all(i in values for i in ins) and n.op_type != "Shape":
            g = helper.make_graph([n], "one", [], [helper.make_tensor_value_info(o, 0, None)
                                                   for o in n.output],
                                  [numpy_helper.from_array(values[i], i) for i in ins])
            one = helper.make_model(g, opset_imports=list(m.opset_import))
            outs = ReferenceEvaluator(one).run(None, {})
            if all(np.issubdtype(np.asarray(v).dtype, np.integer) for v in outs):
                for o, v in zip(n.output, outs):
                    values[o] = np.asarray(v)
                    nodes.append(helper.make_node("Constant", [], [o],
                                                  value=numpy_helper.from_array(np.asarray(v))))
                continue
        nodes.append(n)
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    return m


def embedding_tensors(model: onnx.ModelProto) -> list[str]:
    """Outputs of Gather(initializer table, non-initializer indices): what an embedding-space
    region perturbs (the engine's reading: token and position embeddings)."""
    inits = {i.name for i in model.graph.initializer}
    return [n.output[0] for n in model.graph.node
            if n.op_type == "Gather" and n.input[0] in inits and n.input[1] not in inits]


def cut_at(model: onnx.ModelProto, names: list[str], feeds: dict) -> tuple[onnx.ModelProto, dict]:
    """(model', values): the model with the tensors ``names`` made graph inputs (their producing
    nodes removed), and their exact values at ``feeds`` (onnx.reference on the original)."""
    import numpy as np
    from onnx import helper
    from onnx.reference import ReferenceEvaluator

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    del probe.graph.output[:]
    probe.graph.output.extend(helper.make_tensor_value_info(n, 0, None) for n in names)
    values = dict(zip(names, ReferenceEvaluator(probe).run(None, dict(feeds))))
    cut = onnx.ModelProto()
    cut.CopyFrom(model)
    keep = [n for n in cut.graph.node if not any(o in names for o in n.output)]
    del cut.graph.node[:]
    cut.graph.node.extend(keep)
    for n in names:
        v = np.asarray(values[n])
        cut.graph.input.append(helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT,
                                                             list(v.shape)))
    return cut, values
