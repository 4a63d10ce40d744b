"""The fused RMSNorm: the formula on numbers checkable by hand, its gradients against autograd's, the models'
norm layers switched with the same outputs and gradients, and the layers and inputs it leaves alone."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from rlhf_cli.accel import fused

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


def test_lora_linear_by_hand():
    x = torch.tensor([[1.0, 2.0]], requires_grad=True)
    w, a = torch.eye(2), torch.tensor([[1.0, 1.0]], requires_grad=True)
    b = torch.tensor([[1.0], [0.0]], requires_grad=True)
    y = fused.LoraLinearFunction.apply(x, w, None, a, b, 2.0)
    # x·Wᵀ = [1, 2]; x·Aᵀ = 3; 2 · 3 · Bᵀ = [6, 0]
    assert y.tolist() == [[7.0, 2.0]]
    y.sum().backward()
    # dy = [1, 1]: dh = 2 · dy·B = 2; dx = dy·W + dh·A = [1, 1] + [2, 2]; dA = dh·x = [2, 4]; dB = 2 · dyᵀ·h = [6, 6]
    assert x.grad.tolist() == [[3.0, 3.0]] and a.grad.tolist() == [[2.0, 4.0]] and b.grad.tolist() == [[6.0], [6.0]]


def _lora_model():
    from peft import LoraConfig, get_peft_model

    m = get_peft_model(_tiny_qwen3(), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                  task_type="CAUSAL_LM"))
    for n, p in m.named_parameters():
        if "lora_B" in n:
            p.data.normal_(0, 0.1)
    return m.eval()


def test_switched_lora_layers_give_peft_outputs_and_gradients():
    from rlhf_cli.accel import sample_loop as rollout

    a = _lora_model()
    b = copy.deepcopy(a)
    assert fused.fuse_lora_linears(b) == 7 * 2 and fused.fuse_lora_linears(b) == 0
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
    outs = []
    for m in (a, b):
        logits = m(input_ids=ids).logits
        logits.pow(2).mean().backward()
        outs.append((logits.detach(), {n: p.grad for n, p in m.named_parameters() if p.requires_grad}))
    torch.testing.assert_close(outs[1][0], outs[0][0], atol=1e-6, rtol=1e-5)
    q = b.base_model.model.model.layers[0].self_attn.q_proj
    assert "LoraLinearFunction" in type(q(torch.randn(3, 16)).grad_fn).__name__  # the switched path ran
    assert outs[0][1].keys() == outs[1][1].keys() and all(k.count("lora_") for k in outs[0][1])
    for n, g in outs[0][1].items():
        torch.testing.assert_close(outs[1][1][n], g, atol=1e-6, rtol=1e-4, msg=n)
    with torch.no_grad():
        # adapter off (the reference) and merged for sampling: PEFT's own paths, same numbers as the unswitched model
        with a.disable_adapter():
            ref_a = a(input_ids=ids).logits
        with b.disable_adapter():
            ref_b = b(input_ids=ids).logits
        assert torch.equal(ref_a, ref_b) and not torch.allclose(ref_b, outs[1][0])
        with rollout.lora_merged(b):
            merged = b(input_ids=ids).logits
        torch.testing.assert_close(merged, outs[1][0], atol=1e-5, rtol=1e-5)
        # without gradients the layer runs PEFT's forward, which calls its base layer's own forward (the sampling
        # steps' W·xᵀ switch acts there)
        layer = b.base_model.model.model.layers[0].mlp.up_proj
        seen = []
        hook = layer.base_layer.register_forward_hook(lambda mod, args, out: seen.append(1))
        layer(torch.randn(3, 16))
        hook.remove()
        assert seen == [1]
        # under autocast or in bf16, PEFT's forward too
        x = torch.randn(3, 16)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert layer(x).dtype == torch.bfloat16


def test_lora_layers_with_hooks_on_the_adapter_keep_peft_forward():
    m = _lora_model()
    fused.fuse_lora_linears(m)
    layer = m.base_model.model.model.layers[0].self_attn.q_proj
    assert fused._lora_parts(layer) is not None
    seen = []
    layer.lora_A["default"].register_forward_pre_hook(lambda mod, args: seen.append(1))
    assert fused._lora_parts(layer) is None
    layer(torch.randn(2, 16))
    assert seen == [1]  # PEFT's forward called the adapter's layer, so its hook ran
