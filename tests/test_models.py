"""Model sources (local dir, ModelScope and Hugging Face caches, offline), dtypes, tokenizer checks."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from omegaconf import OmegaConf

from rlhf_cli.errors import RlhfError
from rlhf_cli.hardware import resolve_dtype
from rlhf_cli.models import load_tokenizer
from rlhf_cli.sources import resolve_model_source


@pytest.fixture
def no_network(monkeypatch) -> list:
    """Every attempt to look up or reach a host, refused and recorded: these answers come from disk alone, at
    once, with no hub client's retries (a check that holds however busy the machine is)."""
    import socket

    tried = []

    def refuse(*args, **kwargs):
        tried.append(args[:2])
        raise OSError("network access where none is needed")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    return tried


def outcome(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - returned for the caller to check
        return e


# -------------------------------------------------------------------------------------------- sources
def test_local_dir_is_returned(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    assert resolve_model_source(str(d)) == d
    assert resolve_model_source(str(d), hub="hf", offline=True) == d


def test_local_dir_without_config(tmp_path):
    with pytest.raises(RlhfError, match="has no config.json"):
        resolve_model_source(str(tmp_path))


@pytest.mark.parametrize("name", ["/nonexistent/model", "./nonexistent", "~/nonexistent-rlhf-model", "a/b/c"])
def test_nonexistent_path_fails_fast(name, no_network):
    err = outcome(resolve_model_source, name, hub="modelscope", offline=False)
    assert isinstance(err, RlhfError), err
    assert "does not exist" in str(err)
    assert not no_network


def test_unknown_hub():
    with pytest.raises(RlhfError, match="model.hub=nohub is unknown"):
        resolve_model_source("Org/Name", hub="nohub", offline=True)


def test_modelscope_legacy_cache(tmp_path, no_network):
    d = tmp_path / "Org" / "Name"
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    found = outcome(resolve_model_source, "Org/Name", hub="modelscope", cache_dir=str(tmp_path), offline=True)
    assert not isinstance(found, Exception), found
    assert found.resolve() == d.resolve()
    assert not no_network


def hf_cache(cache_dir, org, name, sha="0123456789abcdef0123456789abcdef01234567"):
    repo = cache_dir / f"models--{org}--{name}"
    snap = repo / "snapshots" / sha
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(sha)
    return snap


def test_hf_cache(tmp_path, no_network):
    snap = hf_cache(tmp_path, "Org", "Name")
    found = outcome(resolve_model_source, "Org/Name", hub="hf", cache_dir=str(tmp_path), offline=True)
    assert not isinstance(found, Exception), found
    assert found.resolve() == snap.resolve()
    assert not no_network


@pytest.mark.parametrize("hub", ["modelscope", "hf"])
def test_id_not_in_cache_offline_fails_fast(tmp_path, hub, no_network):
    hf_cache(tmp_path, "Org", "Other")
    err = outcome(resolve_model_source, "Org/Missing", hub=hub, cache_dir=str(tmp_path), offline=True)
    assert isinstance(err, RlhfError), err
    assert f"Org/Missing is not in the local {hub} cache and model.offline=true" in str(err)
    assert "\n" not in str(err)
    assert not no_network


# --------------------------------------------------------------------------------------------- dtypes
def test_resolve_dtype():
    assert resolve_dtype("auto", "cpu") is torch.float32
    assert resolve_dtype(None, "cpu") is torch.float32
    assert resolve_dtype("bfloat16", "cpu") is torch.bfloat16
    assert resolve_dtype("float16", "cuda") is torch.float16
    assert resolve_dtype("float32", "cuda") is torch.float32


def test_resolve_dtype_auto_on_cuda_without_a_gpu():
    if torch.cuda.is_available():
        assert resolve_dtype("auto", "cuda") in (torch.bfloat16, torch.float16)
    else:
        assert resolve_dtype("auto", "cuda") is torch.float32


@pytest.mark.parametrize("name", ["bf17", "Tensor", "nn", ""])
def test_resolve_dtype_bad_name(name):
    with pytest.raises(RlhfError, match=f"model.dtype={name} is not a torch dtype"):
        resolve_dtype(name, "cpu")


# ------------------------------------------------------------------------------------------ tokenizer
@pytest.fixture(scope="module")
def base_tok():
    from rlhf_cli.tiny import train_tokenizer

    return train_tokenizer(["How do I sleep better at night?", "Keep a fixed bedtime.", "Thanks!"] * 3,
                           vocab_size=300)


def save_tok(tok, path, **attrs):
    import copy

    tok = copy.deepcopy(tok)
    for k, v in attrs.items():
        setattr(tok, k, v)
    tok.save_pretrained(str(path))
    return path


def model_cfg(pad_token=None):
    return OmegaConf.create({"trust_remote_code": False, "pad_token": pad_token})


def test_load_tokenizer_ok(tmp_path, base_tok):
    path = save_tok(base_tok, tmp_path / "tok")
    tok = load_tokenizer(path, model_cfg())
    assert tok.pad_token == "<|pad|>" and tok.eos_token == "<|im_end|>"
    assert tok.pad_token_id != tok.eos_token_id
    assert tok.padding_side == "left"
    assert load_tokenizer(path).pad_token == "<|pad|>"  # no model config


def test_load_tokenizer_pad_equal_to_eos_raises(tmp_path, base_tok):
    path = save_tok(base_tok, tmp_path / "tok", pad_token="<|im_end|>")
    with pytest.raises(RlhfError) as e:
        load_tokenizer(path, model_cfg())
    msg = str(e.value)
    assert "\n" not in msg
    assert str(path) in msg and "pad == EOS" in msg and "model.pad_token" in msg


def test_pad_token_override_fixes_it(tmp_path, base_tok):
    path = save_tok(base_tok, tmp_path / "tok", pad_token="<|im_end|>")
    tok = load_tokenizer(path, model_cfg("<|endoftext|>"))
    assert tok.pad_token == "<|endoftext|>"
    assert tok.pad_token_id == tok.convert_tokens_to_ids("<|endoftext|>")
    assert tok.pad_token_id != tok.eos_token_id


def test_pad_token_override_must_exist(tmp_path, base_tok):
    path = save_tok(base_tok, tmp_path / "tok", pad_token="<|im_end|>")
    with pytest.raises(RlhfError, match=r"model\.pad_token='<\|nope\|>' is not in the tokenizer's vocab"):
        load_tokenizer(path, model_cfg("<|nope|>"))


def test_missing_chat_template_gets_chatml(tmp_path, base_tok, caplog):
    from rlhf_cli.tiny import CHAT_TEMPLATE

    path = save_tok(base_tok, tmp_path / "tok", chat_template=None)
    with caplog.at_level(logging.WARNING, logger="rlhf"):
        tok = load_tokenizer(path, model_cfg())
    assert tok.chat_template == CHAT_TEMPLATE
    assert "no chat template" in caplog.text


def test_tokenizer_without_pad_token_says_so(tmp_path, base_tok):
    path = save_tok(base_tok, tmp_path / "tok", pad_token=None)
    with pytest.raises(RlhfError, match="has no pad token"):
        load_tokenizer(path, model_cfg())
    assert load_tokenizer(path, model_cfg("<|pad|>")).pad_token == "<|pad|>"


def save_small_causal_lm(path) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, pad_token_id=0)
    Qwen3ForCausalLM(cfg).save_pretrained(str(path))


@pytest.mark.parametrize("impl", [None, "eager"])
def test_attn_implementation_reaches_the_loaded_models(tmp_path, impl):
    from rlhf_cli.models import load_causal_lm, load_kwargs

    save_small_causal_lm(tmp_path)
    mcfg = OmegaConf.create({"trust_remote_code": False, "attn_implementation": impl})
    assert load_kwargs(mcfg) == ({"trust_remote_code": False} if impl is None else
                                 {"trust_remote_code": False, "attn_implementation": "eager"})
    model = load_causal_lm(tmp_path, torch.float32, mcfg)
    assert model.config._attn_implementation == (impl or "sdpa")


def test_unknown_attn_implementation_names_the_key(tmp_path):
    from rlhf_cli.models import load_causal_lm

    save_small_causal_lm(tmp_path)
    mcfg = OmegaConf.create({"trust_remote_code": False, "attn_implementation": "foo"})
    with pytest.raises(RlhfError, match=r"model\.attn_implementation=foo .*use null"):
        load_causal_lm(tmp_path, torch.float32, mcfg)


def test_pre_ampere_bf16_emulation_is_not_native(monkeypatch):
    """torch says bf16 is supported on pre-Ampere GPUs through emulation; `auto` must pick fp16 there."""
    from rlhf_cli import hardware

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    assert hardware.cuda_bf16_native("cuda") is False and hardware.cuda_bf16_native("cpu") is None
    assert hardware.resolve_dtype("auto", "cuda") == torch.float16
    assert hardware.resolve_compute_dtype("auto", "cuda") == torch.float16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)  # Ampere+
    assert hardware.resolve_dtype("auto", "cuda") == torch.bfloat16


def test_cuda_processes_get_their_own_gpu_and_a_growing_allocator(monkeypatch):
    from rlhf_cli import hardware

    chosen = []
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    hardware.setup_cuda()
    assert chosen == [1] and os.environ["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "backend:cudaMallocAsync")  # the user's own setting stays
    hardware.setup_cuda()
    assert os.environ["PYTORCH_ALLOC_CONF"] == "backend:cudaMallocAsync"


def test_the_wrong_kind_of_model_is_refused(base, tok, tmp_path):
    """A reward model where a policy belongs (ppo.policy_dir, chat, export) and a causal LM where a trained reward
    head belongs (ppo.reward_dir, eval.reward_dir): one line naming the directory, what it holds, what makes one.
    A value model may start from a causal LM (value_init=sft / base): its head is new by design."""
    from rlhf_cli import models

    rm_dir = tmp_path / "rm"
    models.load_seq_cls(base, tok, torch.float32).save_pretrained(str(rm_dir))
    assert models.model_kind(rm_dir) == "seq_cls" and models.model_kind(base) == "causal_lm"
    assert models.model_kind(tmp_path) is None  # nothing there to say
    with pytest.raises(RlhfError, match=r"rm holds a sequence classifier \(a reward or value model\), not a causal "
                                        r"language model \(a policy\); point at a base model or at the output of "
                                        r"rlhf sft"):
        models.load_policy(rm_dir, torch.float32)
    with pytest.raises(RlhfError, match=r"holds a causal language model \(a policy\), not a sequence classifier.*"
                                        r"a reward model comes from rlhf reward"):
        models.load_seq_cls(base, tok, torch.float32, trained_head=True)
    assert models.load_seq_cls(base, tok, torch.float32).score.out_features == 1  # a value model from a policy


def test_pickle_weights_are_never_loaded(base, tmp_path):
    """A model directory with only pickle weights: one line naming the file, before transformers (or torch's
    `weights_only` advice) is reached."""
    import shutil

    from safetensors.torch import load_file

    from rlhf_cli import models

    pk = tmp_path / "pickled"
    shutil.copytree(base, pk)
    (w,) = pk.glob("*.safetensors")
    torch.save(load_file(str(w)), pk / "pytorch_model.bin")
    w.unlink()
    with pytest.raises(RlhfError, match=r"pickled/pytorch_model.bin holds pickle weights, which rlhf never loads"):
        models.load_causal_lm(pk, torch.float32)


@pytest.mark.parametrize("hub, var", [("modelscope", "MODELSCOPE_DOMAIN_URL"), ("hf", "HF_ENDPOINT")])
def test_an_unreachable_hub_is_one_line_before_the_client_retries(tmp_path, monkeypatch, hub, var):
    """Not cached, the network allowed, the hub not answering (a closed local port stands for it): one line
    naming the host, without the hub client's half minute of retries."""
    import socket

    from rlhf_cli import sources

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv(var, f"http://127.0.0.1:{port}")
    assert "127.0.0.1 cannot be reached (ConnectionRefusedError" in sources.unreachable(hub)
    with pytest.raises(RlhfError, match=rf"Org/Missing is not in the local {hub} cache and 127.0.0.1 cannot be "
                                        r"reached .*check the network \(`rlhf doctor`\)"):
        resolve_model_source("Org/Missing", hub=hub, cache_dir=str(tmp_path), offline=False)
