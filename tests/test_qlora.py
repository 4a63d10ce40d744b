"""QLoRA (`model.quantization`, rlhf_cli.quantization): what is refused before anything loads, which models load
quantized, a LoRA SFT step on a 4-bit base, the doctor's bytes, and export into plain weights. Tests that load a
quantized model need bitsandbytes (pip install 'rlhf-cli[qlora]'; it runs nf4 on the CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from clitools import EVAL_ROWS

from rlhf_cli import memory as M
from rlhf_cli import quantization
from rlhf_cli.config import compose
from rlhf_cli.errors import RlhfError
from rlhf_cli.settings import of

SFT_STEP = ["device.threads=1", "model.quantization=4bit", "sft.lora.enabled=true", "sft.max_steps=2",
            "sft.eval_steps=100", "sft.per_device_train_batch_size=4", "sft.per_device_eval_batch_size=8",
            "data.max_rows=48", EVAL_ROWS]


def bnb():
    return pytest.importorskip("bitsandbytes")


def quantized(model) -> set[str]:
    return {type(m).__name__ for m in model.modules() if type(m).__name__ in ("Linear4bit", "Linear8bitLt")}


def test_a_no_grad_forward_leaves_the_4bit_layers_training_as_before(base):
    """bitsandbytes repacks a 4-bit layer for its AVX512-BF16 CPU kernel at the first eval-mode forward without
    gradients and then runs every forward through that kernel, which has no backward: the gradient through the frozen
    weights changed after the first sampled batch (measured on a Xeon: a difference larger than the gradient).
    Loaded here, the gradient after such a forward equals the one before it, on every CPU."""
    bnb()
    from rlhf_cli.models import load_causal_lm, quantization_config

    cfg = compose("sft", ["model.quantization=4bit"])
    ids = torch.tensor([[1, 5, 9, 13, 17, 21]])

    def input_grad(after_a_sampling_forward: bool) -> torch.Tensor:
        model = load_causal_lm(base, torch.float32, cfg.model, quantization_config(of(cfg)))
        if after_a_sampling_forward:
            with torch.no_grad():
                model.eval()(ids)
        emb = model.train().get_input_embeddings()(ids).detach().requires_grad_(True)
        model(inputs_embeds=emb).logits.sum().backward()
        return emb.grad

    before, after = input_grad(False), input_grad(True)
    assert before.abs().max() > 0
    torch.testing.assert_close(after, before, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("command", ["sft", "dpo", "ppo"])
def test_a_quantized_full_fine_tune_is_refused_naming_the_lora_key(command):
    cfg = compose(command, ["model.quantization=4bit", f"{command}.lora.enabled=false"])
    with pytest.raises(RlhfError) as e:
        quantization.check(of(cfg))
    msg = str(e.value)
    assert "model.quantization=4bit" in msg and f"{command}.lora.enabled=true" in msg
    assert "model.quantization=none" in msg and "\n" not in msg


def test_lora_stages_and_reward_pass_the_check():
    """sft / dpo with LoRA, ppo (LoRA by default), eval; reward trains every weight in fp32 and is not refused."""
    bnb()
    for command, args in (("sft", ["sft.lora.enabled=true"]), ("dpo", ["dpo.lora.enabled=true"]), ("ppo", []),
                          ("reward", []), ("eval", [])):
        quantization.check(of(compose(command, ["model.quantization=8bit", *args])))
    quantization.check(compose("sft", ["model.quantization=none"]))  # a full fine-tune, unquantized
    recipe = compose("sft", ["recipe=tiny-qlora"])  # make chain-qlora's SFT: QLoRA, the embedding trained whole
    quantization.check(of(recipe))
    assert recipe.model.quantization == "4bit" and recipe.sft.lora.enabled
    assert list(recipe.sft.lora.modules_to_save) == ["lm_head"]


def test_sharding_and_a_missing_bitsandbytes_are_one_line(monkeypatch):
    with pytest.raises(RlhfError, match="device.strategy=fsdp"):
        quantization.check(of(compose("ppo", ["model.quantization=4bit", "device=fsdp"])))
    monkeypatch.setattr(quantization.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RlhfError, match=r"pip install 'rlhf-cli\[qlora\]'"):
        quantization.check(of(compose("ppo", ["model.quantization=4bit"])))


def test_sft_refuses_a_full_fine_tune_of_a_4bit_model_before_loading(run_cli, tmp_path):
    rc, out, err = run_cli("sft", "model.quantization=4bit", "device.threads=1", f"run_dir={tmp_path / 'run'}")
    assert rc != 0
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert "model.quantization=4bit" in lines[-1] and "sft.lora.enabled=true" in lines[-1]
    assert not (tmp_path / "run" / "base").exists()  # refused before the tiny base was built


# ------------------------------------------------------------------------------------------------ the doctor
ARCH = M.Arch(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, head_dim=32, tie_word_embeddings=True)
# per layer: q 64·64 + k 64·32 + v 64·32 + o 64·64 + gate, up, down 64·128 each = 36,864 weights; 2 layers
LINEAR_WEIGHTS, LINEAR_ROWS = 73_728, 2 * (64 + 32 + 32 + 64 + 128 + 128 + 64)


def test_the_quantized_linears_are_the_decoders():
    assert M.quantized_linears(ARCH) == (LINEAR_WEIGHTS, LINEAR_ROWS)
    assert quantization.linear_bytes("4bit", LINEAR_WEIGHTS, LINEAR_ROWS) == LINEAR_WEIGHTS * 9 / 16  # 0.5 + 4/64
    assert quantization.linear_bytes("8bit", LINEAR_WEIGHTS, LINEAR_ROWS) == LINEAR_WEIGHTS + 4 * LINEAR_ROWS


@pytest.mark.parametrize("stage,item", [("sft", "policy base"), ("ppo", "policy base"), ("ppo", "value trunk"),
                                        ("ppo", "reward model weights"), ("dpo", "policy base")])
def test_doctor_plans_frozen_4bit_weights_at_nine_sixteenths_of_a_byte(stage, item):
    cfg = compose("doctor", ["model.dtype=bfloat16", "ppo.value_lora=true", "sft.lora.enabled=true",
                             "dpo.lora.enabled=true"])
    plain = M.plan_stage(cfg, stage, ARCH, M.setup_from(cfg))
    q4 = M.plan_stage(cfg, stage, ARCH, M.Setup(**{**M.setup_from(cfg).__dict__, "quantization": "4bit"}))
    bf16 = next(i.bytes for i in plain.items if i.name == item)
    nf4 = next(i.bytes for i in q4.items if i.name == item)
    # the decoder's linear weights go from 2 B to 0.5625 B each; embeddings, norms and heads stay bf16
    assert bf16 - nf4 == LINEAR_WEIGHTS * (2 - 0.5625)
    assert nf4 < bf16


def test_doctor_bytes_match_what_bitsandbytes_holds(base):
    """The plan's nf4 bytes of the tiny base's decoder = bitsandbytes' packed weights + fp32 absmax constants."""
    bnb()
    from rlhf_cli.models import load_causal_lm, quantization_config

    cfg = compose("ppo", ["model.quantization=4bit"])
    model = load_causal_lm(base, torch.float32, cfg.model, quantization_config(of(cfg)))
    held = 0
    for m in model.modules():
        if type(m).__name__ == "Linear4bit":
            absmax = m.weight.quant_state.absmax
            held += m.weight.numel() * m.weight.element_size() + absmax.numel() * absmax.element_size()
    arch = M.arch_from_config(json.loads((Path(base) / "config.json").read_text()))
    assert held == quantization.linear_bytes("4bit", *M.quantized_linears(arch))


# ------------------------------------------------------------------------------------------------ loading
@pytest.fixture(scope="module")
def reward_dir(base, tok, tmp_path_factory):
    """A sequence classifier on the tiny base, as rlhf reward writes one (plain fp32 weights)."""
    from rlhf_cli.models import load_seq_cls

    d = tmp_path_factory.mktemp("rm") / "reward"
    load_seq_cls(base, tok, torch.float32).save_pretrained(str(d))
    tok.save_pretrained(str(d))
    return d


def test_ppo_loads_the_policy_base_value_trunk_and_reward_model_in_4bit(base, tok, reward_dir):
    bnb()
    from rlhf_cli.ppo.build import build_ppo_models

    cfg = compose("ppo", ["model.quantization=4bit", f"ppo.policy_dir={base}", f"ppo.reward_dir={reward_dir}",
                          "ppo.value_lora=true", "device.fast_paths=off"])
    m = build_ppo_models(cfg, tok, torch.device("cpu"), torch.float32)
    assert quantized(m.policy) == {"Linear4bit"} and m.ref is None  # the reference: the same base, adapter off
    assert quantized(m.value) == {"Linear4bit"}
    assert quantized(m.reward) == {"Linear4bit"}
    trainable = [p for p in m.policy.parameters() if p.requires_grad]
    assert trainable and all(p.dtype == torch.float32 for p in trainable)  # fp32 adapters on the 4-bit base
    full = compose("ppo", ["model.quantization=4bit", f"ppo.policy_dir={base}", f"ppo.reward_dir={reward_dir}"])
    value = build_ppo_models(full, tok, torch.device("cpu"), torch.float32).value
    assert not quantized(value)  # a value model that trains every weight stays plain fp32


def test_8bit_loads_int8_layers_that_run_on_the_cpu(base, tok):
    """bitsandbytes 0.50.2 runs int8 on the CPU too (it computes in fp16 there): not refused."""
    bnb()
    from rlhf_cli.models import load_causal_lm, quantization_config

    cfg = compose("ppo", ["model.quantization=8bit"])
    model = load_causal_lm(base, torch.float32, cfg.model, quantization_config(of(cfg)))
    assert quantized(model) == {"Linear8bitLt"}
    with torch.no_grad():
        assert torch.isfinite(model(tok(["hello"], return_tensors="pt")["input_ids"]).logits).all()


def test_a_4bit_policy_samples_and_scores_with_the_same_forward(base, tok):
    """PPO's first-update check: before any update the policy is the reference, so log-probs of a sampled
    response from the sampling pass and from a full forward with the adapter disabled agree on a 4-bit base."""
    bnb()
    from peft import get_peft_model

    from rlhf_cli.models import load_policy, lora_config, quantization_config

    cfg = compose("ppo", ["model.quantization=4bit"])
    policy = get_peft_model(load_policy(base, torch.float32, cfg.model, quant=quantization_config(of(cfg))),
                            lora_config(cfg.ppo.lora, "CAUSAL_LM")).eval()
    torch.manual_seed(0)
    prompt = tok(["<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"], return_tensors="pt")
    with torch.no_grad():
        out = policy.generate(**prompt, max_new_tokens=8, min_new_tokens=8, do_sample=True, top_k=0,
                              return_dict_in_generate=True, output_logits=True, pad_token_id=tok.pad_token_id)
        n = prompt["input_ids"].shape[1]
        resp = out.sequences[:, n:]
        sampled = torch.stack(out.logits, 1).log_softmax(-1).gather(-1, resp[..., None])[..., 0]
        with policy.disable_adapter():
            logits = policy(out.sequences).logits[:, n - 1:-1]
        ref = logits.log_softmax(-1).gather(-1, resp[..., None])[..., 0]
    assert (sampled - ref).abs().mean().item() < 1e-3


def test_modules_to_save_train_the_tied_output_layer_that_the_fused_head_reads(base):
    """sft.lora.modules_to_save=[lm_head] on a model with tied embeddings: the output layer trains whole, stays
    tied to the input embedding, and `get_output_embeddings().weight` (what trl's fused LM head multiplies by) is
    the trainable copy."""
    bnb()
    from peft import get_peft_model

    from rlhf_cli.models import load_causal_lm, lora_config, quantization_config

    cfg = compose("sft", ["recipe=tiny-qlora"])
    model = get_peft_model(load_causal_lm(base, torch.float32, cfg.model, quantization_config(of(cfg))),
                           lora_config(cfg.sft.lora, "CAUSAL_LM"))
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    assert head.weight.requires_grad and head.weight is emb.weight
    assert quantized(model) == {"Linear4bit"}
    plain = get_peft_model(load_causal_lm(base, torch.float32), lora_config(compose("sft", []).sft.lora, "CAUSAL_LM"))
    assert not plain.get_output_embeddings().weight.requires_grad  # without the key: frozen, as before


def test_modules_to_save_names_are_checked_against_the_model(base):
    """peft skips a modules_to_save name that matches no layer without a word: here it is one line naming the
    key; a dotted path (model.embed_tokens) matches as peft matches it."""
    from rlhf_cli.models import load_causal_lm, lora_config

    model = load_causal_lm(base, torch.float32)
    lcfg = compose("sft", ["sft.lora.modules_to_save=[lm_head, model.embed_tokens]"]).sft.lora
    assert lora_config(lcfg, "CAUSAL_LM", model, "sft.lora").modules_to_save == ["lm_head", "model.embed_tokens"]
    bad = compose("sft", ["sft.lora.modules_to_save=[lm_haed]"]).sft.lora
    with pytest.raises(RlhfError) as e:
        lora_config(bad, "CAUSAL_LM", model, "sft.lora")
    assert "sft.lora.modules_to_save" in str(e.value) and "lm_haed" in str(e.value) and "\n" not in str(e.value)


def test_sft_with_an_unknown_modules_to_save_name_exits_with_one_line(run_cli, tmp_path):
    rc, out, err = run_cli("sft", "device.threads=1", "sft.lora.enabled=true", "sft.lora.modules_to_save=[lm_haed]",
                           "sft.max_steps=1", "data.max_rows=48", f"run_dir={tmp_path / 'run'}")
    assert rc != 0
    last = [ln for ln in err.strip().splitlines() if ln.strip()][-1]
    assert "sft.lora.modules_to_save" in last and "lm_haed" in last
    assert not (tmp_path / "run" / "sft").exists()


# ------------------------------------------------------------------------------------------------ training
def test_qlora_sft_and_dpo_steps(run_cli, tmp_path):
    """A LoRA SFT step on the 4-bit tiny base; the published model is the adapter merged into the base loaded
    unquantized: fp32 weights, no quantization config, loadable by stock transformers. Then a LoRA DPO step on
    that model in 4 bits: an fp32 adapter is published."""
    bnb()
    rc, out, err = run_cli("sft", *SFT_STEP, "sft.lora.modules_to_save=[lm_head]", "sft.learning_rate=1e-2",
                           f"run_dir={tmp_path / 'run'}")
    assert rc == 0, err[-2000:]
    sft = tmp_path / "run" / "sft"
    assert "quantization_config" not in json.loads((sft / "config.json").read_text())
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(sft))
    assert not quantized(model) and all(p.dtype == torch.float32 for p in model.parameters())
    # the embedding trained whole (modules_to_save) is in the merged model, still tied to the output layer
    before = AutoModelForCausalLM.from_pretrained(str(tmp_path / "run" / "base")).get_input_embeddings().weight
    assert not torch.equal(model.get_input_embeddings().weight, before)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert json.loads((sft / "metrics.json").read_text())["steps"] == 2
    rc, out, err = run_cli("dpo", *SFT_STEP, "dpo.lora.enabled=true", "dpo.max_steps=2", "dpo.eval_steps=100",
                           "dpo.per_device_train_batch_size=4", "dpo.per_device_eval_batch_size=8",
                           f"run_dir={tmp_path / 'run'}")
    assert rc == 0, err[-2000:]
    from safetensors.torch import load_file

    adapter = load_file(str(tmp_path / "run" / "dpo" / "adapter_model.safetensors"))
    assert adapter and all(t.dtype == torch.float32 for t in adapter.values())


def test_export_merges_a_4bit_adapter_into_plain_weights(run_cli, base, tok, tmp_path):
    """An adapter trained on the 4-bit base exports into the base loaded unquantized: the merged model is the
    unquantized base + the adapter, loaded by stock transformers."""
    bnb()
    from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from rlhf_cli.models import load_policy, lora_config, merge_lora, quantization_config
    from rlhf_cli.ppo.checkpoint import save_model

    cfg = compose("ppo", ["model.quantization=4bit"])
    adapted = get_peft_model(load_policy(base, torch.float32, cfg.model, quant=quantization_config(of(cfg))),
                             lora_config(cfg.ppo.lora, "CAUSAL_LM"))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)  # a trained-looking adapter: B starts at zero
    ppo = tmp_path / "ppo"
    save_model(adapted, ppo)
    tok.save_pretrained(str(ppo))
    merged_dir = tmp_path / "merged"
    rc, out, err = run_cli("export", "device.threads=1", "model.quantization=4bit", f"ppo.output_dir={ppo}",
                           f"ppo.policy_dir={base}", f"export.output_dir={merged_dir}")
    assert rc == 0, err[-2000:]
    assert "loaded unquantized" in out
    assert "quantization_config" not in json.loads((merged_dir / "config.json").read_text())
    merged = AutoModelForCausalLM.from_pretrained(str(merged_dir)).eval()
    assert not quantized(merged)
    # the same adapter on the plain fp32 base, merged: the exported weights
    plain = get_peft_model(load_policy(base, torch.float32), lora_config(cfg.ppo.lora, "CAUSAL_LM"))
    set_peft_model_state_dict(plain, get_peft_model_state_dict(adapted))
    expect = merge_lora(plain).eval()
    ids = tok(["hello there"], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, expect(ids).logits, rtol=1e-4, atol=1e-4)


def test_a_quantized_run_prints_no_kernel_hub_line():
    """bitsandbytes says at import, at warning level, that it could not fetch an optional CPU kernel from a hub (it
    runs its own); after the stage's setup a quantized run's output has no such line. A new interpreter: this
    process imported bitsandbytes long ago."""
    bnb()
    import subprocess
    import sys

    script = ("import logging\nlogging.basicConfig(level=logging.INFO)\nfrom rlhf_cli.config import compose\n"
              "from rlhf_cli.hardware import setup_torch\nfrom rlhf_cli.settings import of\n"
              "setup_torch(of(compose('sft', ['model.quantization=4bit', 'device.threads=1'])))\n"
              "import bitsandbytes\nprint('imported', bitsandbytes.__name__)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False, timeout=300)
    assert proc.returncode == 0 and "imported bitsandbytes" in proc.stdout, proc.stderr[-2000:]
    assert "kernel" not in (proc.stdout + proc.stderr).lower(), proc.stderr[-2000:]
