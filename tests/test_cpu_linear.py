"""oneDNN linear layers (rlhf_cli.accel.cpu_linear): the same outputs and gradients as F.linear on numbers checkable by
hand and on random ones, the inputs that keep F.linear, the mode switch, and installing on a model (with the
sampling steps' W·xᵀ layers on top)."""

from __future__ import annotations

import copy
import os
import time

import pytest
import torch
from torch import nn

from rlhf_cli.accel import cpu_linear as cl
from rlhf_cli.accel import sample_loop as ro

pytestmark = pytest.mark.skipif(not cl.available(), reason="this torch has no oneDNN linear")


@pytest.fixture
def state():
    before = dict(cl._state)
    yield
    cl._state.update(before)


@pytest.fixture
def onednn(state, monkeypatch):
    """oneDNN on, for products of any width (the maths on small numbers)."""
    monkeypatch.setattr(cl, "MIN_DIM", 1)
    cl.set_mode("onednn")


def grads(fn, x, w, b, g):
    ins = [t for t in (x, w, b) if t is not None and t.requires_grad]
    y = fn(x, w, b)
    return (y, *torch.autograd.grad(y, ins, g))


def test_by_hand(onednn):
    # 32 rows (MIN_ROWS) of [1, 2] against W = [[1, 0], [1, 1], [0, 3]] and b = [0, 1, -1]: y = [1, 4, 5] each
    x = torch.tensor([[1.0, 2.0]]).repeat(cl.MIN_ROWS, 1).requires_grad_()
    w = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 3.0]], requires_grad=True)
    b = torch.tensor([0.0, 1.0, -1.0], requires_grad=True)
    assert cl.applies(x, w, b)
    y, gx, gw, gb = grads(cl.linear, x, w, b, torch.ones(cl.MIN_ROWS, 3))
    assert torch.equal(y, torch.tensor([[1.0, 4.0, 5.0]]).repeat(cl.MIN_ROWS, 1))
    assert torch.equal(gx, torch.tensor([[2.0, 4.0]]).repeat(cl.MIN_ROWS, 1))  # column sums of W
    assert torch.equal(gw, torch.tensor([[1.0, 2.0]]).repeat(3, 1) * cl.MIN_ROWS)  # 32 rows of x each
    assert torch.equal(gb, torch.full((3,), float(cl.MIN_ROWS)))


@pytest.mark.parametrize("bias", [True, False])
def test_matches_f_linear_on_strided_3d_inputs(onednn, bias):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 3, 48, generator=gen).transpose(0, 1).requires_grad_()  # (3, 40, 48), not contiguous
    w = torch.randn(80, 48, generator=gen, requires_grad=True)
    b = torch.randn(80, generator=gen, requires_grad=True) if bias else None
    g = torch.randn(3, 40, 80, generator=gen)
    assert cl.applies(x, w, b)
    got, want = grads(cl.linear, x, w, b, g), grads(nn.functional.linear, x, w, b, g)
    assert got[0].shape == (3, 40, 80) and len(got) == len(want)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-4)


def test_frozen_weight_gets_no_gradient(onednn):
    # a LoRA base: the weight is frozen, only the input's gradient flows
    x = torch.randn(64, 16, requires_grad=True)
    w = torch.randn(24, 16)
    (gx,) = torch.autograd.grad(cl.linear(x, w).sum(), (x,))
    torch.testing.assert_close(gx, w.sum(0).expand(64, 16))


def test_what_keeps_f_linear(onednn):
    w = torch.randn(8, 16)
    assert cl.applies(torch.randn(cl.MIN_ROWS, 16), w)
    assert not cl.applies(torch.randn(cl.MIN_ROWS - 1, 16), w)  # the sampling steps' few rows
    assert not cl.applies(torch.randn(64, 16, dtype=torch.bfloat16), w.bfloat16())
    assert not cl.applies(torch.randn(64, 16), w.double())
    assert not cl.applies(torch.randn(64, 16), w, torch.zeros(8, dtype=torch.float16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not cl.applies(torch.randn(64, 16), w)
        assert cl.linear(torch.randn(64, 16), w).dtype == torch.bfloat16  # autocast's F.linear
    cl.set_mode("blas")
    assert not cl.applies(torch.randn(64, 16), w)


def test_modes(state, monkeypatch):
    with pytest.raises(ValueError, match="cpu_matmul"):
        cl.set_mode("fast")
    monkeypatch.setattr(cl, "onednn_by_default", lambda: True)
    cl.set_mode("auto")
    assert cl._state["on"] is None and cl.enabled()  # the rule is read at the first use
    monkeypatch.setattr(cl, "onednn_by_default", lambda: False)  # a CPU whose BLAS keeps the products
    cl.set_mode("auto")
    assert not cl.enabled()
    cl.set_mode("onednn")
    assert cl.enabled()
    assert all(os.environ.get(v) for v in cl.CACHE_VARS)  # bounded caches (a value the user set stays)
    cl.set_mode("blas")
    assert not cl.enabled()
    monkeypatch.setattr(cl, "available", lambda: False)
    cl.set_mode("onednn")
    assert not cl.enabled()


def test_narrow_products_keep_blas_and_never_read_the_rule(state, monkeypatch):
    def check():
        raise AssertionError("the rule was read")

    monkeypatch.setattr(cl, "onednn_by_default", check)
    cl.set_mode("auto")
    narrow, wide = torch.randn(cl.MIN_DIM - 1, cl.MIN_DIM), torch.randn(cl.MIN_DIM, cl.MIN_DIM)
    x = torch.randn(64, cl.MIN_DIM)
    assert not cl.applies(x, narrow) and not cl.applies(torch.randn(64, 1), wide[:, :1])
    assert torch.equal(cl.linear(x, narrow), nn.functional.linear(x, narrow))
    m = _tiny()  # hidden 16: nothing to switch
    assert cl.install(m) == 0
    assert cl._state["on"] is None
    monkeypatch.setattr(cl, "onednn_by_default", lambda: True)
    assert cl.applies(x, wide) and cl._state["on"] is True


@pytest.mark.parametrize("fields,processor,on", [
    ({"vendor_id": "AuthenticAMD", "cpu family": "26"}, "", True),    # Zen 5: oneDNN well ahead
    ({"vendor_id": "AuthenticAMD", "cpu family": "25"}, "", False),   # Zen 3 / 4: the two close
    ({"vendor_id": "HygonGenuine", "cpu family": "24"}, "", False),
    ({"vendor_id": "GenuineIntel", "cpu family": "6"}, "", False),
    ({}, "AMD64 Family 26 Model 17 Stepping 0, AuthenticAMD", True),   # no /proc/cpuinfo (Windows)
    ({}, "AMD64 Family 25 Model 17 Stepping 1, AuthenticAMD", False),
    ({}, "Intel64 Family 6 Model 143 Stepping 8, GenuineIntel", False),
    ({}, "arm", False),
    ({}, "", False),
])
def test_auto_is_decided_by_the_cpus_maker_never_by_timing(fields, processor, on, monkeypatch):
    """The same machine always gets the same kernels: a run and its resumed part compute the same numbers."""
    from rlhf_cli.accel import limits

    monkeypatch.setattr(limits, "cpu_fields", lambda: fields)
    monkeypatch.setattr(limits.platform, "processor", lambda: processor)
    monkeypatch.setattr(time, "perf_counter", lambda: pytest.fail("auto timed something"))
    assert limits.onednn_by_default() is on


def _tiny():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False,
                      pad_token_id=0, eos_token_id=1)
    return Qwen3ForCausalLM(cfg)


def test_installed_model_same_outputs_and_gradients(onednn):
    a = _tiny()
    b = copy.deepcopy(a)
    assert cl.install(b) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer; the LM head
    assert cl.install(b) == 2 * 7 + 1  # idempotent
    ids = torch.randint(2, 40, (4, 12), generator=torch.Generator().manual_seed(1))
    outs = []
    for m in (a, b):
        logits = m(input_ids=ids).logits
        logits.float().logsumexp(-1).sum().backward()
        outs.append((logits.detach(), {n: p.grad for n, p in m.named_parameters()}))
    torch.testing.assert_close(outs[1][0], outs[0][0], atol=1e-5, rtol=1e-5)
    for n, g in outs[0][1].items():
        torch.testing.assert_close(outs[1][1][n], g, atol=1e-4, rtol=1e-4, msg=n)


def test_install_skips_when_off_or_hooked(onednn):
    m = _tiny()
    m.model.layers[0].mlp.register_forward_pre_hook(lambda mod, args: None)  # offloading / ZeRO-3 style hooks
    assert cl.install(m) == 0
    cl.set_mode("blas")
    assert cl.install(_tiny()) == 0


@torch.no_grad()
def test_weight_first_layers_on_top_and_put_back(onednn, monkeypatch):
    m = _tiny().eval()
    cl.install(m)
    monkeypatch.setattr(ro, "weight_first_cpu", lambda: "amx")  # the W·xᵀ path on any CPU
    lin = m.model.layers[0].mlp.up_proj
    with ro.weight_first_linears(m):
        assert not cl.is_installed(lin)
        x = torch.randn(16, 1, 16)  # a sampling step: 16 rows, W·xᵀ
        torch.testing.assert_close(lin(x), nn.functional.linear(x, lin.weight), atol=1e-6, rtol=1e-5)
    assert all(cl.is_installed(q) for q in m.modules() if type(q) is nn.Linear)  # oneDNN again after sampling


@pytest.mark.parametrize("rows", [cl.MIN_ROWS - 1, 96])
def test_fused_lora_function_same_with_onednn(rows, onednn):
    from rlhf_cli.accel.fused import LoraLinearFunction

    gen = torch.Generator().manual_seed(2)
    x = torch.randn(rows, 32, generator=gen, requires_grad=True)
    w, b = torch.randn(48, 32, generator=gen), torch.randn(48, generator=gen)
    a = torch.randn(4, 32, generator=gen, requires_grad=True)
    bb = torch.randn(48, 4, generator=gen, requires_grad=True)
    g = torch.randn(rows, 48, generator=gen)
    out = []
    for mode in ("blas", "onednn"):
        cl.set_mode(mode)
        y = LoraLinearFunction.apply(x, w, b, a, bb, 2.0)
        out.append((y, *torch.autograd.grad(y, (x, a, bb), g)))
    want = x @ w.T + b + 2.0 * (x @ a.T) @ bb.T
    torch.testing.assert_close(out[1][0], want, atol=1e-4, rtol=1e-4)
    for got, ref in zip(out[1], out[0]):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode", ["blas", "onednn"])
def test_the_memory_plan_counts_the_caches_when_on(mode):
    from rlhf_cli import memory as M
    from rlhf_cli.config import compose

    cfg = compose("ppo", [f"device.cpu_matmul={mode}"])
    plan = M.plan_stage(cfg, "ppo", M.arch_for_model(cfg.model)[0])
    names = [i.name for i in plan.items]
    assert ("oneDNN primitive caches" in names) == (mode == "onednn")


def test_a_bad_mode_is_a_one_line_config_error():
    from rlhf_cli.config import compose
    from rlhf_cli.errors import RlhfError

    with pytest.raises(RlhfError, match=r"device.cpu_matmul=fast is unknown; use one of auto, blas, onednn"):
        compose("ppo", ["device.cpu_matmul=fast"])
