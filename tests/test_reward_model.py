"""A reward model with a tokenizer of its own (`rlhf_cli.ppo.reward_model`): chosen only when the tokenizers
differ, texts rendered the way the model was trained to read them, scores equal to the model's own forward on
those texts, and the sampling path scoring through it."""

from __future__ import annotations

import pytest
import torch

from rlhf_cli.config import compose
from rlhf_cli.data import prompt_text
from rlhf_cli.models import load_seq_cls, load_tokenizer
from rlhf_cli.ppo.experience import Sampling, make_experience
from rlhf_cli.ppo.forward import TokenValueModel
from rlhf_cli.ppo.reward_model import TextRewardModel, know_prompts, load_reward_model, own_tokenizer

OTHER_TEMPLATE = ("{%- for m in messages -%}{{- '[' + m['role'] + '] ' + m['content'] + '\\n' -}}{%- endfor -%}"
                  "{%- if add_generation_prompt -%}{{- '[assistant] ' -}}{%- endif -%}")
CONV = [{"role": "user", "content": "How do I cook rice?"}]


def seq_cls_dir(base, out, template=None):
    """A sequence-classification copy of `base` (random score head) with its tokenizer, in `out`."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(base))
    if template is not None:
        tok.chat_template = template
    torch.manual_seed(0)
    model = load_seq_cls(base, tok, torch.float32)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def cfg():
    return compose("ppo", ["recipe=tiny"])


@pytest.fixture(scope="module")
def foreign(tmp_path_factory):
    """A reward model on another vocabulary (700 tokens, another seed) and another chat template."""
    from rlhf_cli.tiny import build_tiny_base

    root = tmp_path_factory.mktemp("foreign")
    other = build_tiny_base(root / "base", seed=3, vocab_size=700, hidden_size=32, intermediate_size=64,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    return seq_cls_dir(other, root / "rm", OTHER_TEMPLATE)


def own_score(rm_dir, text: str) -> float:
    """The model's own forward on one text (no padding): the score at its last token."""
    tok = load_tokenizer(rm_dir, scoring=True)
    model = load_seq_cls(rm_dir, tok, torch.float32).eval()
    ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        return model(input_ids=ids).logits[0, 0].item()


def test_the_same_tokenizer_keeps_the_token_id_path(base, tok, cfg, tmp_path):
    rm_dir = seq_cls_dir(base, tmp_path / "rm")
    assert own_tokenizer(rm_dir, tok, cfg) is None
    assert isinstance(load_reward_model(rm_dir, tok, torch.float32, cfg, "cpu"), TokenValueModel)
    # the same vocabulary under another chat template is not the same tokenizer: the texts must be re-rendered
    other = seq_cls_dir(base, tmp_path / "rm_template", OTHER_TEMPLATE)
    assert own_tokenizer(other, tok, cfg) is not None


def test_a_foreign_reward_model_scores_whole_conversations_like_its_own_forward(foreign, tok, cfg):
    rm_tok = own_tokenizer(foreign, tok, cfg)
    assert rm_tok is not None and len(rm_tok) != len(tok)
    rm = load_reward_model(foreign, tok, torch.float32, cfg, "cpu", rm_tok)
    assert isinstance(rm, TextRewardModel) and not rm.rlhf_format  # no rlhf marker: a published model's usage
    prompts = [prompt_text(tok, CONV)]
    know_prompts(rm, (prompts, [type("Ex", (), {"prompt": CONV})()]))
    [text] = rm.texts(prompts, ["Boil it, please."], [True])
    assert text == "[user] How do I cook rice?\n[assistant] Boil it, please.\n"
    assert rm(prompts, ["Boil it, please."], [True]).item() == pytest.approx(own_score(foreign, text), abs=1e-5)


def test_rlhf_format_batches_truncation_and_eos(foreign, cfg):
    rm_tok = load_tokenizer(foreign, scoring=True)
    scorer = TokenValueModel(load_seq_cls(foreign, rm_tok, torch.float32)).eval()
    rm = TextRewardModel(scorer, rm_tok, rlhf_format=True)
    convs = [CONV, [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"}]]
    prompts = ["p0", "p1"]
    rm.know(prompts, [type("Ex", (), {"prompt": c})() for c in convs])
    responses, ended = ["Boil it in water, please, thank you.", "Hello"], [True, False]
    texts = rm.texts(prompts, responses, ended)
    # as rlhf reward trained it: the rendered prompt + answer + EOS; a response cut at the length limit has no EOS
    assert texts[0] == prompt_text(rm_tok, CONV) + responses[0] + rm_tok.eos_token
    assert texts[1] == prompt_text(rm_tok, convs[1]) + "Hello"
    batched = rm(prompts, responses, ended)  # left-padded together
    torch.testing.assert_close(batched, torch.tensor([own_score(foreign, t) for t in texts]), atol=1e-5, rtol=0)
    # over its length limit a text loses its beginning, never the end where the score is read
    rm.max_length = 8
    ids = rm_tok(texts[0], add_special_tokens=False)["input_ids"]
    assert len(ids) > 8
    with torch.no_grad():
        tail = scorer.model(input_ids=torch.tensor([ids[-8:]])).logits[0, 0]
    assert rm(prompts[:1], responses[:1], ended[:1]).item() == pytest.approx(tail.item(), abs=1e-5)


def test_sampling_scores_through_a_foreign_reward_model(base, tok, foreign, cfg):
    from rlhf_cli.models import load_causal_lm

    rm = load_reward_model(foreign, tok, torch.float32, cfg, "cpu", own_tokenizer(foreign, tok, cfg))
    prompts = [prompt_text(tok, [{"role": "user", "content": f"Question {i}?"}]) for i in range(4)]
    rm.know(prompts, [type("Ex", (), {"prompt": [{"role": "user", "content": f"Question {i}?"}]})() for i in range(4)])
    torch.manual_seed(0)
    policy = load_causal_lm(base, torch.float32).eval()
    s = Sampling(max_new_tokens=6, temperature=1.0, pad_id=tok.pad_token_id, eos_id=tok.eos_token_id,
                 stop_ids=(tok.eos_token_id,), forward_batch_size=2)
    exp = make_experience(prompts, tok, policy, s, reward_model=rm)
    assert exp.rm_scores.shape == (4,)
    torch.testing.assert_close(exp.rm_scores, rm(prompts, exp.texts, exp.has_stop.tolist()), atol=1e-6, rtol=0)
