"""The embedded tiny base model: tokenizer, chat template, deterministic cached build."""

from __future__ import annotations

import json

import pytest
import torch

from rlhf_cli.errors import RlhfError
from rlhf_cli.tiny import CHAT_TEMPLATE, MARKER_FILE, build_tiny_base, is_tiny_spec, train_tokenizer

torch.set_num_threads(1)

SAMPLES = [
    "Thank you for asking! Dress in layers and keep your head covered. Hope this helps.",
    "感谢你的提问！每天固定时间睡觉，睡前一小时别看手机。希望对你有帮助。",
    "Mixed 中英文 text, with    spaces\nand a newline! 123 émoji 🙂",
]
MSGS = [
    {"role": "user", "content": "How can I sleep better at night?"},
    {"role": "assistant", "content": "Happy to help! Keep a fixed bedtime. Good luck!"},
]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return build_tiny_base(tmp_path_factory.mktemp("tiny") / "base", seed=0)


@pytest.fixture(scope="module")
def tok(base_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(base_dir)


def test_is_tiny_spec():
    assert is_tiny_spec("tiny")
    assert not is_tiny_spec("Qwen/Qwen3-0.6B")
    assert not is_tiny_spec("./tiny_model")
    assert not is_tiny_spec("")


def test_train_tokenizer_deterministic_and_validated():
    texts = SAMPLES * 20
    a = train_tokenizer(texts, vocab_size=400)
    b = train_tokenizer(texts, vocab_size=400)
    assert a.get_vocab() == b.get_vocab()
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()
    assert a.chat_template == CHAT_TEMPLATE
    with pytest.raises(RlhfError):
        train_tokenizer([], vocab_size=400)


def test_tokenizer_roundtrip_and_special_tokens(tok):
    for text in SAMPLES:
        ids = tok(text)["input_ids"]
        assert tok.decode(ids) == text
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|pad|>"
    assert tok.pad_token_id != tok.eos_token_id
    assert tok.bos_token is None
    assert tok.padding_side == "left" and tok.model_max_length == 512
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"):
        assert tok.convert_ids_to_tokens(tok.convert_tokens_to_ids(special)) == special
    # no bos/eos are added automatically
    assert tok.decode(tok("hi")["input_ids"]) == "hi"
    assert 1000 <= len(tok) <= 2000


def test_chat_template(tok):
    prompt = tok.apply_chat_template(MSGS[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nHow can I sleep better at night?<|im_end|>\n<|im_start|>assistant\n"
    assert prompt.endswith("<|im_start|>assistant\n")
    # an optional system message, and enable_thinking is accepted and ignored
    with_sys = tok.apply_chat_template([{"role": "system", "content": "Be kind."}] + MSGS[:1], tokenize=False,
                                       add_generation_prompt=True, enable_thinking=False)
    assert with_sys == "<|im_start|>system\nBe kind.<|im_end|>\n" + prompt
    full = tok.apply_chat_template(MSGS, tokenize=False)
    assert full == prompt + MSGS[1]["content"] + "<|im_end|>\n"
    ids = tok.apply_chat_template(MSGS[:1], tokenize=True, add_generation_prompt=True)["input_ids"]
    assert tok.decode(ids) == prompt


def test_assistant_mask_covers_answer_and_end(tok):
    out = tok.apply_chat_template(MSGS, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert len(ids) == len(mask)
    positions = [i for i, m in enumerate(mask) if m]
    assert positions == list(range(positions[0], positions[-1] + 1))  # one contiguous span
    assert tok.decode([ids[i] for i in positions]) == MSGS[1]["content"] + "<|im_end|>"
    assert ids[positions[-1]] == tok.eos_token_id
    prompt_ids = tok.apply_chat_template(MSGS[:1], tokenize=True, add_generation_prompt=True)["input_ids"]
    assert ids[: len(prompt_ids)] == prompt_ids and positions[0] == len(prompt_ids)


def test_trl_accepts_template(tok):
    from trl.chat_template_utils import get_training_chat_template, is_chat_template_stop_token_trained

    assert get_training_chat_template(tok) is None  # no patching needed for assistant_only_loss
    assert is_chat_template_stop_token_trained(tok)


def test_build_contents_and_reload(base_dir, tok):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", MARKER_FILE):
        assert (base_dir / name).is_file(), name
    assert not [p for p in base_dir.parent.iterdir() if p.name.startswith(".")]  # no temp dirs left behind

    model = AutoModelForCausalLM.from_pretrained(base_dir)
    cfg = model.config
    assert cfg.model_type == "qwen3" and cfg.head_dim == 32 and cfg.tie_word_embeddings
    assert cfg.vocab_size == len(tok)
    assert cfg.pad_token_id == tok.pad_token_id and cfg.eos_token_id == tok.eos_token_id
    assert cfg.bos_token_id == tok.convert_tokens_to_ids("<|endoftext|>")
    assert model.generation_config.pad_token_id == tok.pad_token_id
    assert model.generation_config.eos_token_id == tok.eos_token_id
    n_params = sum(p.numel() for p in model.parameters())
    assert 300_000 <= n_params <= 1_000_000, n_params

    batch = tok([SAMPLES[0], "short"], return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape[:2] == batch["input_ids"].shape and logits.shape[-1] == len(tok)

    rm = AutoModelForSequenceClassification.from_pretrained(base_dir, num_labels=1)
    assert rm.config.pad_token_id == tok.pad_token_id
    texts = [SAMPLES[0], "short"]
    batch = tok(texts, return_tensors="pt", padding=True)
    rm.eval()
    with torch.no_grad():
        batched = rm(**batch).logits[:, 0]
        single = torch.cat([rm(**tok([t], return_tensors="pt")).logits[:, 0] for t in texts])
    assert batched.shape == (2,)
    torch.testing.assert_close(batched, single, rtol=1e-4, atol=1e-5)


def test_build_cached(base_dir):
    weights = base_dir / "model.safetensors"
    before = (weights.stat().st_mtime_ns, weights.stat().st_ino)
    again = build_tiny_base(base_dir, seed=0)
    assert again == base_dir
    assert (weights.stat().st_mtime_ns, weights.stat().st_ino) == before
    marker = json.loads((base_dir / MARKER_FILE).read_text())
    assert marker["seed"] == 0 and marker["hidden_size"] == 128 and marker["head_dim"] == 32


def test_build_deterministic_and_rebuilds_on_change(base_dir, tmp_path):
    from safetensors.torch import load_file

    ref = load_file(base_dir / "model.safetensors")
    other = build_tiny_base(tmp_path / "copy", seed=0)
    same = load_file(other / "model.safetensors")
    assert ref.keys() == same.keys()
    assert all(torch.equal(ref[k], same[k]) for k in ref)
    assert (other / "tokenizer.json").read_bytes() == (base_dir / "tokenizer.json").read_bytes()

    # a different build argument for the same directory rebuilds it in place
    rng_state = torch.get_rng_state()
    rebuilt = build_tiny_base(tmp_path / "copy", seed=1)
    assert torch.equal(torch.get_rng_state(), rng_state)  # the caller's RNG is untouched
    assert rebuilt == other
    assert json.loads((rebuilt / MARKER_FILE).read_text())["seed"] == 1
    changed = load_file(rebuilt / "model.safetensors")
    assert any(not torch.equal(ref[k], changed[k]) for k in ref)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy"]  # temp and stale dirs are gone


def test_build_rejects_file_path(tmp_path):
    target = tmp_path / "not_a_dir"
    target.write_text("x")
    with pytest.raises(RlhfError, match="not a directory"):
        build_tiny_base(target)


def test_build_refuses_foreign_dir(tmp_path):
    target = tmp_path / "someone_elses"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with pytest.raises(RlhfError, match="no tiny_base.json"):
        build_tiny_base(target)
    assert (target / "keep.txt").read_text() == "mine"
