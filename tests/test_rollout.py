"""Rollout plumbing with numbers checkable by hand: stop-token truncation, chunk concatenation and trimming,
per-token values and last-token scores from a sequence-classification model, the prompt stream."""

from __future__ import annotations

import torch

from rlhf_cli.ppo import core
from rlhf_cli.ppo.core import position_ids_from
from rlhf_cli.ppo.experience import Experience
from rlhf_cli.ppo.forward import TokenValueModel, response_slice
from rlhf_cli.ppo.sampling import truncate_at_stop
from rlhf_cli.ppo.trainer import PromptStream

PAD, EOS = 3, 2


def test_truncate_at_first_stop_keeps_eos_and_pads_after():
    resp = torch.tensor([[5, 6, EOS, 7, EOS],    # stops at 2
                         [EOS, 5, 6, 7, 8],      # length-1 response: only EOS
                         [5, 6, 7, 8, 9]])       # no stop: full length
    tokens, mask = truncate_at_stop(resp, [EOS], PAD)
    assert tokens.tolist() == [[5, 6, EOS, PAD, PAD], [EOS, PAD, PAD, PAD, PAD], [5, 6, 7, 8, 9]]
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]]
    # the score goes on the EOS (row 0, 1) or the last token (row 2)
    assert core.last_token_index(mask).tolist() == [2, 0, 4]


def test_truncate_with_extra_stop_ids_and_without_stop():
    resp = torch.tensor([[5, 9, 6, EOS]])
    tokens, mask = truncate_at_stop(resp, [EOS, 9], PAD)
    assert tokens.tolist() == [[5, 9, PAD, PAD]] and mask.tolist() == [[1, 1, 0, 0]]
    tokens, mask = truncate_at_stop(resp, [], PAD)
    assert tokens.tolist() == resp.tolist() and mask.tolist() == [[1, 1, 1, 1]]


def _rollout(B: int, P: int, R: int, valid: list[int]) -> Experience:
    resp_mask = torch.tensor([[1.0] * v + [0.0] * (R - v) for v in valid])
    attn = torch.cat([torch.ones(B, P, dtype=torch.long), resp_mask.long()], 1)
    z = torch.zeros(B, R)
    return Experience(input_ids=torch.arange(B * (P + R)).view(B, P + R), attention_mask=attn,
                      position_ids=position_ids_from(attn), response_ids=torch.ones(B, R, dtype=torch.long),
                      response_mask=resp_mask, logprobs=z.clone(), ref_logprobs=z.clone(), values=z.clone(),
                      scores=torch.zeros(B), rm_scores=torch.zeros(B), has_stop=torch.ones(B, dtype=torch.bool),
                      empty=torch.zeros(B, dtype=torch.bool), entropy=z.clone(), texts=[f"r{i}" for i in range(B)])


def test_cat_pads_shorter_chunks_and_trim_drops_all_padding_columns():
    a, b = _rollout(2, 3, 4, [2, 1]), _rollout(1, 3, 6, [3])
    both = Experience.cat([a, b])
    assert both.response_ids.shape == (3, 6) and both.input_ids.shape == (3, 9)
    assert both.texts == ["r0", "r1", "r0"] and both.advantages is None
    assert both.response_mask.sum(-1).tolist() == [2, 1, 3]
    t = both.trim()
    assert t.response_ids.shape == (3, 3) and t.input_ids.shape == (3, 6)  # longest valid response is 3
    assert t.context_length == 3
    assert t.response_mask.sum(-1).tolist() == [2, 1, 3]


def test_position_ids_follow_the_attention_mask():
    attn = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    assert position_ids_from(attn).tolist() == [[0, 0, 0, 1, 2, 2], [0, 1, 2, 3, 4, 5]]


def test_response_slice_takes_the_states_that_emit_each_response_token():
    x = torch.arange(7.0).view(1, 7)  # P = 4, R = 3: states 3, 4, 5 emit response tokens 0, 1, 2
    assert response_slice(x, 3).tolist() == [[3.0, 4.0, 5.0]]


def test_token_values_and_last_token_score_match_the_classifier(tmp_path):
    """Per-token values through the score head agree with the classifier's own score at the last token."""
    from transformers import AutoModelForSequenceClassification, Qwen3Config

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, pad_token_id=PAD,
                      num_labels=1)
    model = AutoModelForSequenceClassification.from_config(cfg).eval()
    vm = TokenValueModel(model)
    ids = torch.tensor([[PAD, 10, 11, 12, EOS, PAD], [10, 11, 12, 13, 14, EOS]])
    attn = (ids != PAD).long()
    pos = position_ids_from(attn)
    with torch.no_grad():
        per_token = vm(ids, attn, pos)
        last = torch.tensor([4, 5])
        at_last = vm.score_at(ids, attn, pos, last)
        ref = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, 0]
    assert per_token.shape == (2, 6)
    torch.testing.assert_close(at_last, per_token[torch.arange(2), last])
    torch.testing.assert_close(at_last, ref)


def test_prompt_stream_repeats_shuffles_and_shards():
    prompts = [f"p{i}" for i in range(5)]
    s = PromptStream(prompts, seed=0, rank=0, world=1)
    first, second = s.take(5), s.take(5)
    assert sorted(first) == sorted(prompts) and sorted(second) == sorted(prompts)
    assert s.consumed == 10
    r0, r1 = PromptStream(prompts, 0, 0, 2), PromptStream(prompts, 0, 1, 2)
    assert not set(r0.take(2)) & set(r1.take(2))  # disjoint shards
    again = PromptStream(prompts, seed=0, rank=0, world=1)
    again.consumed = 5
    assert again.take(5) == second  # a restored counter continues the same order
