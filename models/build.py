"""Build the example ONNX models deterministically from a seed (nothing is trained).

    python models/build.py            # rebuilds every model and examples/data/*.npz byte-identically

Models (weights drawn from N(0, std^2) with a fixed seed, exported with torch.onnx.export):

* tiny_decoder.onnx  decoder-only GPT: 2 pre-LN layers, causal attention, GELU MLP, vocab 256,
                     d_model 64, 4 heads, seq <= 32; input_ids int64 [batch, seq] -> logits
* tiny_encoder.onnx  BERT-style: token + position embedding, post-LN, bidirectional attention,
                     2 layers; input_ids int64 [batch, seq] -> hidden float32 [batch, seq, d]
* mlp_small.onnx     ReLU MLP 8-16-16-4;  input x float32 [batch, 8] -> y
* mlp_tiny.onnx      ReLU MLP 4-8-8-2;    input x float32 [batch, 4] -> y
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import math
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch
from torch import nn

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SEED = 20260
OPSET = 20


class CausalSelfAttention(nn.Module):
    """Multi-head attention: softmax(q k^T / sqrt(d_h) + mask) v, with a causal or no mask."""

    def __init__(self, d: int, heads: int, causal: bool, sdpa: bool = False) -> None:
        super().__init__()
        self.heads, self.causal, self.sdpa = heads, causal, sdpa
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.heads
        q, k, v = self.qkv(x).split(d, dim=-1)
        q = q.reshape(b, t, h, d // h).transpose(1, 2)
        k = k.reshape(b, t, h, d // h).transpose(1, 2)
        v = v.reshape(b, t, h, d // h).transpose(1, 2)
        if self.sdpa:  # the fused PyTorch op, as modern models call it
            y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
            return self.proj(y.transpose(1, 2).reshape(b, t, d))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // h))
        if self.causal:
            keep = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            att = att.masked_fill(~keep, float("-inf"))
        att = torch.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        return self.proj(y)


class DecoderLayer(nn.Module):
    """Pre-LN: x + attn(ln1(x)), then x + mlp(ln2(x)) with a tanh-free (erf) GELU."""

    def __init__(self, d: int, heads: int, sdpa: bool = False) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads, causal=True, sdpa=sdpa)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyDecoder(nn.Module):
    """GPT: token + position embedding, pre-LN layers, final LayerNorm, linear head (``tied``:
    the head reuses the token embedding; ``sdpa``: attention by scaled_dot_product_attention)."""

    def __init__(self, vocab: int = 256, d: int = 64, heads: int = 4, layers: int = 2,
                 max_seq: int = 32, sdpa: bool = False, tied: bool = False) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_seq, d)
        self.layers = nn.ModuleList(DecoderLayer(d, heads, sdpa) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.head.weight = self.tok.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        pos = torch.arange(t, device=input_ids.device)
        x = self.tok(input_ids) + self.pos(pos)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln_f(x))


class EncoderLayer(nn.Module):
    """Post-LN (BERT): x = ln1(x + attn(x)); x = ln2(x + mlp(x)), tanh-approximate GELU."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.attn = CausalSelfAttention(d, heads, causal=False)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"),
                                 nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln1(x + self.attn(x))
        return self.ln2(x + self.mlp(x))


class TinyEncoder(nn.Module):
    def __init__(self, vocab: int = 256, d: int = 64, heads: int = 4, layers: int = 2,
                 max_seq: int = 32) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_seq, d)
        self.ln_emb = nn.LayerNorm(d)
        self.layers = nn.ModuleList(EncoderLayer(d, heads) for _ in range(layers))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        pos = torch.arange(t, device=input_ids.device)
        x = self.ln_emb(self.tok(input_ids) + self.pos(pos))
        for layer in self.layers:
            x = layer(x)
        return x


def mlp(sizes: list[int]) -> nn.Sequential:
    mods: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        mods.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            mods.append(nn.ReLU())
    return nn.Sequential(*mods)


def init_weights(model: nn.Module, seed: int, std: float) -> None:
    """Every parameter from N(0, std^2), LayerNorm gains from 1 + N(0, std^2): no training."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32) * std
            if name.split(".")[-2:-1] and "ln" in name and name.endswith("weight"):
                p.copy_(1.0 + noise)
            else:
                p.copy_(noise)


def _strip(proto: onnx.ModelProto) -> None:
    """Drop what depends on where and how the exporter ran (source paths, line numbers, module
    names in metadata and doc strings), so the bytes depend on the weights and graph only."""
    proto.producer_version = ""
    proto.doc_string = ""
    del proto.metadata_props[:]
    g = proto.graph
    g.doc_string = ""
    del g.metadata_props[:]
    for item in (*g.node, *g.input, *g.output, *g.value_info, *g.initializer):
        item.doc_string = ""
        del item.metadata_props[:]


def export(model: nn.Module, example: torch.Tensor, path: Path, in_name: str, out_name: str,
           dynamic: dict[int, str], dynamo: bool = True) -> None:
    """Export with torch.onnx.export and write deterministic bytes. The dynamo exporter gives
    the cleanest graph (LayerNormalization, Gelu, no shape arithmetic); ``dynamo=False`` (the
    TorchScript exporter) is kept for tests of the executor on that exporter's idioms."""
    model.eval()
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        try:
            if dynamo:
                prog = torch.onnx.export(
                    model, (example,), input_names=[in_name], output_names=[out_name],
                    dynamic_shapes=(dynamic,), opset_version=OPSET, dynamo=True,
                    verbose=False)
                proto = prog.model_proto
            else:
                buf = io.BytesIO()
                torch.onnx.export(model, (example,), buf, input_names=[in_name],
                                  output_names=[out_name],
                                  dynamic_axes={in_name: dynamic, out_name: dynamic},
                                  opset_version=OPSET, dynamo=False, do_constant_folding=True)
                proto = onnx.load_from_string(buf.getvalue())
        finally:
            logging.disable(logging.NOTSET)
    _strip(proto)
    proto.graph.name = path.stem
    onnx.checker.check_model(proto, full_check=True)
    path.write_bytes(proto.SerializeToString(deterministic=True))


MLPS: dict[str, tuple[list[int], int]] = {
    "mlp_small": ([8, 16, 16, 4], SEED + 3),
    "mlp_tiny": ([4, 8, 8, 2], SEED + 4),
}


def build_mlp(name: str, out: Path) -> Path:
    """One of the MLPS, exported in the classic Gemm form (as VNN-COMP networks come)."""
    sizes, seed = MLPS[name]
    net = mlp(sizes)
    init_weights(net, seed, std=0.5)
    path = out / f"{name}.onnx"
    export(net, torch.zeros(2, sizes[0]), path, "x", "y", {0: "batch"}, dynamo=False)
    return path


def build_all(out: Path, data: Path) -> list[Path]:
    torch.manual_seed(SEED)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    ids = torch.zeros(2, 16, dtype=torch.int64)

    dec = TinyDecoder()
    init_weights(dec, SEED + 1, std=0.08)
    export(dec, ids, out / "tiny_decoder.onnx", "input_ids", "logits", {0: "batch", 1: "seq"})
    written.append(out / "tiny_decoder.onnx")

    enc = TinyEncoder()
    init_weights(enc, SEED + 2, std=0.08)
    export(enc, ids, out / "tiny_encoder.onnx", "input_ids", "hidden", {0: "batch", 1: "seq"})
    written.append(out / "tiny_encoder.onnx")

    for name in MLPS:
        written.append(build_mlp(name, out))

    rng = np.random.default_rng(SEED)
    data.mkdir(parents=True, exist_ok=True)
    # eval / safety: the certified slices; sample: enough short inputs (64 >= 59) for a soft
    # clause with a 5 % budget to be decidable at 95 % confidence
    for name, n, seq in (("eval", 8, 16), ("safety", 4, 16), ("sample", 64, 8)):
        path = data / f"{name}.npz"
        ids_np = rng.integers(0, 256, size=(n, seq), dtype=np.int64)
        with open(path, "wb") as f:
            np.savez(f, input_ids=ids_np)
        written.append(path)
        if name == "sample":  # probe: its first input, a slice the zonotope certifies (w8-decoder)
            probe = data / "probe.npz"
            with open(probe, "wb") as f:
                np.savez(f, input_ids=ids_np[:1])
            written.append(probe)
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE, help="where the .onnx files go")
    ap.add_argument("--data", type=Path, default=ROOT / "examples" / "data",
                    help="where eval.npz, safety.npz, sample.npz and probe.npz go")
    args = ap.parse_args()
    for p in build_all(args.out, args.data):
        print(f"{p}  {p.stat().st_size} bytes")


if __name__ == "__main__":
    main()
