"""The PPO sampling loop: same tokens and logits as generate() where both are deterministic, stop handling,
EOS masking for fixed-length responses, the categorical draw, and LoRA-merged sampling."""

from __future__ import annotations

import pytest
import torch
from places import CUDA, FLASH, PLACES, dtype_for, tolerance

from rlhf_cli.accel import sample_loop as ro
from rlhf_cli.ppo import core, sampling
from rlhf_cli.ppo import forward as fw

PAD, EOS, V = 0, 1, 40


@pytest.fixture(scope="module")
def model():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False,
                      pad_token_id=PAD, eos_token_id=EOS, bos_token_id=2)
    return Qwen3ForCausalLM(cfg).eval()


def gen_config(**kw):
    from transformers import GenerationConfig

    base = dict(max_new_tokens=6, do_sample=True, temperature=0.7, top_k=0, top_p=1.0, pad_token_id=PAD,
                eos_token_id=[EOS], use_cache=True, return_dict_in_generate=True, output_logits=True)
    base.update(kw)
    return GenerationConfig(**base)


def prompts():
    ids = torch.tensor([[PAD, PAD, 5, 6, 7], [8, 9, 10, 11, 12], [PAD, 13, 14, 15, 16]])
    return ids, (ids != PAD).long()


@pytest.mark.parametrize("device, attn", PLACES)
@torch.no_grad()
def test_greedy_matches_generate(model, device, attn):
    """Prompts with uneven left padding; on CUDA with each attention implementation (the qwen3 decoder of the
    one-token step tests; on the CPU with sdpa, the module's model)."""
    if (device, attn) != ("cpu", "sdpa"):
        model = _llama_like("qwen3", attn).to(device, dtype_for(attn))
    ids, mask = (t.to(device) for t in prompts())
    g = gen_config(do_sample=False, temperature=None, top_k=None, top_p=None)
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=g)
    r = ro.sample_loop(model, ids, mask, ro.effective_generation_config(model, g), [EOS], keep_logits=True)
    resp, logits = r["response"], r["logits"]
    ref = out.sequences[:, ids.shape[1]:]
    assert torch.equal(resp, ref[:, : resp.shape[1]])
    tol = tolerance(attn) if attn == FLASH else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, torch.stack(out.logits, 1)[:, : resp.shape[1]].to(logits.dtype), **tol)


@torch.no_grad()
def test_stop_pads_after_the_stop_token_and_ends_early(model):
    ids, mask = prompts()
    # make EOS by far the likeliest token: every row stops at its first step
    bias = torch.zeros(V)
    bias[EOS] = 100.0
    model.lm_head.bias = torch.nn.Parameter(bias, requires_grad=False)
    try:
        resp = ro.sample_loop(model, ids, mask, gen_config(max_new_tokens=6), [EOS], 0.7)["response"]
        assert resp.shape == (3, 1) and resp[:, 0].tolist() == [EOS] * 3
        out = sampling.generate_chunk(model, type("T", (), {"pad_token_id": PAD})(), ids, mask,
                                      gen_config(max_new_tokens=6), [EOS], 0.7, None, engine_name="loop")
        assert out["response"].tolist() == [[EOS]] * 3 and out["mask"].tolist() == [[1.0]] * 3
        # fixed length (no stop token): EOS is masked for min_new_tokens steps, the loop runs to the end
        r = ro.sample_loop(model, ids, mask, gen_config(max_new_tokens=6, min_new_tokens=6), [], 0.7,
                           keep_logits=True)
        resp, logits = r["response"], r["logits"]
        assert resp.shape == (3, 6) and not (resp == EOS).any()
        assert logits.shape == (3, 6, V) and (logits.argmax(-1) == EOS).all()  # raw logits, not the masked ones
    finally:
        model.lm_head.bias = None


@torch.no_grad()
def test_sampled_tokens_follow_the_logits(model):
    ids, mask = prompts()
    torch.manual_seed(1)
    r = ro.sample_loop(model, ids, mask, gen_config(max_new_tokens=5, top_k=1), [], 0.7, keep_logits=True)
    resp, logits = r["response"], r["logits"]
    assert torch.equal(resp, logits.argmax(-1))  # top-k 1 is greedy
    # step-by-step log-probs and entropies are those of the stacked logits at the scoring temperature
    lp, ent = core.logprobs_and_entropy(logits, resp, 0.7)
    torch.testing.assert_close(r["logprobs"], lp)
    torch.testing.assert_close(r["entropy"], ent)
    # sampling at the scoring temperature (the PPO case) draws from the same distribution it scores
    torch.manual_seed(2)
    r2 = ro.sample_loop(model, ids, mask, gen_config(max_new_tokens=5), [], 0.7, keep_logits=True)
    lp2, ent2 = core.logprobs_and_entropy(r2["logits"], r2["response"], 0.7)
    torch.testing.assert_close(r2["logprobs"], lp2)
    torch.testing.assert_close(r2["entropy"], ent2)
    # the logits are those of a full forward over prompt + response (the old log-probs of PPO)
    full = torch.cat([ids, resp], 1)
    am = torch.cat([mask, torch.ones_like(resp)], 1)
    torch.testing.assert_close(fw.policy_logits(model, full, am, core.position_ids_from(am), 5), logits,
                               atol=1e-5, rtol=1e-5)


def test_draw_samples_the_categorical_distribution():
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(3, 7) * 2, -1)
    p[:, 2] = 0.0
    p[2] = 0.0
    p[2, 6] = 1.0  # a row with all mass on the last token
    p = p / p.sum(-1, keepdim=True)
    n = 20000
    counts = torch.zeros(3, 7)
    for _ in range(n):
        counts[torch.arange(3), ro._draw(p)] += 1
    assert counts[:, 2].sum() == 0 and counts[2, 6] == n
    assert (counts / n - p).abs().max() < 0.015


def sample_plain_and_merged(pm):
    """The same draws from the adapter as it is and from its merged weights (same seed)."""
    ids, mask = prompts()
    g = gen_config(max_new_tokens=5)
    torch.manual_seed(3)
    a = ro.sample_loop(pm, ids, mask, g, [], 0.7, keep_logits=True)
    torch.manual_seed(3)
    with ro.lora_merged(pm):
        b = ro.sample_loop(pm, ids, mask, g, [], 0.7, keep_logits=True)
    return a, b


@torch.no_grad()
def test_lora_merged_sampling_matches_the_adapter_and_restores_weights(model):
    import copy

    from peft import LoraConfig, get_peft_model

    pm = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                         task_type="CAUSAL_LM")).eval()
    for name, p in pm.named_parameters():
        if "lora_B" in name:
            p.normal_(0, 0.1)
    before = {n: (p.data_ptr(), p.clone()) for n, p in pm.named_parameters()}
    ids, mask = prompts()
    a, b = sample_plain_and_merged(pm)
    resp_a, logits_a, resp_b, logits_b = a["response"], a["logits"], b["response"], b["logits"]
    torch.testing.assert_close(logits_b, logits_a, atol=1e-5, rtol=1e-5)
    assert torch.equal(resp_a, resp_b)
    for n, p in pm.named_parameters():
        assert p.data_ptr() == before[n][0] and torch.equal(p, before[n][1]), n
    # the adapter is active again afterwards: outputs differ from the base model's
    with pm.disable_adapter():
        base = pm(input_ids=ids, attention_mask=mask).logits
    assert not torch.allclose(pm(input_ids=ids, attention_mask=mask).logits, base)


@torch.no_grad()
def test_generate_chunk_falls_back_to_generate_for_other_settings(model):
    ids, mask = prompts()
    g = gen_config(max_new_tokens=4, repetition_penalty=1.3)
    assert not ro.supported(ro.effective_generation_config(model, g))
    assert ro.sample(model, ids, mask, g, [EOS], 0.7, None) is None  # the loop declines ...
    out = sampling.generate_chunk(model, type("T", (), {"pad_token_id": PAD})(), ids, mask, g, [EOS], 0.7, None,
                                  engine_name="loop")  # ... and generate() runs
    assert out["response"].shape[0] == 3 and out["logprobs"].shape == out["entropy"].shape


@torch.no_grad()
def test_lora_on_a_tied_output_layer_leaves_the_embeddings_alone(tmp_path):
    """The tiny recipe puts a LoRA on lm_head, which the model ties to its input embeddings: merged sampling
    and merge_lora (export, chat) must change the output layer only."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from rlhf_cli.models import merge_lora

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, max_position_embeddings=64, tie_word_embeddings=True,
                      pad_token_id=PAD, eos_token_id=EOS, bos_token_id=2)
    base = Qwen3ForCausalLM(cfg).eval()
    assert base.lm_head.weight is base.model.embed_tokens.weight
    emb = base.model.embed_tokens.weight.clone()
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
    pm = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=targets, task_type="CAUSAL_LM")).eval()
    for name, p in pm.named_parameters():
        if "lora_B" in name:
            p.normal_(0, 0.1)
    ids, mask = prompts()
    want = pm(input_ids=ids, attention_mask=mask).logits
    a, b = sample_plain_and_merged(pm)
    torch.testing.assert_close(b["logits"], a["logits"], atol=1e-5, rtol=1e-5)
    assert torch.equal(pm.get_base_model().model.embed_tokens.weight, emb)

    merged = merge_lora(pm)
    assert torch.equal(merged.model.embed_tokens.weight, emb)
    torch.testing.assert_close(merged(input_ids=ids, attention_mask=mask).logits, want, atol=1e-5, rtol=1e-5)
    merged.save_pretrained(str(tmp_path))
    again = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    torch.testing.assert_close(again(input_ids=ids, attention_mask=mask).logits, want, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_large_adapted_weights_on_a_cpu_sample_unmerged(model, monkeypatch):
    import copy

    from peft import LoraConfig, get_peft_model

    pm = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                         task_type="CAUSAL_LM")).eval()
    for name, p in pm.named_parameters():
        if "lora_B" in name:
            p.normal_(0, 0.1)
    layers = [m for m in pm.modules() if hasattr(m, "base_layer") and hasattr(m, "lora_A")]
    weights = {id(m): m.base_layer.weight for m in layers}
    seen = []
    real_forward = type(layers[0]).forward

    def spy(self, x, *a, **kw):
        seen.append(self.base_layer.weight is weights[id(self)] and not self.disable_adapters)
        return real_forward(self, x, *a, **kw)

    monkeypatch.setattr(type(layers[0]), "forward", spy)
    monkeypatch.setattr(ro, "CPU_MERGE_MAX_BYTES", 0)  # every adapted weight counts as large
    a, b = sample_plain_and_merged(pm)
    assert seen and all(seen)  # the original weight, adapter on, in every forward
    assert torch.equal(a["response"], b["response"]) and torch.equal(a["logits"], b["logits"])
    monkeypatch.setattr(ro, "CPU_MERGE_MAX_BYTES", 256 * 2**20)
    seen.clear()
    sample_plain_and_merged(pm)
    assert not all(seen)  # small weights merge: a copy, with the adapter off


@torch.no_grad()
def test_preallocated_cache_gives_the_stock_cache_logits(model, monkeypatch):
    from transformers import DynamicCache

    ids, mask = prompts()
    runs = {}
    for name in ("stock", "filled"):
        if name == "stock":
            monkeypatch.setattr(ro, "preallocated_cache", lambda m, capacity: DynamicCache(config=m.config))
        else:
            monkeypatch.undo()
        torch.manual_seed(3)
        runs[name] = ro.sample_loop(model, ids, mask, gen_config(max_new_tokens=6), [], 0.7, keep_logits=True)
    assert torch.equal(runs["stock"]["response"], runs["filled"]["response"])
    torch.testing.assert_close(runs["stock"]["logits"], runs["filled"]["logits"], atol=0, rtol=0)
    # a cache sized too small grows (keeping what it holds) instead of failing
    small, stock = ro.preallocated_cache(model, 2), DynamicCache(config=model.config)
    pos = core.position_ids_from(mask)
    outs = [model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=c, use_cache=True).logits
            for c in (small, stock)]
    for step in range(7):  # past the first buffer (2 x the prompt): it grows once
        nxt = outs[0][:, -1].argmax(-1, keepdim=True)
        mask = torch.cat([mask, torch.ones_like(nxt)], 1)
        pos = pos[:, -1:] + 1
        outs = [model(input_ids=nxt, attention_mask=mask, position_ids=pos, cache=c, use_cache=True).logits
                for c in (small, stock)]
        torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=1e-6)
    assert small.get_seq_length() == stock.get_seq_length() == ids.shape[1] + 7
    assert small.layers[0]._k.shape[-2] >= small.get_seq_length()


def test_weight_first_rule(monkeypatch):
    w32, big32 = torch.zeros(64, 64), torch.zeros(1024, 1024)
    monkeypatch.setattr(ro, "weight_first_cpu", lambda: "amx")
    assert ro.weight_first(16, w32) and ro.weight_first(48, w32) and not ro.weight_first(64, w32)
    assert not ro.weight_first(8, w32) and ro.weight_first(8, big32) and not ro.weight_first(4, big32)
    assert ro.weight_first(2, w32.bfloat16()) and not ro.weight_first(16, w32.half())
    # Zen 2: fp32 only, weights of 2 M values and more (Qwen3-0.6B's MLP, LM head), 4-16 rows
    head, mlp = torch.zeros(1, 1).expand(151936, 1024), torch.zeros(1, 1).expand(3072, 1024)
    monkeypatch.setattr(ro, "weight_first_cpu", lambda: "amd-f23")
    assert all(ro.weight_first(r, w) for r in (4, 8, 16) for w in (head, mlp))
    assert not any(ro.weight_first(r, w) for r in (2, 32) for w in (head, mlp))
    assert not any(ro.weight_first(r, w) for r in (4, 8, 16) for w in (w32, big32, mlp.bfloat16()))
    # on a CPU it was not measured on, never
    monkeypatch.setattr(ro, "weight_first_cpu", lambda: None)
    assert not any(ro.weight_first(r, w) for r in (2, 8, 16, 48) for w in (w32, big32, w32.bfloat16(), head))
    monkeypatch.undo()
    assert ro.weight_first_cpu() in ("amx", "amd-f23", None)


@torch.no_grad()
def test_sampling_steps_through_weight_first_linears_score_like_a_full_forward(model, monkeypatch):
    # 16 rows: the decode steps take the W·xᵀ path (prompts repeated; every row samples its own tokens)
    ids, mask = prompts()
    ids, mask = ids.repeat(6, 1)[:16], mask.repeat(6, 1)[:16]
    calls = []
    real = ro.linear
    monkeypatch.setattr(ro, "weight_first_cpu", lambda: "amx")  # the W·xᵀ path on any CPU
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ro, "linear", lambda x, w, b=None: calls.append(x.shape) or real(x, w, b))
        torch.manual_seed(4)
        r = ro.sample_loop(model, ids, mask, gen_config(max_new_tokens=5), [], 0.7, keep_logits=True)
    assert calls and all(s[:-1].numel() == 16 for s in calls)  # the steps only, not the prefill
    assert all("forward" not in m.__dict__ for m in model.modules())  # put back
    full = torch.cat([ids, r["response"]], 1)
    am = torch.cat([mask, torch.ones_like(r["response"])], 1)
    torch.testing.assert_close(fw.policy_logits(model, full, am, core.position_ids_from(am), 5), r["logits"],
                               atol=1e-5, rtol=1e-5)
    x = torch.randn(16, 1, model.config.hidden_size)
    lin = model.model.layers[0].mlp.up_proj
    with ro.weight_first_linears(model):
        assert "forward" in lin.__dict__
        torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight), atol=1e-6, rtol=1e-5)


def _llama_like(kind: str, attn: str = "sdpa"):
    """Tiny random decoders of the three kinds the one-token step supports (GQA, untied head; Qwen2 with biases)."""
    import transformers as tf

    common = dict(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=PAD,
                  eos_token_id=EOS, bos_token_id=2)
    cfg = {"qwen3": lambda: tf.Qwen3Config(head_dim=8, **common), "qwen2": lambda: tf.Qwen2Config(**common),
           "llama": lambda: tf.LlamaConfig(head_dim=4, attention_bias=True, **common)}[kind]()
    cfg._attn_implementation = attn
    cls = {"qwen3": tf.Qwen3ForCausalLM, "qwen2": tf.Qwen2ForCausalLM, "llama": tf.LlamaForCausalLM}[kind]
    torch.manual_seed(5)
    m = cls(cfg).eval()
    for p in m.parameters():  # biases and norm weights away from their 0 / 1 init, so each term shows
        p.data.add_(torch.randn_like(p) * 0.2)
    return m


@pytest.mark.parametrize("kind", ["qwen3", "qwen2", "llama"])
@pytest.mark.parametrize("device, attn", PLACES)
@torch.no_grad()
def test_one_token_decoder_gives_the_stock_forward_logits(kind, device, attn):
    """Prompts with uneven left padding, then five teacher-forced steps; on CUDA too. The step computes sdpa's
    attention: a model on another implementation keeps the stock step."""
    from rlhf_cli.accel.decode import Decoder

    m = _llama_like(kind, attn).to(device, dtype_for(attn))
    ids, mask = (t.to(device) for t in prompts())
    pos = core.position_ids_from(mask)
    caches = [ro.preallocated_cache(m, 16), ro.preallocated_cache(m, 16)]
    logits = [m(input_ids=ids, attention_mask=mask, position_ids=pos, cache=c, use_cache=True).logits[:, -1]
              for c in caches]
    step = Decoder.of(m, caches[1])
    if attn != "sdpa":
        assert step is None
        return
    for t in range(5):  # teacher-forced: both paths get the same next tokens
        nxt = logits[0].argmax(-1)
        mask = torch.cat([mask, torch.ones_like(nxt[:, None])], 1)
        pos = pos[:, -1:] + 1
        logits = [m(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos, cache=caches[0],
                    use_cache=True).logits[:, -1], step(nxt, mask, pos)]
        torch.testing.assert_close(logits[1], logits[0], **tolerance(attn))
    assert caches[0].get_seq_length() == caches[1].get_seq_length() == ids.shape[1] + 5


@torch.no_grad()
def test_sampling_with_and_without_the_one_token_decoder_draws_the_same(model, monkeypatch):
    ids, mask = prompts()
    runs = []
    for use in (True, False):
        if not use:
            monkeypatch.setattr(ro.Decoder, "of", classmethod(lambda cls, *a, **k: None))
        torch.manual_seed(11)
        runs.append(ro.sample_loop(model, ids, mask, gen_config(max_new_tokens=6), [], 0.7, keep_logits=True))
    assert torch.equal(runs[0]["response"], runs[1]["response"])
    torch.testing.assert_close(runs[0]["logits"], runs[1]["logits"], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(runs[0]["logprobs"], runs[1]["logprobs"], atol=1e-6, rtol=1e-5)


@torch.no_grad()
def test_one_token_decoder_only_takes_plain_weights(model):
    import copy

    from peft import LoraConfig, get_peft_model

    from rlhf_cli.accel.decode import Decoder

    cache = ro.preallocated_cache(model, 8)
    assert Decoder.of(model, cache) is not None
    pm = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                         task_type="CAUSAL_LM")).eval()
    assert Decoder.of(pm, cache) is None  # an active adapter beside each weight: the stock forward
    with ro.lora_merged(pm):
        assert Decoder.of(pm, cache) is not None  # merged, adapter off: plain weights
    with pm.disable_adapter():
        assert Decoder.of(pm, cache) is not None
    hooked = copy.deepcopy(model)
    hooked.model.layers[1].mlp.register_forward_pre_hook(lambda mod, args: None)
    assert Decoder.of(hooked, cache) is None  # hooks (offloading, ZeRO-3 gathering) must run: stock forward
    windowed = copy.deepcopy(model)
    windowed.config.layer_types = ["full_attention", "sliding_attention"]
    assert Decoder.of(windowed, cache) is None
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=16, n_layer=1, n_head=2, n_positions=32)).eval()
    assert Decoder.of(gpt2, cache) is None


@pytest.mark.parametrize("fixed", [False, True], ids=["stop", "fixed-length"])
@pytest.mark.parametrize("device", [pytest.param("cpu", id="cpu"), CUDA])
@torch.no_grad()
def test_generate_engine_scores_step_by_step_as_the_stacked_logits_did(model, fixed, device):
    """The generate engine keeps one step's logits, not generate()'s (B, R, V) stack: same tokens (same seed) and
    the same log-probs and entropies as `core.logprobs_and_entropy` over the stacked raw logits, with the
    vocabulary cut and, for fixed-length responses, EOS masked while sampling but scored."""
    model = model.to(device)
    ids, mask = (t.to(device) for t in prompts())
    g = gen_config(max_new_tokens=6, eos_token_id=EOS if fixed else [EOS],
                   min_new_tokens=6 if fixed else 0, top_k=5)
    vocab = V - 3  # the model has 3 rows past the tokenizer
    torch.manual_seed(11)
    new = sampling.generate(model, ids, mask, g, [] if fixed else [EOS], 0.7, vocab)
    torch.manual_seed(11)
    from transformers import LogitsProcessorList

    class Cut:
        def __call__(self, input_ids, scores):
            scores[:, vocab:] = float("-inf")
            return scores

    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=g,
                         logits_processor=LogitsProcessorList([Cut()]))
    ref = out.sequences[:, ids.shape[1]:]
    lp, ent = core.logprobs_and_entropy(core.limit_vocab(torch.stack(out.logits, 1), vocab), ref, 0.7)
    assert torch.equal(new["response"], ref) and (ref < vocab).all()
    if fixed:
        assert new["response"].shape[1] == 6 and not (new["response"] == EOS).any()
    torch.testing.assert_close(new["logprobs"], lp, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(new["entropy"], ent, atol=1e-6, rtol=1e-6)
    model.to("cpu")


@torch.no_grad()
def test_generate_engine_asks_generate_for_no_logits(model, monkeypatch):
    """generate() is called without output_logits (nothing of size R·V is returned) and without min_new_tokens
    (the engine's processor masks EOS itself, after reading the unmasked logits)."""
    seen = {}
    real = type(model).generate

    def spy(self, *a, generation_config=None, **kw):
        seen["output_logits"], seen["min_new"] = generation_config.output_logits, generation_config.min_new_tokens
        out = real(self, *a, generation_config=generation_config, **kw)
        seen["logits"] = getattr(out, "logits", None)
        return out

    monkeypatch.setattr(type(model), "generate", spy)
    ids, mask = prompts()
    g = gen_config(max_new_tokens=4, min_new_tokens=4, eos_token_id=EOS)
    r = sampling.generate(model, ids, mask, g, [], 0.7, None)
    assert seen == {"output_logits": False, "min_new": 0, "logits": None}
    assert g.output_logits and g.min_new_tokens == 4  # the caller's config is left as it was
    assert r["logprobs"].shape == r["entropy"].shape == (3, 4)
