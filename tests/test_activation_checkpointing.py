"""`ppo.activation_checkpointing`: the policy's and the value model's decoder layers recompute their inside in the
backward. The same update either way (fp32 on the CPU recomputes the same numbers: measured equal to the last
bit; the tolerance, 1e-6, is there for a BLAS that splits its sums by thread), and each layer does run twice per
micro-batch where gradients are taken and once where they are not."""

from __future__ import annotations

import torch
from test_fast_paths import cfg_for, swapped
from test_trainer import build, ppo_cfg

from rlhf_cli import accel
from rlhf_cli.ppo.shard import checkpoint_layers, decoder_layers


def _counted(model) -> list[int]:
    """Count the calls of each decoder layer's own forward (what recomputation calls again)."""
    calls = [0]
    for layer in decoder_layers(model):
        def forward(*args, _inner=layer.forward, **kwargs):
            calls[0] += 1
            return _inner(*args, **kwargs)

        layer.forward = forward
    return calls


def _one_update(base, tok, tmp_path, checkpointed: bool):
    t = build(base, tok, ppo_cfg(learning_rate=1e-2), work=tmp_path)
    exp = t.compute_advantages(t.make_experience())  # sampled before any layer is touched: the same rollout
    calls = _counted(t.unwrapped), _counted(t.value)
    if checkpointed:
        assert checkpoint_layers(t.unwrapped) == checkpoint_layers(t.value) == len(decoder_layers(t.unwrapped))
    stats = t.update(exp)
    return stats, [q.detach().clone() for q in t.trainable()], calls, t, exp


def test_the_same_update_with_and_without_activation_checkpointing(base, tok, tmp_path):
    plain, p_weights, p_calls, _, _ = _one_update(base, tok, tmp_path / "plain", False)
    ckpt, c_weights, c_calls, t, exp = _one_update(base, tok, tmp_path / "ckpt", True)
    for k in plain:
        assert torch.allclose(plain[k], ckpt[k], rtol=1e-6, atol=1e-6), k
    assert len(p_weights) == len(c_weights)
    for a, b in zip(p_weights, c_weights):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)
    # each layer's inside ran again in the backward ...
    assert [c[0] for c in c_calls] == [2 * c[0] for c in p_calls] and p_calls[0][0] > 0
    before = [c[0] for c in c_calls]
    with torch.no_grad():  # ... and once where no gradient is taken
        t.micro_batch_loss(exp, torch.arange(exp.response_ids.shape[0]), 0)
    layers = len(decoder_layers(t.unwrapped))
    assert [c[0] - b for c, b in zip(c_calls, before)] == [layers, layers]


def test_the_config_key_wraps_policy_and_value_layers_and_turns_the_fast_paths_off(base, tok, caplog):
    from rlhf_cli.ppo.build import build_ppo_models

    cfg = cfg_for(base, "auto", "ppo.activation_checkpointing=true")
    with caplog.at_level("INFO", logger="rlhf"):
        paths = accel.configure(cfg, "cpu")
    assert not paths.on and "ppo.activation_checkpointing" in caplog.text
    models = build_ppo_models(cfg, tok, torch.device("cpu"), torch.float32, paths)
    for m in (models.policy, models.value):
        layers = decoder_layers(m)
        assert layers and all("forward" in layer.__dict__ for layer in layers)
        assert set(swapped(m)) == {n for n, mod in m.named_modules() if mod in layers}
    off = build_ppo_models(cfg_for(base, "off"), tok, torch.device("cpu"), torch.float32, accel.configure(
        cfg_for(base, "off"), "cpu"))
    assert not swapped(off.policy) and not swapped(off.value)


def test_a_sharded_policy_on_the_cpu_gives_its_head_a_contiguous_input(base):
    """generate() reads the last position as a slice: on the CPU torch multiplies such a 3-D view by the weight
    expanded per row, copying the whole weight first. Sharded placement on the CPU hooks the head so that it gets
    a contiguous input: the same logits, and the head's forward sees a contiguous tensor."""
    from rlhf_cli.models import load_causal_lm
    from rlhf_cli.ppo.shard import contiguous_head_input

    model = load_causal_lm(base, torch.float32).eval()
    seen = []
    # a forward hook sees the input as the pre-hooks left it
    model.get_output_embeddings().register_forward_hook(lambda _m, args, _out: seen.append(args[0].is_contiguous()))
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    with torch.no_grad():
        before = model(input_ids=ids, logits_to_keep=1).logits
        contiguous_head_input(model)
        after = model(input_ids=ids, logits_to_keep=1).logits
    assert seen == [False, True]
    torch.testing.assert_close(after, before)
