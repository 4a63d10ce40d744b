"""The last decoder layer run on the read positions only (rlhf_cli.accel.tail): the same logits, values, scores
and gradients as the whole-sequence forward, and the stock forward wherever the span does not apply."""

from __future__ import annotations

import copy

import pytest
import torch
from places import PLACES, dtype_for, tolerance

from rlhf_cli.accel import tail
from rlhf_cli.ppo import core
from rlhf_cli.ppo import forward as fw

V, PAD, EOS = 40, 0, 1


def _config(kind: str, attn: str = "sdpa", layers: int = 3):
    import transformers as tf

    common = dict(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  tie_word_embeddings=False, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=2)
    cfg = {"qwen3": lambda: tf.Qwen3Config(head_dim=8, **common), "qwen2": lambda: tf.Qwen2Config(**common),
           "llama": lambda: tf.LlamaConfig(head_dim=4, attention_bias=True, **common)}[kind]()
    cfg._attn_implementation = attn
    return cfg


def _randomised(m):
    torch.manual_seed(5)
    for p in m.parameters():  # biases and norm weights away from their 0 / 1 init, so each term shows
        p.data.add_(torch.randn_like(p) * 0.2)
    return m.eval()


def _lm(kind: str, attn: str = "sdpa"):
    import transformers as tf

    cls = {"qwen3": tf.Qwen3ForCausalLM, "qwen2": tf.Qwen2ForCausalLM, "llama": tf.LlamaForCausalLM}[kind]
    return _randomised(cls(_config(kind, attn)))


def _seq_cls():
    import transformers as tf

    cfg = _config("qwen3")
    cfg.num_labels = 1
    return _randomised(tf.Qwen3ForSequenceClassification(cfg))


def _batch(padded: bool = True):
    """Left-padded prompts ++ responses of R = 4 tokens, the second right-padded after its 2nd token."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :3] = 0
        mask[2, :1] = 0
        mask[1, -2:] = 0
        ids[mask == 0] = PAD
    return ids, mask, core.position_ids_from(mask)


@pytest.mark.parametrize("kind", ["qwen3", "qwen2", "llama"])
@pytest.mark.parametrize("device, attn", PLACES)
@pytest.mark.parametrize("padded", [True, False])
def test_policy_logits_and_gradients_equal_the_whole_sequence_forward(kind, device, attn, padded):
    """Uneven left padding (and right padding in one response); on CUDA with each attention implementation (an
    implementation the span does not compute itself runs the layer's own forward, sliced)."""
    ref = _lm(kind, attn).to(device, dtype_for(attn))
    ours = copy.deepcopy(ref)
    assert tail.install(ours) == 1 and tail.install(ours) == 1  # idempotent
    assert tail.layer_of(ours) is not None and tail.layer_of(ref) is None
    ids, mask, pos = (t.to(device) for t in _batch(padded))
    rows = []
    ours.model.layers[-1].mlp.register_forward_hook(lambda mod, a, out: rows.append(a[0].shape[1]))
    outs = []
    for m in (ref, ours):
        logits = fw.policy_logits(m, ids, mask, pos, 4)
        assert logits.shape == (3, 4, V)
        logits.pow(2).mean().backward()
        outs.append((logits.detach(), [p.grad.clone() for p in m.parameters()]))
    # the rewritten layer ran on the 4 positions that emit the response; flash: the stock layer on all 9, sliced
    assert rows == ([4] if attn in tail._ATTENTION else [9])
    torch.testing.assert_close(outs[1][0], outs[0][0], **tolerance(attn))
    for a, b in zip(outs[1][1], outs[0][1], strict=True):
        torch.testing.assert_close(a, b, **tolerance(attn))


def test_the_span_computes_the_last_layer_on_fewer_rows():
    """The span is real work saved: the last layer's MLP sees the span's rows, the other layers every row."""
    m = _lm("qwen3")
    tail.install(m)
    rows = {}
    hooks = [layer.mlp.register_forward_hook(lambda mod, a, out, i=i: rows.__setitem__(i, a[0].shape[1]))
             for i, layer in enumerate(m.model.layers)]
    ids, mask, pos = _batch()
    with torch.no_grad():
        fw.policy_logits(m, ids, mask, pos, 4)
    for h in hooks:
        h.remove()
    assert rows == {0: 9, 1: 9, 2: 4}


def test_values_and_scores_equal_the_whole_sequence_forward():
    ref = fw.TokenValueModel(_seq_cls())
    ours = copy.deepcopy(ref)
    assert tail.install(ours) == 1 and tail.layer_of(ours) is not None
    ids, mask, pos = _batch()
    last = torch.tensor([8, 6, 8])
    with torch.no_grad():
        full = ref(ids, mask, pos)
        torch.testing.assert_close(ours(ids, mask, pos), full, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(ours(ids, mask, pos, response_length=4), fw.response_slice(full, 4),
                                   atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(ref(ids, mask, pos, response_length=4), fw.response_slice(full, 4))
        torch.testing.assert_close(ours.score_at(ids, mask, pos, last), full[torch.arange(3), last],
                                   atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(ref.score_at(ids, mask, pos, last), full[torch.arange(3), last])
    ours(ids, mask, pos, response_length=4).sum().backward()
    ref(ids, mask, pos, response_length=4).sum().backward()
    # a weight's gradient sums over every token, the span's in another order (it runs fewer rows): fp32 rounding of
    # the sum, up to 3e-6 on a CPU without AVX-512 (the forward outputs above stay within 1e-6)
    for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5)


def test_lora_policy_and_its_adapter_disabled_reference_through_the_span():
    from peft import LoraConfig, get_peft_model

    from rlhf_cli.accel.fused import fuse_lora_linears
    from rlhf_cli.ppo.experience import reference_logits

    base = _lm("qwen3")
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"],
                     lora_dropout=0.0, init_lora_weights=False)
    ref = get_peft_model(copy.deepcopy(base), cfg)
    ours = copy.deepcopy(ref)
    fuse_lora_linears(ours)
    assert tail.install(ours) == 1 and tail.layer_of(ours) is not None
    ids, mask, pos = _batch()
    for m in (ref, ours):
        m.eval()
    torch.testing.assert_close(fw.policy_logits(ours, ids, mask, pos, 4),
                               fw.policy_logits(ref, ids, mask, pos, 4), atol=1e-6, rtol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(reference_logits(ours, None, ids, mask, pos, 4),
                                   reference_logits(ref, None, ids, mask, pos, 4), atol=1e-6, rtol=1e-5)


def test_outside_a_span_and_with_a_cache_the_layer_runs_its_own_forward():
    ref = _lm("qwen3")
    ours = copy.deepcopy(ref)
    tail.install(ours)
    ids, mask, pos = _batch()
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids, attention_mask=mask, position_ids=pos).logits,
                                   ref(input_ids=ids, attention_mask=mask, position_ids=pos).logits)
        with tail.span(5, 8):  # a cache: the stock layer, the span sliced from its output
            out = ours.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        full = ref.model(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
        assert out.last_hidden_state.shape[1] == 3
        torch.testing.assert_close(out.last_hidden_state, full[:, 5:8], atol=1e-6, rtol=1e-5)


def test_models_the_span_does_not_reach_keep_the_whole_forward():
    m = _lm("qwen3")
    m.model.layers[-1].gradient_checkpointing = True
    tail.install(m)
    m.train()
    assert tail.layer_of(m) is None  # a checkpoint's recompute would run outside the span
    m.eval()
    assert tail.layer_of(m) is not None
    hooked = _lm("qwen3")
    hooked.model.layers[0].register_forward_hook(lambda *a: None)
    assert tail.install(hooked) == 0 and tail.layer_of(hooked) is None
    sliding = _lm("qwen3")
    sliding.config.layer_types = ["full_attention", "full_attention", "sliding_attention"]
    assert tail.install(sliding) == 0
