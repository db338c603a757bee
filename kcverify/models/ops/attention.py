"""The fused Attention op (opset 23), as torch.onnx's dynamo exporter emits it from
scaled_dot_product_attention at opset >= 23:

    Y = softmax(softcap((sqrt(s) Q)(sqrt(s) K)^T) + bias) V,   s = scale or 1/sqrt(head size)

with bias from ``attn_mask`` (boolean: keep where true; float: added), ``is_causal`` (key j
visible to query i iff j <= i + past length), past key/value concatenated along the sequence
axis, 3-D inputs split into ``q_num_heads`` / ``kv_num_heads`` heads, grouped-query attention
by repeating key/value heads. Both products go through ``arithmetic.matmul``; a fully masked row
gives zeros (as ONNX's reference).
"""

from __future__ import annotations

import math

import torch

from kcverify.models.ops import OpContext, register_op
from kcverify.models.ops.activation import _softmax


def _heads(x: torch.Tensor, n: int | None) -> torch.Tensor:
    """[B, S, H*D] -> [B, H, S, D]; 4-D inputs pass through."""
    if x.dim() == 4:
        return x
    if not n:
        raise ValueError("3-D Attention inputs need q_num_heads and kv_num_heads")
    b, s, hd = x.shape
    return x.reshape(b, s, n, hd // n).transpose(1, 2)


@register_op("Attention", since_opset=23)
def attention(ctx: OpContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              attn_mask: torch.Tensor | None = None, past_key: torch.Tensor | None = None,
              past_value: torch.Tensor | None = None, *, is_causal: int = 0,
              kv_num_heads: int | None = None, q_num_heads: int | None = None,
              qk_matmul_output_mode: int = 0, scale: float | None = None, softcap: float = 0.0,
              softmax_precision: int | None = None) -> tuple[torch.Tensor, ...]:
    """Outputs Y, present_key, present_value, and the QK product selected by
    ``qk_matmul_output_mode`` (0: scaled QK^T, 1: after softcap, 2: plus bias, 3: softmax)."""
    three_d = q.dim() == 3
    Q, K, V = _heads(q, q_num_heads), _heads(k, kv_num_heads), _heads(v, kv_num_heads)
    if past_key is not None:
        K = torch.cat([past_key, K], dim=2)
    if past_value is not None:
        V = torch.cat([past_value, V], dim=2)
    present_k, present_v = K, V
    if Q.shape[1] != K.shape[1]:  # grouped-query attention
        reps = Q.shape[1] // K.shape[1]
        K = K.repeat_interleave(reps, dim=1)
        V = V.repeat_interleave(reps, dim=1)
    s = scale if scale is not None else 1.0 / math.sqrt(Q.shape[-1])
    root = math.sqrt(s)
    Qs = ctx.round("mul", Q * root)
    Ks = ctx.round("mul", K * root)
    scores = ctx.arithmetic.matmul(ctx.node, Qs, Ks.transpose(-1, -2), ctx.role(0), ctx.role(1))
    qk = [scores]
    if softcap and softcap > 0:
        t = ctx.round("tanh", torch.tanh(ctx.round("div", scores / softcap)))
        scores = ctx.round("mul", t * softcap)
    qk.append(scores)
    sq, skv = Q.shape[2], K.shape[2]
    bias = torch.zeros((sq, skv), dtype=scores.dtype, device=scores.device)
    if attn_mask is not None:
        m = attn_mask
        if m.shape[-1] < skv:  # a shorter mask is padded with "masked"
            pad = torch.zeros(m.shape[:-1] + (skv - m.shape[-1],), dtype=m.dtype, device=m.device)
            m = torch.cat([m, pad if m.dtype == torch.bool else pad - torch.inf], dim=-1)
        if m.dtype == torch.bool:
            m = torch.where(m, 0.0, -torch.inf).to(scores.dtype)
        bias = bias + m.to(scores.dtype)
    if is_causal:
        offset = past_key.shape[2] if past_key is not None else 0
        i = torch.arange(sq, device=scores.device).unsqueeze(1)
        j = torch.arange(skv, device=scores.device).unsqueeze(0)
        bias = bias + torch.where(j <= i + offset, 0.0, -torch.inf).to(scores.dtype)
    if attn_mask is not None or is_causal:
        scores = ctx.round("add", scores + bias)
    qk.append(scores)
    probs = _softmax(ctx, scores, -1, log=False)
    dead = torch.isneginf(bias.amax(dim=-1, keepdim=True))
    probs = torch.where(dead, torch.zeros((), dtype=probs.dtype, device=probs.device), probs)
    qk.append(probs)
    y = ctx.arithmetic.matmul(ctx.node, probs, V, "activations", ctx.role(2))
    if three_d:
        y = y.transpose(1, 2).reshape(y.shape[0], y.shape[2], -1)
    return y, present_k, present_v, qk[min(qk_matmul_output_mode, 3)]
