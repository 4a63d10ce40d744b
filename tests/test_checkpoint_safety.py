"""Checkpoints that must match the run that resumes them, and runs that can move (issue 32), on a tiny trainer
built as tests/test_trainer.py builds it: saved, then damaged. Each refusal is one RlhfError line naming the
file (or the config key) and what to do, raised before any weight is loaded, so that a foreign adapter never
becomes a fresh LoRA published as trained."""

from __future__ import annotations

import json
import logging
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_trainer import build, ppo_cfg

from rlhf_cli.errors import RlhfError
from rlhf_cli.ppo import checkpoint

ADAPTER = "adapter_model.safetensors"


@pytest.fixture
def saved(base, tok, tmp_path):
    """(checkpoint path, a fresh trainer to resume it into) after one update at learning rate 1e-2."""
    a = build(base, tok, ppo_cfg(learning_rate=1e-2), work=tmp_path / "a")
    a.update(a.compute_advantages(a.make_experience()))
    a.progress.update, a.progress.episodes = 1, 8
    path = a.save()
    return path, build(base, tok, ppo_cfg(learning_rate=1e-2), work=tmp_path / "b", seed=5)


def params(t) -> list[torch.Tensor]:
    return [q.detach().clone() for q in t.pol_params + t.val_params]


def unchanged(t, before) -> bool:
    return all(torch.equal(q, b) for q, b in zip(t.pol_params + t.val_params, before))


def rewrite(file, change) -> None:
    """Replace the tensors of `file` by `change(tensors)` and sign the checkpoint again (so that the checksums
    pass and the file's contents are what is checked)."""
    save_file(change(load_file(str(file))), str(file))
    checkpoint.write_checksums(file.parent if file.parent.name.startswith("checkpoint-") else file.parent.parent)


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


# ------------------------------------------------------------------------------------------- strict loading
def test_an_adapter_with_other_keys_is_refused_and_nothing_is_loaded(saved):
    path, b = saved
    before = params(b)
    rewrite(path / ADAPTER, lambda t: {k.replace("q_proj", "qq_proj"): v for k, v in t.items()})
    with pytest.raises(RlhfError) as e:
        b.resume(path)
    msg = one_line(e)
    assert msg.startswith(f"checkpoint file {path / ADAPTER} does not match this run (missing: ")
    assert "q_proj.lora_A.weight" in msg and "not expected: " in msg and "qq_proj" in msg
    assert msg.endswith(f"resume with the config it was written with, or delete {path} to resume from an earlier "
                        "checkpoint")
    assert unchanged(b, before) and b.progress.update == 0


def test_an_adapter_of_another_rank_is_refused_naming_the_shapes(saved):
    path, b = saved
    rewrite(path / ADAPTER, lambda t: {k: (torch.zeros(8, v.shape[1]) if ".lora_A." in k else v) for k, v in t.items()})
    with pytest.raises(RlhfError, match=r"other shapes: base_model\.\S+\.lora_A\.weight \[8, 32\] vs \[4, 32\] here"):
        b.resume(path)


def test_a_value_file_with_other_keys_is_refused(saved):
    path, b = saved
    before = params(b)
    value = path / "value" / "model.safetensors"
    rewrite(value, lambda t: {k: v for k, v in t.items() if k != "score.weight"})
    with pytest.raises(RlhfError) as e:
        b.resume(path)
    assert one_line(e).startswith(f"checkpoint file {value} does not match this run (missing: score.weight)")
    assert unchanged(b, before)  # the policy's adapter, checked first and fine, is not loaded either


def test_optimizer_and_rng_state_of_other_shapes_are_refused(saved):
    path, b = saved
    state = path / checkpoint.STATE_TENSORS
    original = load_file(str(state))
    first = next(k for k in original if k.endswith("/exp_avg"))
    rewrite(state, lambda t: {**t, first: torch.zeros(3)})
    with pytest.raises(RlhfError, match=rf"^checkpoint file {re.escape(str(state))} does not match this run "
                                        rf"\(other shapes: {first} \[3\] vs \[\d+(, \d+)*\] here\)"):
        b.resume(path)
    rewrite(state, lambda t: {k: v for k, v in original.items() if k != first})
    with pytest.raises(RlhfError, match=rf"\(missing: {first}\)"):
        b.resume(path)
    rewrite(state, lambda t: {k: v for k, v in original.items() if k != "rng/0/torch"})
    with pytest.raises(RlhfError, match=r"\(missing: rng/0/torch\)"):
        b.resume(path)


def test_a_full_model_with_tied_embeddings_loads_strictly(base, tmp_path):
    from rlhf_cli.models import load_causal_lm

    a, b = load_causal_lm(base, torch.float32), load_causal_lm(base, torch.float32)
    with torch.no_grad():
        a.get_input_embeddings().weight.add_(1.0)
    checkpoint.save_model(a, tmp_path / "full")
    assert "lm_head.weight" not in load_file(str(tmp_path / "full" / "model.safetensors"))  # tied: saved once
    checkpoint.load_model_weights(b, tmp_path / "full")
    assert torch.equal(b.get_input_embeddings().weight, a.get_input_embeddings().weight)
    assert b.get_output_embeddings().weight is b.get_input_embeddings().weight
    file = tmp_path / "full" / "model.safetensors"
    save_file({k: v for k, v in load_file(str(file)).items() if "embed_tokens" not in k}, str(file))
    with pytest.raises(RlhfError, match=r"\(missing: model\.embed_tokens\.weight, lm_head\.weight\)"):
        checkpoint.load_model_weights(b, tmp_path / "full")


# ------------------------------------------------------------------------------------------------ checksums
def test_a_flipped_byte_names_the_damaged_file(saved):
    path, b = saved
    before = params(b)
    data = bytearray((path / ADAPTER).read_bytes())
    data[-1] ^= 0x01
    (path / ADAPTER).write_bytes(bytes(data))
    with pytest.raises(RlhfError) as e:
        b.resume(path)
    assert one_line(e) == (f"checkpoint {path} is damaged ({ADAPTER} checksum mismatch); delete it to resume from "
                           "the previous one")
    assert unchanged(b, before)
    data[-1] ^= 0x01
    (path / ADAPTER).write_bytes(bytes(data))
    (path / "value" / "config.json").unlink()
    with pytest.raises(RlhfError, match=r"is damaged \(value/config.json is missing\)"):
        b.resume(path)


def test_the_manifest_covers_every_file_but_the_marker(saved):
    path, _ = saved
    listed = set(json.loads((path / checkpoint.MANIFEST).read_text())["sha256"])
    files = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()}
    assert listed == {f for f in files if not f.startswith(".")} - {checkpoint.MANIFEST}
    assert {ADAPTER, "value/model.safetensors", checkpoint.STATE_JSON, checkpoint.STATE_TENSORS} <= listed


def test_an_old_checkpoint_without_manifest_or_config_loads_with_warnings(saved, caplog):
    path, b = saved
    (path / checkpoint.MANIFEST).unlink()
    doc = json.loads((path / checkpoint.STATE_JSON).read_text())
    del doc["config"]
    (path / checkpoint.STATE_JSON).write_text(json.dumps(doc))
    with caplog.at_level(logging.WARNING, logger="rlhf"):
        b.resume(path)
    assert b.progress.update == 1
    text = caplog.text
    assert f"checkpoint {path} has no {checkpoint.MANIFEST} (written by an older rlhf)" in text
    assert "written without its run config" in text


# -------------------------------------------------------------------------------------------- the JSON state
@pytest.mark.parametrize("field", ["rng", "optimizer", "scheduler", "prompts_consumed"])
def test_a_state_without_a_field_names_the_file_and_the_field(saved, field):
    path, b = saved
    jfile = path / checkpoint.STATE_JSON
    doc = json.loads(jfile.read_text())
    del doc[field]
    jfile.write_text(json.dumps(doc))
    checkpoint.write_checksums(path)
    with pytest.raises(RlhfError) as e:
        b.resume(path)
    assert one_line(e) == (f"checkpoint file {jfile} has no field '{field}'; it was written by another version or "
                           f"edited: delete {path} to resume from an earlier checkpoint")


def test_a_scheduler_state_without_a_key_and_a_broken_rng_are_named(saved):
    path, b = saved
    jfile = path / checkpoint.STATE_JSON
    doc = json.loads(jfile.read_text())
    del doc["scheduler"]["last_epoch"]
    jfile.write_text(json.dumps(doc))
    checkpoint.write_checksums(path)
    with pytest.raises(RlhfError, match=r"has no field 'scheduler\.last_epoch'"):
        b.resume(path)
    doc = json.loads(jfile.read_text())
    doc["scheduler"]["last_epoch"], doc["rng"] = 1, [{"python": [3, [1, 2], None]}]
    jfile.write_text(json.dumps(doc))
    checkpoint.write_checksums(path)
    with pytest.raises(RlhfError, match=r"field 'rng' holds no Python RNG state for process 0"):
        b.resume(path)


# ------------------------------------------------------------------------------------------ the run's shape
def test_a_changed_total_episodes_is_named_and_force_continues_with_the_new_schedule(base, tok, saved, tmp_path,
                                                                                     caplog):
    path, _ = saved
    p = ppo_cfg(learning_rate=1e-2, total_episodes=32)
    b = build(base, tok, p, work=tmp_path / "b2")
    with pytest.raises(RlhfError) as e:
        b.resume(path)
    assert one_line(e) == (f"ppo.resume: ppo.total_episodes was 16 when checkpoint {path} was written and is 32 "
                           "now; set ppo.total_episodes=16 to resume the run as it was, or ppo.resume=force to "
                           "continue it with the new values")
    with caplog.at_level(logging.WARNING, logger="rlhf"):
        b.resume(path, force=True)
    assert "ppo.resume=force: ppo.total_episodes was 16 at checkpoint-1; continuing with 32" in caplog.text
    assert b.progress.update == 1 and b.sizes.num_updates == 4
    # the new schedule (4 updates) at the step reached, not the saved one's (2 updates)
    fresh = build(base, tok, p, work=tmp_path / "fresh")
    fresh.scheduler.last_epoch = b.scheduler.last_epoch
    lam = fresh.scheduler.lr_lambdas[0](b.scheduler.last_epoch)
    assert b.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * lam) and 0 < lam < 1


def test_a_changed_learning_rate_under_force_trains_with_the_new_one(base, tok, saved, tmp_path):
    path, _ = saved
    b = build(base, tok, ppo_cfg(learning_rate=1e-3), work=tmp_path / "b2")
    with pytest.raises(RlhfError, match=r"^ppo.resume: ppo.learning_rate was 0.01 when checkpoint .* is 0.001 now"):
        b.resume(path)
    b.resume(path, force=True)
    g = b.optimizer.param_groups[0]
    assert g["initial_lr"] == 1e-3 and b.scheduler.base_lrs[0] == 1e-3
    assert g["lr"] == pytest.approx(1e-3 * b.scheduler.lr_lambdas[0](b.scheduler.last_epoch))
    assert b.scheduler.get_last_lr()[0] == g["lr"]


def test_a_changed_lora_rank_is_named_even_with_force(base, tok, saved, tmp_path):
    path, _ = saved
    b = build(base, tok, ppo_cfg(learning_rate=1e-2, **{"lora.r": 8}), work=tmp_path / "b2")
    for force in (False, True):
        with pytest.raises(RlhfError) as e:
            b.resume(path, force=force)
        assert one_line(e) == (f"ppo.resume: ppo.lora.r was 4 when checkpoint {path} was written and is 8 now; its "
                               "weights have the saved shape, so it cannot continue with another: set ppo.lora.r=4 "
                               "to resume, or drop ppo.resume to start a new run")


def test_the_run_config_names_the_keys_that_shape_the_run(saved):
    path, b = saved
    saved_cfg = json.loads((path / checkpoint.STATE_JSON).read_text())["config"]
    assert saved_cfg == json.loads(json.dumps(b.run_config()))
    for key in ("ppo.total_episodes", "ppo.per_device_train_batch_size", "ppo.gradient_accumulation_steps",
                "ppo.num_mini_batches", "ppo.num_ppo_epochs", "ppo.response_length", "ppo.lora.r",
                "ppo.lora.alpha", "ppo.lora.target_modules", "ppo.advantage", "ppo.samples_per_prompt",
                "ppo.learning_rate", "ppo.lr_scheduler_type", "ppo.value_lora", "ppo.policy_dir", "ppo.reward_dir",
                "model.dtype"):
        assert key in saved_cfg, key
    assert (saved_cfg["ppo.total_episodes"], saved_cfg["ppo.lora.r"], saved_cfg["model.dtype"]) == (16, 4, "float32")


def test_the_schema_takes_resume_true_false_and_force():
    from rlhf_cli.config import compose

    assert compose("ppo", ["recipe=tiny", "ppo.resume=force"]).ppo.resume == "force"
    assert compose("ppo", ["recipe=tiny", "ppo.resume=true"]).ppo.resume is True
    with pytest.raises(RlhfError, match=r"ppo.resume=.*maybe.* is unknown; use one of true, false, force"):
        compose("ppo", ["recipe=tiny", "ppo.resume=maybe"])


# ---------------------------------------------------------------------------------------- runs that can move
def test_a_copied_run_loads_and_resumes_after_the_original_is_deleted(base, tok, tmp_path, monkeypatch):
    """A run directory (sft, the PPO output and its checkpoint) copied elsewhere, the original deleted: the
    adapter's base is recorded relative to it (adapter_base.json, beside peft's absolute path, which plain peft
    follows from any directory while the run is in place), so load_policy and a resume from the copy find it, and
    plain peft does with the base loaded first."""
    from peft import AutoPeftModelForCausalLM

    from rlhf_cli.models import load_policy

    run = tmp_path / "runs" / "tiny"
    shutil.copytree(base, run / "sft")
    p = ppo_cfg(learning_rate=1e-2)
    a = build(run / "sft", tok, p, work=run / ".ppo.partial")
    a.update(a.compute_advantages(a.make_experience()))
    a.progress.update, a.progress.episodes = 1, 8
    a.save()
    checkpoint.save_model(a.unwrapped, run / ".ppo.partial")
    (run / ".ppo.partial").rename(run / "ppo")
    ckpt = run / "ppo" / "checkpoints" / "checkpoint-1"
    assert json.loads((run / "ppo" / "adapter_base.json").read_text())["relative"] == "../sft"
    assert json.loads((ckpt / "adapter_base.json").read_text())["relative"] == "../../../sft"
    with torch.no_grad():  # in place, plain peft loads it from anywhere
        torch.testing.assert_close(
            AutoPeftModelForCausalLM.from_pretrained(str(run / "ppo"))(torch.tensor([[5]])).logits,
            a.unwrapped(torch.tensor([[5]])).logits)

    moved = tmp_path / "elsewhere" / "tiny"
    shutil.copytree(run, moved)
    shutil.rmtree(tmp_path / "runs")
    ids = torch.tensor([[5, 6, 7, 8]])
    model = load_policy(moved / "ppo", torch.float32, merge=True)
    with torch.no_grad():
        expected = a.unwrapped(ids).logits
        torch.testing.assert_close(model(ids).logits, expected)
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        moved_base = AutoModelForCausalLM.from_pretrained(str(moved / "sft"))
        torch.testing.assert_close(PeftModel.from_pretrained(moved_base, str(moved / "ppo"))(ids).logits, expected)
    b = build(moved / "sft", tok, p, work=moved / ".ppo.partial", seed=5)
    b.resume(moved / "ppo" / "checkpoints" / "checkpoint-1")  # the policy and reward dirs compare as relative
    assert all(torch.equal(qa, qb) for qa, qb in zip(a.pol_params, b.pol_params))


def test_a_base_outside_the_run_stays_absolute(base, tok, tmp_path):
    from rlhf_cli.models import load_policy

    a = build(base, tok, ppo_cfg(), work=tmp_path / "run" / ".ppo.partial")
    checkpoint.save_model(a.unwrapped, tmp_path / "run" / "ppo")
    recorded = json.loads((tmp_path / "run" / "ppo" / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert recorded == str(base.resolve())
    load_policy(tmp_path / "run" / "ppo", torch.float32)
