"""rlhf_cli.settings: a config group as a frozen, typed view whose fields are exactly the group's keys in keys.py,
each value cast by its key's kind."""

from __future__ import annotations

import dataclasses

import pytest

from rlhf_cli.config import compose
from rlhf_cli.keys import GROUPS, SCHEMA
from rlhf_cli.settings import Settings, view


def flat(settings: Settings, group: str) -> set[str]:
    """The keys a view holds, subgroups flattened (`sft.lora.r`)."""
    out = set()
    for f in dataclasses.fields(settings):
        value, key = getattr(settings, f.name), f"{group}.{f.name}"
        out |= flat(value, key) if isinstance(value, Settings) else {key}
    return out


@pytest.mark.parametrize("group", sorted(set(GROUPS)))
def test_fields_are_the_groups_keys(group):
    cfg = compose("sft")
    assert flat(view(group, cfg.get(group)), group) == {k for k in SCHEMA if k.startswith(group + ".")}


def test_values_are_cast_by_kind_and_frozen():
    cfg = compose("sft", ["sft.learning_rate=1", "sft.lora.target_modules=q_proj", "dpo.rpo_alpha=null",
                          "device.num_processes=auto", "logging.report_to=[tensorboard]"])
    s = view("sft", cfg.sft)
    assert s.learning_rate == 1.0 and type(s.learning_rate) is float  # an int on the command line, a float key
    assert type(s.max_steps) is int and type(s.lora.enabled) is bool and s.lora.target_modules == "q_proj"
    assert s.get("lora").r == cfg.sft.lora.r and s.get("no_such_key", 3) == 3
    assert view("dpo", cfg.dpo).rpo_alpha is None
    assert view("device", cfg.device).num_processes == "auto"  # a named value beside the range stays
    assert view("logging", cfg.logging).report_to == ("tensorboard",)
    assert view("sft", compose("sft", ["sft.lora.target_modules=[q_proj,v_proj]"]).sft).lora.target_modules \
        == ("q_proj", "v_proj")
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.learning_rate = 2.0


def test_the_whole_config_reads_as_the_composed_one(tmp_path, monkeypatch):
    """`of(cfg)`: every group a view, the top-level keys typed; the trl stages' trainer arguments come out the
    same from it as from the DictConfig."""
    from rlhf_cli.settings import of
    from rlhf_cli.stages._common import trainer_kwargs

    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR", raising=False)
    cfg = compose("dpo", ["dpo.learning_rate=1", "seed=3"])
    run = of(cfg)
    assert run.dpo == view("dpo", cfg.dpo) and run.seed == 3 and run.command == "dpo"
    assert trainer_kwargs(run.dpo, run, tmp_path, {}, 10) == trainer_kwargs(cfg.dpo, cfg, tmp_path, {}, 10)


@pytest.mark.parametrize("resume", ["false", "true", "force"])
def test_the_ppo_side_reads_the_same_from_the_typed_config(resume):
    """The PPO stage's helpers (its PPOConfig, batch sizes, sampling settings) come out the same from the typed view
    as from the DictConfig; a view reads `[name]` as the DictConfig does, and ppo.resume is lower-case text."""
    from types import SimpleNamespace

    from rlhf_cli.config import ppo_sizes
    from rlhf_cli.ppo.config import PPOConfig
    from rlhf_cli.settings import of
    from rlhf_cli.stages import _sampling

    cfg = compose("ppo", [f"ppo.resume={resume}", "ppo.stop_token_ids=[5]", "ppo.reward_timeout_s=30"])
    run = of(cfg)
    assert run.ppo["total_episodes"] == cfg.ppo["total_episodes"] and run.ppo.resume == resume
    with pytest.raises(KeyError):
        run.ppo["no_such_key"]
    assert PPOConfig.from_cfg(run.ppo) == PPOConfig.from_cfg(cfg.ppo)
    assert ppo_sizes(run.ppo, 2) == ppo_sizes(cfg.ppo, 2)
    tok = SimpleNamespace(pad_token_id=0, eos_token_id=1)
    for evaluation in (False, True):
        assert _sampling.sampling(run, tok, 100, False, evaluation) == _sampling.sampling(cfg, tok, 100, False,
                                                                                           evaluation)
    assert _sampling.score_batch_size(run, 2, 151_669) == _sampling.score_batch_size(cfg, 2, 151_669)


def test_with_values_casts_each_value_and_leaves_the_view_unchanged():
    """settings.with_values: a copy with dotted keys set (below the view's group), each cast by its key's kind; the
    original view keeps its values; a key the view has no field for is a KeyError."""
    from rlhf_cli.settings import of, with_values

    run = of(compose("ppo", ["ppo.value_lora=false"]))
    changed = with_values(run, {"ppo.per_device_train_batch_size": "2", "ppo.value_lora": 1, "seed": 7.0,
                                "device.fsdp.gather_for_sampling": False, "ppo.lora.target_modules": ["q_proj"],
                                "ppo.resume": True})
    assert changed.ppo.per_device_train_batch_size == 2 and type(changed.ppo.per_device_train_batch_size) is int
    assert changed.ppo.value_lora is True and changed.seed == 7 and type(changed.seed) is int
    assert changed.device.fsdp.gather_for_sampling is False and changed.ppo.lora.target_modules == ("q_proj",)
    assert changed.ppo.resume == "true"  # an enum's true / false as lower-case text, as `of` casts it
    assert changed.ppo.learning_rate == run.ppo.learning_rate and changed.sft == run.sft  # the rest as it was
    assert run == of(compose("ppo", ["ppo.value_lora=false"]))  # the original view is unchanged
    assert run.ppo.value_lora is False and run.device.fsdp.gather_for_sampling is True
    assert with_values(run.sft, {"lora.r": "4"}).lora.r == 4  # keys below a group view's own group
    for bad in ("ppo.no_such_key", "no_such_group.x", "seed.x"):
        with pytest.raises(KeyError):
            with_values(run, {bad: 1})


# the functions that may take the composed config itself (a DictConfig, `cfg`): each stage's entry, which builds
# the typed settings once; the dispatcher and schema checks before them; settings.of; and what records the whole
# composed config (the run record a resume compares, the model cards, the wandb run's config)
TAKES_CFG = {
    "cli.py": {"_resume_hint", "run_stage", "app"},
    "settings.py": {"of"},
    "schema.py": {"validate", "check_inputs", "_problems"},
    "resume.py": {"run_config", "run_shape", "finished_as_configured", "ppo_record", "model_identities",
                  "resume_hint"},
    "cards.py": {"_input_dir", "stage_record", "write_card"},
    "tracking.py": {"_config_dict"},
    "stages/_ppo_outputs.py": {"write_cards"},
    **{f"stages/{stage}.py": {"run"} for stage in ("sft", "reward", "dpo", "ppo", "eval", "export", "chat", "push",
                                                 "doctor")},
}


def test_past_each_entry_code_reads_typed_settings_not_the_composed_config():
    """`grep -rn "def [a-z_]*(.*\\bcfg\\b" rlhf_cli` lists only the functions above: every other function takes the
    typed settings (rlhf_cli.settings.of, or one group of them), built once at the command's entry."""
    import re
    from pathlib import Path

    package = Path(__file__).resolve().parents[1] / "rlhf_cli"
    pattern = re.compile(r"def ([a-z_]*)\(.*\bcfg\b")
    found = {(path.relative_to(package).as_posix(), m.group(1))
             for path in sorted(package.rglob("*.py"))
             for line in path.read_text(encoding="utf-8").splitlines() if (m := pattern.search(line))}
    allowed = {(module, name) for module, names in TAKES_CFG.items() for name in names}
    assert sorted(found - allowed) == []  # the grep lists none but these
    assert sorted(allowed - found) == []  # and each of these still takes it (else drop it from the list)
