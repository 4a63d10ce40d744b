"""`rlhf chat` on a tiny model: the newest trained policy by default, a conversation that keeps its turns (and
`/reset`), turns dropped from the front when the context is full, and a message too long for the model refused."""

from __future__ import annotations

import io

import pytest
import torch
from omegaconf import OmegaConf

from rlhf_cli.errors import RlhfError
from rlhf_cli.stages import chat


def test_the_newest_trained_policy_by_default(tmp_path):
    cfg = OmegaConf.create({"chat": {"model_dir": None}, "ppo": {"output_dir": str(tmp_path / "ppo")},
                            "dpo": {"output_dir": str(tmp_path / "dpo")}, "sft": {"output_dir": str(tmp_path / "sft")}})
    with pytest.raises(RlhfError, match="run `rlhf sft` first"):
        chat.newest_policy(cfg)
    (tmp_path / "sft").mkdir()
    assert chat.newest_policy(cfg) == tmp_path / "sft"
    (tmp_path / "dpo").mkdir()
    assert chat.newest_policy(cfg) == tmp_path / "dpo"
    (tmp_path / "ppo").mkdir()
    assert chat.newest_policy(cfg) == tmp_path / "ppo"
    cfg.chat.model_dir = str(tmp_path / "sft")
    assert chat.newest_policy(cfg) == tmp_path / "sft"


@pytest.fixture(scope="module")
def model(base):
    from rlhf_cli.models import load_causal_lm

    return load_causal_lm(base, torch.float32).eval()


def settings(**kw):
    return OmegaConf.create({"max_new_tokens": 4, "do_sample": False, "temperature": 1.0, "top_k": 0, "top_p": 1.0,
                             **kw})


def test_a_conversation_keeps_its_turns_and_reset_starts_over(model, tok, monkeypatch):
    seen = []
    real = chat.prompt_text
    monkeypatch.setattr(chat, "prompt_text", lambda tk, msgs, *a: seen.append(list(msgs)) or real(tk, msgs, *a))
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\nhow are you?\n/reset\nagain\n"))
    cfg = OmegaConf.create({"chat": {**settings(), "model_dir": None, "prompt": None, "system_prompt": None},
                            "ppo": {"output_dir": "/nonexistent", "policy_dir": "/nonexistent"},
                            "sft": {"output_dir": "/nonexistent"}, "model": {"enable_thinking": False},
                            "device": {"accelerator": "cpu"}})
    monkeypatch.setattr(chat, "setup_torch", lambda cfg: None)
    monkeypatch.setattr(chat, "newest_policy", lambda cfg: "tiny")
    monkeypatch.setattr(chat, "load_policy", lambda *a, **k: model)
    monkeypatch.setattr(chat, "load_tokenizer", lambda *a, **k: tok)
    monkeypatch.setattr(chat, "resolve_precision", lambda cfg: (torch.float32, None))
    chat.run(cfg)
    assert [len(m) for m in seen] == [1, 3, 1]  # hello; hello, answer, how are you?; after /reset: again
    assert seen[1][0]["content"] == "hello" and seen[1][1]["role"] == "assistant"
    assert seen[2] == [{"role": "user", "content": "again"}]


def test_a_full_context_drops_the_oldest_turns_and_a_long_message_is_refused(model, tok):
    limit = model.config.max_position_embeddings
    long_turns = [{"role": "user", "content": "hello " * (limit // 6)}, {"role": "assistant", "content": "hi"}]
    reply = chat.answer(model, tok, [*long_turns * 3, {"role": "user", "content": "and now?"}], settings())
    assert isinstance(reply, str)
    with pytest.raises(RlhfError, match=r"the message is \d+ tokens .* at most \d+ before a 4-token answer"):
        chat.answer(model, tok, [{"role": "user", "content": "hello " * (2 * limit)}], settings())
