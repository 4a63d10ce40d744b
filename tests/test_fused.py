"""The fused RMSNorm: the formula on numbers checkable by hand, its gradients against autograd's, the models'
norm layers switched with the same outputs and gradients, and the layers and inputs it leaves alone."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from rlhf_cli.ppo import fused

pytestmark = pytest.mark.skipif(fused._OP is None, reason="this torch has no fused RMSNorm kernel")


def test_rms_norm_by_hand():
    x = torch.tensor([[3.0, 4.0], [1.0, -1.0]])
    w = torch.tensor([2.0, 0.5])
    y = fused.RMSNormFunction.apply(x, w, 0.0)
    # row 0: rms = sqrt((9 + 16) / 2) = sqrt(12.5); row 1: rms = 1
    r = math.sqrt(12.5)
    torch.testing.assert_close(y, torch.tensor([[6.0 / r, 2.0 / r], [2.0, -0.5]]))


def test_gradients_match_autograd_of_the_formula():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 8, generator=gen, requires_grad=True)
    w = torch.randn(8, generator=gen).abs().add_(0.5).requires_grad_(True)
    g = torch.randn(4, 3, 8, generator=gen)
    eps = 1e-6
    ref = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    dx_ref, dw_ref = torch.autograd.grad(ref, (x, w), g)
    dx, dw = torch.autograd.grad(fused.RMSNormFunction.apply(x, w, eps), (x, w), g)
    torch.testing.assert_close(dx, dx_ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(dw, dw_ref, atol=1e-5, rtol=1e-5)
    # a frozen weight gets no gradient, the input's is the same
    (dx2,) = torch.autograd.grad(fused.RMSNormFunction.apply(x, w.detach(), eps), (x,), g)
    torch.testing.assert_close(dx2, dx_ref, atol=1e-6, rtol=1e-5)


def _tiny_qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, max_position_embeddings=64)
    m = Qwen3ForCausalLM(cfg)
    for n, p in m.named_parameters():
        if "norm" in n:
            p.data.uniform_(0.5, 1.5)
    return m


def test_a_switched_model_gives_the_same_outputs_and_gradients():
    a = _tiny_qwen3()
    b = copy.deepcopy(a)
    assert fused.fuse_rms_norms(b) == 4 * 2 + 1  # per layer: input, post-attention, q and k norms; the final norm
    assert fused.fuse_rms_norms(b) == 0  # idempotent
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
    outs = []
    for m in (a, b):
        logits = m(input_ids=ids).logits
        logits.pow(2).mean().backward()
        outs.append((logits.detach(), {n: p.grad for n, p in m.named_parameters()}))
    torch.testing.assert_close(outs[1][0], outs[0][0], atol=1e-6, rtol=1e-5)
    for n, g in outs[0][1].items():
        torch.testing.assert_close(outs[1][1][n], g, atol=1e-6, rtol=1e-4, msg=n)


def test_other_inputs_and_other_formulas_keep_the_layer_forward():
    m = _tiny_qwen3()
    norm = m.model.norm
    x = torch.randn(2, 3, 16).bfloat16()
    want = norm(x)
    fused.fuse_rms_norms(m)
    assert "forward" in norm.__dict__
    assert torch.equal(norm(x), want)  # bf16 input: the layer's own forward, bit for bit

    class OffsetRMSNorm(nn.Module):  # Gemma's formula: (1 + w) · x̂
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(16))
            self.eps = 1e-6

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight)

    holder = nn.Sequential(OffsetRMSNorm())
    assert fused.fuse_rms_norms(holder) == 0 and "forward" not in holder[0].__dict__
