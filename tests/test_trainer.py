"""The PPO library on a tiny model, without the CLI: `make_experience` (shapes, masks, stop tokens, where the
score is read), one `update` (the loss falls, the first ratio is 1, nothing clipped), the checkpoint round trip
(no pickle; a damaged file is an error naming it), bf16 compute with fp32 master weights, and eval sampling
through PPO's own settings."""

from __future__ import annotations

import json

import pytest
import torch

from rlhf_cli.config import compose, ppo_sizes
from rlhf_cli.errors import RlhfError
from rlhf_cli.ppo import checkpoint, core
from rlhf_cli.ppo.build import PPOModels
from rlhf_cli.ppo.config import PPOConfig
from rlhf_cli.ppo.experience import Experience, Sampling, make_experience
from rlhf_cli.ppo.forward import TokenValueModel
from rlhf_cli.ppo.trainer import PPOTrainer, PromptStream

PROMPTS = [f"<|im_start|>user\nHow do I cook rice, question {i}?<|im_end|>\n<|im_start|>assistant\n" for i in range(8)]


def ppo_cfg(**over):
    args = ["recipe=tiny", "ppo.per_device_train_batch_size=4", "ppo.gradient_accumulation_steps=2",
            "ppo.num_mini_batches=1", "ppo.rollout_forward_batch_size=8", "ppo.total_episodes=16",
            "ppo.response_length=6", "ppo.num_ppo_epochs=1", "ppo.warmup_ratio=0", "ppo.lora.r=4", "ppo.lora.alpha=8",
            "ppo.lora.target_modules=all-linear", *(f"ppo.{k}={v}" for k, v in over.items())]
    return compose("ppo", args).ppo


def build(base, tok, p, dtype=torch.float32, compute=None, work=None, seed=0, value_lora=False, rows=None):
    from accelerate import Accelerator
    from peft import get_peft_model

    from rlhf_cli.models import fp32_trainables, load_causal_lm, load_seq_cls, lora_config

    torch.manual_seed(seed)
    c = PPOConfig.from_cfg(p)
    policy = get_peft_model(load_causal_lm(base, dtype), lora_config(p.lora, "CAUSAL_LM"))
    fp32_trainables(policy)
    value = reward = None
    if c.critic:  # as build_ppo_models: a value model for gae only, a reward model only when ppo.reward names it
        value = load_seq_cls(base, tok, dtype if value_lora else torch.float32)
        if value_lora:
            value = get_peft_model(value, lora_config(p.lora, "SEQ_CLS"))
        fp32_trainables(value)
        value = TokenValueModel(value).eval()
    if c.uses_reward_model:
        reward = TokenValueModel(load_seq_cls(base, tok, dtype).requires_grad_(False)).eval()
    models = PPOModels(policy=policy.eval(), ref=None, value=value, reward=reward, score_stats=None,
                       value_source="base")
    s = Sampling(max_new_tokens=c.response_length, temperature=c.temperature, pad_id=tok.pad_token_id,
                 eos_id=tok.eos_token_id, stop_ids=(tok.eos_token_id,), forward_batch_size=8,
                 vocab_size=len(tok), recompute_logprobs=compute is not None)
    return PPOTrainer(c, ppo_sizes(p), models, tok, PromptStream(PROMPTS, 0, 0, 1, rows), s,
                      Accelerator(cpu=True), work, compute_dtype=compute)


# ------------------------------------------------------------------------------------------- experience
def test_make_experience_shapes_masks_stops_and_score_position(base, tok):
    from rlhf_cli.models import load_causal_lm, load_seq_cls

    torch.manual_seed(1)
    policy = load_causal_lm(base, torch.float32).eval()
    rm = load_seq_cls(base, tok, torch.float32).eval()
    eos = tok.eos_token_id
    # EOS made likely so that some responses stop early and others run to the length limit
    with torch.no_grad():
        policy.lm_head.weight[eos] += 0.4 * policy.lm_head.weight.std() * torch.randn_like(policy.lm_head.weight[eos])
    s = Sampling(max_new_tokens=12, temperature=1.0, pad_id=tok.pad_token_id, eos_id=eos, stop_ids=(eos,),
                 forward_batch_size=4)
    exp = make_experience(PROMPTS, tok, policy, s, reward_model=TokenValueModel(rm))
    B, R = exp.response_ids.shape
    assert B == len(PROMPTS) and R <= 12 and exp.input_ids.shape == (B, exp.context_length + R)
    for row, mask in zip(exp.response_ids.tolist(), exp.response_mask.tolist()):
        n = int(sum(mask))
        assert mask == [1.0] * n + [0.0] * (R - n)               # valid tokens first, then padding
        assert eos not in row[: n - 1]                            # nothing valid after a stop token
        assert all(t == tok.pad_token_id for t in row[n:])        # pad after it
    assert exp.has_stop.tolist() == [eos in row for row in exp.response_ids.tolist()]
    assert exp.logprobs.shape == exp.ref_logprobs.shape == exp.entropy.shape == (B, R)
    torch.testing.assert_close(exp.logprobs * exp.response_mask, exp.ref_logprobs * exp.response_mask,
                               atol=1e-5, rtol=0)                 # no adapter: the policy is the reference
    # the score is read at the last valid response token: the classifier's own "last non-pad token" agrees
    with torch.no_grad():
        own = rm(input_ids=exp.input_ids, attention_mask=exp.attention_mask).logits[:, 0]
    torch.testing.assert_close(exp.rm_scores, own, atol=1e-5, rtol=1e-5)
    assert len(exp.texts) == B and exp.values is None


def test_score_groups_order_rows_by_padding_and_put_them_back():
    from rlhf_cli.ppo.experience import _in_row_order, score_groups

    lead = [3, 0, 5, 1, 0, 2]
    mask = torch.tensor([[0] * n + [1] * (8 - n) for n in lead])
    groups, inverse = score_groups(mask, 2)
    assert [g.tolist() for g, _ in groups] == [[1, 4], [3, 5], [0, 2]]   # by leading padding, stable
    assert [st for _, st in groups] == [0, 1, 3]                         # the padding all rows of a group share
    rows = torch.arange(6.0)[:, None]
    assert _in_row_order([rows[g] for g, _ in groups], inverse).flatten().tolist() == list(range(6))
    [(whole, st)], none = score_groups(mask, None)
    assert whole == slice(None) and st == 0 and none is None and score_groups(mask, 6)[1] is None


def test_scoring_groups_only_where_the_chunk_logits_are_large(monkeypatch):
    from omegaconf import OmegaConf

    from rlhf_cli.accel import limits
    from rlhf_cli.stages._sampling import score_batch_size

    cfg = OmegaConf.create({"ppo": {"rollout_forward_batch_size": 8, "response_length": 32}})
    # Qwen3-0.6B's tokenizer: 8 x 32 x 151,669 x 4 bytes = 155 MB > 64 MiB: the micro-batch of 2
    assert score_batch_size(cfg, 2, 151_669) == 2
    # the bench's small vocabulary: 8 x 32 x 1,500 x 4 = 1.5 MB: one forward per chunk
    assert score_batch_size(cfg, 2, 1_500) is None
    monkeypatch.setattr(limits, "SCORE_GROUPS_FROM_BYTES", 8 * 32 * 1_500 * 4 - 1)
    assert score_batch_size(cfg, 2, 1_500) == 2


@pytest.mark.parametrize("recompute", [False, True])
def test_scoring_in_groups_gives_the_scores_of_one_forward(base, tok, recompute):
    """Scoring forwards over groups of rows of similar prompt length (their shared padding skipped) read the
    same log-probs, values and reward scores as one forward over the whole chunk."""
    from peft import get_peft_model

    from rlhf_cli.models import load_causal_lm, load_seq_cls, lora_config

    prompts = [f"<|im_start|>user\n{' '.join(['cook rice'] * (1 + 3 * (i % 4)))}?<|im_end|>\n<|im_start|>assistant\n"
               for i in range(8)]
    torch.manual_seed(3)
    policy = get_peft_model(load_causal_lm(base, torch.float32), lora_config(ppo_cfg().lora, "CAUSAL_LM")).eval()
    with torch.no_grad():  # a non-zero adapter: the reference (adapter disabled) differs from the policy
        for n, w in policy.named_parameters():
            if "lora_B" in n:
                w.normal_(0, 0.5)
    value = TokenValueModel(load_seq_cls(base, tok, torch.float32)).eval()
    reward = TokenValueModel(load_seq_cls(base, tok, torch.float32)).eval()
    out = {}
    for group in (None, 3):
        s = Sampling(max_new_tokens=8, temperature=0.7, pad_id=tok.pad_token_id, eos_id=tok.eos_token_id,
                     stop_ids=(tok.eos_token_id,), forward_batch_size=8, recompute_logprobs=recompute,
                     score_batch_size=group)
        torch.manual_seed(5)
        out[group] = make_experience(prompts, tok, policy, s, value_model=value, reward_model=reward)
    a, b = out[None], out[3]
    assert len(set(a.attention_mask.sum(-1).tolist())) > 2  # prompts of several lengths
    assert torch.equal(a.response_ids, b.response_ids)
    m = a.response_mask
    for f in ("logprobs", "ref_logprobs", "values", "entropy"):
        torch.testing.assert_close(getattr(b, f) * m, getattr(a, f) * m, atol=1e-5, rtol=1e-5, msg=f)
    torch.testing.assert_close(b.rm_scores, a.rm_scores, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(a.logprobs * m, a.ref_logprobs * m, atol=1e-3)


def test_fixed_length_responses_without_a_stop_token(base, tok):
    from rlhf_cli.models import load_causal_lm

    policy = load_causal_lm(base, torch.float32).eval()
    s = Sampling(max_new_tokens=5, temperature=0.7, pad_id=tok.pad_token_id, eos_id=tok.eos_token_id, stop_ids=())
    exp = make_experience(PROMPTS[:3], tok, policy, s)
    assert exp.response_ids.shape == (3, 5) and exp.response_mask.sum().item() == 15
    assert not exp.has_stop.any() and exp.rm_scores is None


def test_eval_samples_with_ppo_stop_tokens():
    """eval and PPO share one Sampling: eval keeps ppo.stop_token / stop_token_ids, its own length and temperature."""
    from rlhf_cli.stages import _sampling

    tok = type("Tok", (), {"pad_token_id": 3, "eos_token_id": 2})()
    cfg = compose("eval", ["recipe=tiny", "ppo.stop_token_ids=[7]", "eval.temperature=0.5"])
    s = _sampling.sampling(cfg, tok, 100, recompute=False, evaluation=True)
    assert s.stop_ids == (2, 7) and s.temperature == 0.5 and s.max_new_tokens == int(cfg.eval.response_length)
    cfg = compose("eval", ["recipe=tiny", "ppo.stop_token=null"])
    s = _sampling.sampling(cfg, tok, 100, recompute=False, evaluation=True)
    assert s.stop_ids == () and s.generation_config().min_new_tokens == s.max_new_tokens


def test_vocab_limit_never_samples_rows_past_the_tokenizer(base, tok):
    from rlhf_cli.models import load_causal_lm

    policy = load_causal_lm(base, torch.float32).eval()
    limit = 100
    with torch.no_grad():  # the rows past the limit would win every draw if they were not cut off
        policy.lm_head.weight[limit:] *= 50
    s = Sampling(max_new_tokens=6, temperature=1.0, pad_id=tok.pad_token_id, eos_id=tok.eos_token_id,
                 stop_ids=(tok.eos_token_id,), vocab_size=limit)
    exp = make_experience(PROMPTS, tok, policy, s)
    valid = exp.response_ids[exp.response_mask.bool()]
    assert valid.max().item() < limit


def test_check_vocab_refuses_a_tokenizer_larger_than_the_embedding(base, tok):
    from rlhf_cli.models import check_vocab, load_causal_lm

    model = load_causal_lm(base, torch.float32)
    assert check_vocab(tok, model, base) == len(tok)
    model.resize_token_embeddings(len(tok) - 10)
    with pytest.raises(RlhfError, match=f"{len(tok)} tokens but the model's embedding has {len(tok) - 10} rows"):
        check_vocab(tok, model, base)


# ------------------------------------------------------------------------------------------- update
def test_one_update_lowers_the_loss_with_ratio_one_and_nothing_clipped(base, tok, tmp_path):
    t = build(base, tok, ppo_cfg(learning_rate=1e-2), work=tmp_path)
    exp = t.compute_advantages(t.make_experience())
    assert exp.advantages.shape == exp.returns.shape == exp.response_ids.shape
    idx = torch.arange(exp.response_ids.shape[0])
    with torch.no_grad():
        before, _ = t.micro_batch_loss(exp, idx, 0)
    stats = t.update(exp)  # 1 epoch, 1 mini-batch: a single optimizer step, its stats taken before it
    assert stats["clipfrac"].item() == 0.0 and stats["vf_clipfrac"].item() == 0.0
    assert abs(stats["ratio"].item() - 1.0) < 1e-6 and stats["approxkl"].item() < 1e-10
    with torch.no_grad():
        after, after_stats = t.micro_batch_loss(exp, idx, 0)
    assert after.item() < before.item()
    assert after_stats[6].item() != 1.0  # the policy moved: the ratio is no longer 1


def test_target_kl_stops_the_epochs_early(base, tok, tmp_path):
    t = build(base, tok, ppo_cfg(learning_rate=0.05, num_ppo_epochs=4, target_kl=1e-9), work=tmp_path)
    exp = t.compute_advantages(t.make_experience())
    stats = t.update(exp)
    assert stats["pg_loss"].numel() < 4  # fewer optimizer steps than epochs


def test_first_update_check_names_the_cause(base, tok, tmp_path):
    t = build(base, tok, ppo_cfg(), work=tmp_path)
    exp = t.make_experience()
    t.check_first_update(exp)  # LoRA starts at 0: policy == reference
    bad = exp.with_(logprobs=exp.logprobs + 0.1)
    with pytest.raises(RlhfError, match="recompute_logprobs"):
        t.check_first_update(bad)


def _changed_fractions(t) -> tuple[float, float]:
    """Share of the policy's and of the value model's trainable elements that one `update` changes."""
    exp = t.make_experience()
    t.check_first_update(exp)  # with recomputed log-probs the ratio starts at 1 in bf16 too
    exp = t.compute_advantages(exp)
    before = {id(q): q.detach().clone() for q in t.pol_params + t.val_params}
    t.update(exp)
    return tuple(sum((q.detach() != before[id(q)]).sum().item() for q in ps) / sum(q.numel() for q in ps)
                 for ps in (t.pol_params, t.val_params))


def test_bf16_compute_keeps_fp32_master_weights_and_trainables_move_as_in_fp32(base, tok, tmp_path):
    """bf16 storage of frozen weights (policy base, value trunk, reward model) and bf16 compute, lr 1e-5, two
    optimizer steps (LoRA's A gets no gradient while B is 0): the trainable elements change as in fp32 (bf16
    weights would round most of these updates away)."""
    p = ppo_cfg(learning_rate=1e-5, num_ppo_epochs=2)
    t = build(base, tok, p, dtype=torch.bfloat16, compute=torch.bfloat16, work=tmp_path, value_lora=True)
    assert all(q.dtype == torch.float32 for q in t.pol_params + t.val_params)
    assert t.reward.model.model.embed_tokens.weight.dtype == torch.bfloat16
    pol16, val16 = _changed_fractions(t)
    pol32, val32 = _changed_fractions(build(base, tok, p, work=tmp_path, value_lora=True))
    assert pol16 >= 0.9 and pol16 >= 0.95 * pol32, (pol16, pol32)
    # the value LoRA's A moves by lr·g/eps at first (tiny gradients under Adam's eps): the same share in fp32
    assert val16 >= 0.95 * val32 and val16 > 0.5, (val16, val32)


# ------------------------------------------------------------------------------------------- checkpoint
def test_checkpoint_round_trip_restores_weights_optimizer_counters_and_rng(base, tok, tmp_path):
    a = build(base, tok, ppo_cfg(learning_rate=1e-2), work=tmp_path / "a")
    a.update(a.compute_advantages(a.make_experience()))
    a.progress.update, a.progress.episodes, a.progress.metrics = 1, 8, {"objective/kl": 0.5}
    path = a.save()
    assert (path / checkpoint.STATE_JSON).exists() and (path / checkpoint.STATE_TENSORS).exists()
    assert not list(path.rglob("*.pt")) and not list(path.rglob("*.bin"))  # nothing pickled
    expected_rng = torch.get_rng_state()

    b = build(base, tok, ppo_cfg(learning_rate=1e-2), work=tmp_path / "b", seed=5)
    b.resume(path)
    assert torch.equal(torch.get_rng_state(), expected_rng)
    assert (b.progress.update, b.progress.episodes, b.stream.consumed) == (1, 8, a.stream.consumed)
    for qa, qb in zip(a.pol_params + a.val_params, b.pol_params + b.val_params):
        assert torch.equal(qa, qb)
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for k in sa["state"]:
        for name, v in sa["state"][k].items():
            assert torch.equal(v, sb["state"][k][name])
    assert b.scheduler.state_dict() == a.scheduler.state_dict()
    # the two continue identically (same prompts, weights and random draws)
    ea = a.make_experience()
    torch.set_rng_state(expected_rng)
    eb = b.make_experience()
    assert torch.equal(ea.response_ids, eb.response_ids)


def test_a_pickle_in_a_checkpoint_is_never_loaded(base, tok, tmp_path):
    """A crafted state file that would run a command when unpickled: resume reads JSON and safetensors only."""
    import pickle

    a = build(base, tok, ppo_cfg(), work=tmp_path / "a")
    path = a.save()
    flag = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            import os

            return (os.system, (f"touch {flag}",))

    (path / "trainer_state.pt").write_bytes(pickle.dumps(Evil()))
    b = build(base, tok, ppo_cfg(), work=tmp_path / "b")
    b.resume(path)
    assert not flag.exists()
    (path / checkpoint.STATE_TENSORS).write_bytes(b"\x00" * 7)  # truncated: its checksum names it
    with pytest.raises(RlhfError, match=r"\(trainer_state.safetensors checksum mismatch\)"):
        b.resume(path)
    (path / checkpoint.MANIFEST).unlink()  # without checksums (an older checkpoint) the reader names the file
    with pytest.raises(RlhfError, match=str(path / checkpoint.STATE_TENSORS)):
        b.resume(path)
    (path / checkpoint.STATE_JSON).write_text("not json")
    with pytest.raises(RlhfError, match=checkpoint.STATE_JSON):
        b.resume(path)


def test_shape_scores_by_hand():
    rm = torch.tensor([2.0, 4.0, 6.0])
    has_stop = torch.tensor([True, False, True])
    empty = torch.tensor([False, False, True])
    out = core.shape_scores(rm, has_stop, empty, mean=4.0, std=2.0, missing_eos_penalty=1.0, empty_score=-5.0)
    assert out.tolist() == [-1.0, -1.0, -5.0]  # (2-4)/2; (4-4)/2 - 1; empty
    assert core.shape_scores(rm, has_stop, empty).tolist() == [2.0, 4.0, 6.0]


def test_experience_is_json_free_of_nothing():
    """Experience.cat keeps None fields None and joins texts."""
    z = torch.zeros(1, 2)
    e = Experience(input_ids=torch.zeros(1, 3, dtype=torch.long), attention_mask=torch.ones(1, 3),
                   position_ids=torch.zeros(1, 3), response_ids=torch.zeros(1, 2, dtype=torch.long),
                   response_mask=torch.ones(1, 2), logprobs=z, ref_logprobs=z, entropy=z,
                   has_stop=torch.tensor([True]), empty=torch.tensor([False]), texts=["a"])
    both = Experience.cat([e, e])
    assert both.values is None and both.texts == ["a", "a"] and json.dumps(both.texts)


# ------------------------------------------------------------------------------------------- real shape
@pytest.fixture(scope="module")
def real_width_base(tmp_path_factory):
    """Qwen3-0.6B's width, heads and vocabulary rows (151,936, more than the 2k-token tokenizer) in one layer."""
    from rlhf_cli.tiny import build_tiny_base

    return build_tiny_base(tmp_path_factory.mktemp("real") / "base", hidden_size=1024, intermediate_size=3072,
                           num_hidden_layers=1, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                           embedding_rows=151936)


def test_real_width_and_vocabulary_in_bf16(real_width_base):
    """The large-vocabulary and bf16 paths: ids past the tokenizer are never sampled, the first-update check
    passes with recomputed log-probs, trainables stay fp32 and move."""
    from rlhf_cli.models import check_vocab, load_causal_lm, load_tokenizer

    tok = load_tokenizer(real_width_base)
    assert check_vocab(tok, load_causal_lm(real_width_base, torch.bfloat16), real_width_base) == len(tok) < 151936
    t = build(real_width_base, tok, ppo_cfg(learning_rate=1e-4, per_device_train_batch_size=2,
                                            rollout_forward_batch_size=4, response_length=4),
              dtype=torch.bfloat16, compute=torch.bfloat16, work=None, value_lora=True)
    assert t.unwrapped.get_input_embeddings().weight.shape[0] == 151936
    exp = t.make_experience()
    valid = exp.response_ids[exp.response_mask.bool()]
    assert valid.max().item() < len(tok) and not exp.empty.all()
    t.check_first_update(exp)
    before = [q.detach().clone() for q in t.pol_params]
    t.update(t.compute_advantages(exp))
    assert all(q.dtype == torch.float32 for q in t.pol_params + t.val_params)
    assert any(not torch.equal(q, b) for q, b in zip(t.pol_params, before))


def test_truncated_weights_and_non_finite_models_are_refused(base, tmp_path):
    import shutil

    from rlhf_cli.models import check_finite, load_causal_lm, load_policy

    broken = tmp_path / "broken"
    shutil.copytree(base, broken)
    w = broken / "model.safetensors"
    w.write_bytes(w.read_bytes()[:100])
    with pytest.raises(RlhfError, match=f"model files in {broken} cannot be read"):
        load_causal_lm(broken, torch.float32)
    model = load_causal_lm(base, torch.float32)
    check_finite(model, "the policy", base)
    with torch.no_grad():
        model.model.norm.weight[0] = float("nan")
    model.save_pretrained(tmp_path / "nan")
    with pytest.raises(RlhfError, match="non-finite weights .*model.norm.weight"):
        load_policy(tmp_path / "nan", torch.float32)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_are_found_in_any_chunk(monkeypatch, bad):
    """check_finite reads a tensor chunk by chunk (no whole float32 copy of a bf16 embedding): a bad element in
    the last, short chunk of a bf16 weight is found; finite weights whose float32 sum overflows pass."""
    from rlhf_cli import models

    monkeypatch.setattr(models, "FINITE_CHUNK", 7)
    lin = torch.nn.Linear(5, 6).to(torch.bfloat16)  # 30 weights: chunks of 7, 7, 7, 7 and 2
    with torch.no_grad():
        lin.weight.fill_(3e38)  # finite in bf16; 7 of them sum to inf in float32
    models.check_finite(lin, "the model", "here")
    with torch.no_grad():
        lin.weight.view(-1)[29] = bad
    with pytest.raises(RlhfError, match=r"the model at here has non-finite weights \(weight\)"):
        models.check_finite(lin, "the model", "here")


# ------------------------------------------------------------------------------------------- estimators, rewards
def rules(tmp_path, body: str) -> str:
    """A reward-function file; returns its directory (the functions are `<dir>/rules.py:<name>`)."""
    import textwrap

    (tmp_path / "rules.py").write_text(textwrap.dedent(body), encoding="utf-8")
    return str(tmp_path / "rules.py")


LENGTH_RULE = """
    def length(prompts, responses, response_ids):
        return [float(len(ids)) for ids in response_ids]
    def token_sum(prompts, responses, response_ids):  # differs between responses of one prompt
        return [float(sum(ids) % 10) for ids in response_ids]
    def constant(prompts, responses):
        return [1.0] * len(responses)
    def broken(prompts, responses):
        raise ValueError("no answer field")
    def answer_index(prompts, responses, answer):  # a field of the data row, asked for by name
        return [float(a) for a in answer]
"""


def test_grpo_with_a_function_reward_loads_no_value_or_reward_model(base, tok, tmp_path):
    """grpo, n = 4, a rule as the only reward: no value model, no reward model, one parameter group; the 4
    responses to a prompt sit in consecutive rows; advantages are centred per group; no value loss."""
    f = rules(tmp_path, LENGTH_RULE)
    t = build(base, tok, ppo_cfg(advantage="grpo", samples_per_prompt=4, reward=f"[{f}:token_sum]",
                                 learning_rate=1e-2), work=tmp_path)
    assert t.value is None and t.reward is None and t.val_params == [] and len(t.optimizer.param_groups) == 1
    exp = t.make_experience()
    assert exp.values is None and exp.rm_scores is None
    assert exp.prompts[:4] == [PROMPTS[t.stream._order(0)[0]]] * 4 and exp.prompts[4] != exp.prompts[3]
    # response_ids: each response's valid tokens, no padding
    sums = torch.tensor([float(sum(r[m.bool()].tolist()) % 10) for r, m in zip(exp.response_ids, exp.response_mask)])
    torch.testing.assert_close(exp.source_scores["token_sum"], sums)
    exp = t.compute_advantages(exp)
    seq_adv = exp.advantages[:, 0].view(-1, 4)
    torch.testing.assert_close(seq_adv.sum(-1), torch.zeros(2), atol=1e-5, rtol=0)
    assert exp.returns is None and exp.rewards is None
    before = [q.detach().clone() for q in t.pol_params]
    stats = t.update(exp)
    assert stats["vf_loss"].abs().sum().item() == 0.0 and torch.isfinite(stats["kl_loss"]).all()
    m = t.metrics(exp, stats)
    assert "loss/value_avg" not in m and "val/explained_var" not in m and "objective/rm_scores" not in m
    assert m["reward/token_sum"] == pytest.approx(sums.mean().item())
    assert 0.0 <= m["reward/frac_zero_std"] <= 1.0 and 0.0 <= m["response/clipped_ratio"] <= 1.0
    assert "loss/kl_avg" in m
    assert seq_adv.abs().sum() > 0 and any(not torch.equal(q, b) for q, b in zip(t.pol_params, before))


def test_equal_rewards_in_every_group_give_zero_advantages_and_count(base, tok, tmp_path):
    f = rules(tmp_path, LENGTH_RULE)
    for advantage in ("grpo", "rloo"):
        t = build(base, tok, ppo_cfg(advantage=advantage, samples_per_prompt=2, reward=f"[{f}:constant]",
                                     empty_response_penalty="null", kl_coef=0.0), work=tmp_path)
        exp = t.compute_advantages(t.make_experience())
        assert exp.advantages.abs().max().item() == 0.0
        assert t.metrics(exp, t.update(exp))["reward/frac_zero_std"] == 1.0


@pytest.mark.parametrize("advantage", ["rloo", "reinforce_pp"])
def test_critic_free_estimators_update_the_policy(base, tok, tmp_path, advantage):
    f = rules(tmp_path, LENGTH_RULE)
    t = build(base, tok, ppo_cfg(advantage=advantage, samples_per_prompt=2, reward=f"[{f}:token_sum]",
                                 learning_rate=1e-2), work=tmp_path)
    exp = t.compute_advantages(t.make_experience())
    assert exp.advantages.abs().sum() > 0
    if advantage == "reinforce_pp":  # whitened over the batch's valid tokens
        assert abs(core.masked_mean(exp.advantages, exp.response_mask).item()) < 1e-5
    else:  # score − β·ΣKL per response; the KL is 0 before the first update
        torch.testing.assert_close(exp.rewards, exp.scores)
    before = [q.detach().clone() for q in t.pol_params]
    t.update(exp)
    assert any(not torch.equal(q, b) for q, b in zip(t.pol_params, before))


def test_reward_sources_are_summed_with_their_weights(base, tok, tmp_path):
    f = rules(tmp_path, LENGTH_RULE)
    t = build(base, tok, ppo_cfg(reward=f"[model,{f}:length]", reward_weights="[1.0,0.5]"), work=tmp_path)
    exp = t.make_experience()
    assert t.reward is not None and t.value is not None
    expected = exp.rm_scores + 0.5 * exp.response_mask.sum(-1)
    expected = torch.where(exp.empty, torch.full_like(expected, -5.0), expected)  # ppo.empty_response_penalty
    torch.testing.assert_close(exp.scores, expected)
    assert set(exp.source_scores) == {"model", "length"}


def test_the_data_rows_fields_reach_the_function_with_their_prompts(base, tok, tmp_path):
    f = rules(tmp_path, LENGTH_RULE)
    t = build(base, tok, ppo_cfg(advantage="rloo", samples_per_prompt=2, reward=f"[{f}:answer_index]",
                                 empty_response_penalty="null"), work=tmp_path,
              rows=[{"answer": i} for i in range(len(PROMPTS))])
    exp = t.make_experience()
    assert exp.scores.tolist() == [float(PROMPTS.index(q)) for q in exp.prompts]
    assert exp.rows == [{"answer": PROMPTS.index(q)} for q in exp.prompts]


def test_a_reward_function_that_raises_stops_the_run_naming_it(base, tok, tmp_path):
    f = rules(tmp_path, LENGTH_RULE)
    t = build(base, tok, ppo_cfg(advantage="reinforce_pp", reward=f"[{f}:broken]"), work=tmp_path)
    with pytest.raises(RlhfError, match=rf"^ppo.reward function {f}:broken raised ValueError: no answer field"):
        t.make_experience()


def test_critic_free_checkpoint_has_no_value_model_and_resumes(base, tok, tmp_path):
    f = rules(tmp_path, LENGTH_RULE)
    p = ppo_cfg(advantage="grpo", samples_per_prompt=2, reward=f"[{f}:length]", learning_rate=1e-2)
    a = build(base, tok, p, work=tmp_path / "a")
    a.update(a.compute_advantages(a.make_experience()))
    a.progress.update, a.progress.episodes = 1, 8
    path = a.save()
    assert not (path / "value").exists()
    b = build(base, tok, p, work=tmp_path / "b", seed=5)
    b.resume(path)
    assert all(torch.equal(qa, qb) for qa, qb in zip(a.pol_params, b.pol_params))
    assert b.progress.update == 1 and b.stream.consumed == a.stream.consumed


def test_fp16_compute_is_refused_and_collectives_take_tensors_on_the_device(base, tok, tmp_path):
    """fp16 autocast without a gradient scaler would underflow silently: refused with the way out. And a tensor
    off the process's device never enters a collective (NCCL would fail where gloo accepts it)."""
    p = ppo_cfg()
    with pytest.raises(RlhfError, match="fp16 mixed precision needs a gradient scaler.*mixed_precision=bf16"):
        build(base, tok, p, compute=torch.float16, work=tmp_path)
    t = build(base, tok, p, work=tmp_path)
    t.device = torch.device("meta")  # as if the process ran on a GPU
    with pytest.raises(RuntimeError, match="tensor on cpu would enter a collective"):
        t.global_mean(torch.ones(3))
