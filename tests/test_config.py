"""Config composition (recipes, overrides), free-text quoting, and the PPO batch arithmetic."""

from __future__ import annotations

import pytest
from hydra.errors import HydraException
from omegaconf import OmegaConf

from rlhf_cli.config import (
    COMMANDS,
    PACKAGE_DIR,
    RECIPES_DIR,
    compose,
    ppo_sizes,
    recipe_names,
    require_dir,
    translate_overrides,
)
from rlhf_cli.errors import RlhfError


# ------------------------------------------------------------------------------------------------ recipes
def test_recipe_files_are_listed():
    names = recipe_names()
    assert {"tiny", "qwen3-0.6b"} <= set(names)
    assert names == sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


@pytest.mark.parametrize("recipe", recipe_names())
@pytest.mark.parametrize("command", COMMANDS)
def test_every_recipe_composes_and_resolves_for_every_command(recipe, command):
    cfg = compose(command, [f"recipe={recipe}"])
    assert cfg.command == command
    assert cfg.recipe == recipe
    resolved = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    assert resolved["run_dir"] == f"runs/{recipe}"
    for stage in ("sft", "reward", "ppo", "eval"):
        assert resolved[stage]["output_dir"] == f"runs/{recipe}/{stage}"
    # stages are chained through the run directory
    assert resolved["reward"]["init_from"] == resolved["sft"]["output_dir"]
    assert resolved["ppo"]["policy_dir"] == resolved["sft"]["output_dir"]
    assert resolved["ppo"]["reward_dir"] == resolved["reward"]["output_dir"]
    assert resolved["chat"]["model_dir"] == resolved["sft"]["output_dir"]
    # every recipe's PPO batch sizes are consistent
    ppo_sizes(cfg.ppo)


def test_default_recipe_is_tiny_on_cpu_with_demo_data():
    cfg = compose("sft")
    assert cfg.recipe == "tiny"
    assert cfg.model.name_or_path == "tiny"
    assert cfg.device.accelerator == "cpu"
    assert cfg.model.tiny.dir == "runs/tiny/base"
    assert cfg.data.train_path == str(PACKAGE_DIR / "demo/data/polite_train.jsonl")
    assert cfg.data.eval_path == str(PACKAGE_DIR / "demo/data/polite_test.jsonl")
    assert cfg.data.sft_on_rejected is True  # set by recipes/tiny.yaml
    assert cfg.ppo.total_episodes == 4096


def test_qwen_recipe_switches_model_device_and_data():
    cfg = compose("sft", ["recipe=qwen3-0.6b"])
    assert cfg.recipe == "qwen3-0.6b"
    assert cfg.model.name_or_path == "Qwen/Qwen3-0.6B"
    assert cfg.model.hub == "modelscope"
    assert cfg.device.name == "cuda" and cfg.device.accelerator == "cuda"
    assert cfg.data.train_path is None and cfg.data.eval_path is None  # data=file: the user's file
    assert cfg.data.max_prompt_length == 256
    assert cfg.sft.learning_rate == pytest.approx(2e-5)
    assert cfg.ppo.total_episodes == 1000
    assert cfg.run_dir == "runs/qwen3-0.6b"


def test_overrides_apply_after_the_recipe():
    cfg = compose("sft", ["recipe=qwen3-0.6b", "sft.learning_rate=0.5", "device=cpu", "+new=1"])
    assert cfg.sft.learning_rate == 0.5
    assert cfg.device.accelerator == "cpu"
    assert cfg.new == 1
    assert cfg.model.name_or_path == "Qwen/Qwen3-0.6B"


def test_device_group_override():
    cfg = compose("sft", ["device=cuda"])
    assert cfg.device.accelerator == "cuda"
    assert cfg.device.threads == 0
    assert compose("sft").device.threads == 1


def test_unknown_key_raises_hydra_error_naming_it():
    with pytest.raises(HydraException, match="nosuch"):
        compose("sft", ["nosuch.key=1"])
    with pytest.raises(HydraException, match="not_a_key"):
        compose("sft", ["sft.not_a_key=3"])


def test_unknown_recipe_raises_rlhf_error():
    with pytest.raises(RlhfError, match="unknown recipe 'nope'.*tiny"):
        compose("sft", ["recipe=nope"])


def test_translate_overrides_maps_recipe_to_group_and_sets_command():
    out = translate_overrides("ppo", ["recipe=tiny", "ppo.kl_coef=0.1"])
    assert out[0].startswith("hydra.searchpath=")
    assert out[1:] == ["command=ppo", "recipes=tiny", "ppo.kl_coef=0.1"]


# -------------------------------------------------------------------------------------------- free text
@pytest.mark.parametrize("text", [
    "你好, world",
    "it's \"quoted\", isn't it?",
    "x=y: [1, 2] {a} (b)",
    "C:\\new\\table",
    "ends with a backslash\\",
    "a\\'b",
    "",
])
def test_chat_prompt_free_text_round_trips(text):
    cfg = compose("chat", [f"prompt={text}"])
    assert cfg.chat.prompt == text


def test_system_prompt_free_text_round_trips():
    text = "You are polite, always. 请礼貌 'really'"
    assert compose("sft", [f"data.system_prompt={text}"]).data.system_prompt == text
    assert compose("chat", [f"system_prompt={text}"]).chat.system_prompt == text
    # chat's system prompt follows data.system_prompt by default
    assert compose("chat", [f"data.system_prompt={text}"]).chat.system_prompt == text


def test_non_ascii_value_for_any_key_is_quoted():
    cfg = compose("sft", ["model.name_or_path=/模型/目录"])
    assert cfg.model.name_or_path == "/模型/目录"


def test_already_quoted_value_is_passed_through():
    assert translate_overrides("chat", ["prompt='hi there'"])[-1] == "prompt='hi there'"


# ------------------------------------------------------------------------------------------- PPO sizes
def ppo_cfg(**kw):
    base = dict(per_device_train_batch_size=8, gradient_accumulation_steps=4, num_mini_batches=1,
                rollout_forward_batch_size=32, num_ppo_epochs=2, total_episodes=1536, response_length=32)
    return OmegaConf.create({**base, **kw})


def test_ppo_sizes_tiny_recipe():
    s = ppo_sizes(compose("ppo").ppo)
    # 8 micro x 4 accumulation = 32 per step, 2 mini-batches -> 64 per update; 4096 / 64 = 64 updates
    assert (s.local_mini_batch_size, s.local_batch_size, s.batch_size, s.mini_batch_size) == (32, 64, 64, 32)
    assert s.rollout_forward_batch_size == 32
    assert s.num_updates == 64


def test_ppo_sizes_qwen_recipe_drops_the_remainder():
    s = ppo_sizes(compose("ppo", ["recipe=qwen3-0.6b"]).ppo)
    assert s.batch_size == 32
    assert s.num_updates == 31  # 1000 // 32


def test_ppo_sizes_several_processes_and_mini_batches():
    s = ppo_sizes(ppo_cfg(per_device_train_batch_size=4, gradient_accumulation_steps=2, num_mini_batches=3,
                          rollout_forward_batch_size=6, total_episodes=100), world_size=2)
    # local mini 4*2=8, local batch 8*3=24, global batch 48, global mini 16; 100 // 48 = 2
    assert s.world_size == 2
    assert s.micro_batch_size == 4
    assert s.gradient_accumulation_steps == 2
    assert s.num_mini_batches == 3
    assert s.local_mini_batch_size == 8
    assert s.local_batch_size == 24
    assert s.mini_batch_size == 16
    assert s.batch_size == 48
    assert s.rollout_forward_batch_size == 6
    assert s.num_updates == 2


def test_ppo_sizes_forward_batch_larger_than_rollout_is_capped():
    s = ppo_sizes(ppo_cfg(per_device_train_batch_size=2, gradient_accumulation_steps=2,
                          rollout_forward_batch_size=64, total_episodes=8))
    assert s.local_batch_size == 4
    assert s.rollout_forward_batch_size == 4
    assert s.num_updates == 2


def test_ppo_sizes_non_dividing_forward_batch():
    with pytest.raises(RlhfError, match=r"ppo\.rollout_forward_batch_size=12 does not divide.*32") as e:
        ppo_sizes(ppo_cfg(rollout_forward_batch_size=12))
    assert "4" in str(e.value).rsplit("such as", 1)[1]  # gcd(12, 32)


def test_ppo_sizes_too_few_episodes():
    with pytest.raises(RlhfError, match=r"ppo\.total_episodes=31 is smaller than one update of 32"):
        ppo_sizes(ppo_cfg(total_episodes=31))
    with pytest.raises(RlhfError, match=r"ppo\.total_episodes=63 is smaller than one update of 64"):
        ppo_sizes(ppo_cfg(total_episodes=63), world_size=2)


def test_ppo_sizes_zero_response_length():
    with pytest.raises(RlhfError, match=r"ppo\.response_length must be >= 1 \(got 0\)"):
        ppo_sizes(ppo_cfg(response_length=0))


@pytest.mark.parametrize("key", ["per_device_train_batch_size", "gradient_accumulation_steps",
                                 "num_mini_batches", "rollout_forward_batch_size", "num_ppo_epochs",
                                 "total_episodes"])
def test_ppo_sizes_non_positive_counts(key):
    with pytest.raises(RlhfError, match=rf"ppo\.{key} must be >= 1"):
        ppo_sizes(ppo_cfg(**{key: 0}))


def test_ppo_sizes_from_overrides():
    cfg = compose("ppo", ["ppo.total_episodes=4096", "ppo.num_mini_batches=2",
                          "ppo.rollout_forward_batch_size=16"])
    s = ppo_sizes(cfg.ppo)
    assert (s.local_batch_size, s.mini_batch_size, s.num_updates) == (64, 32, 64)


# ---------------------------------------------------------------------------------------------- inputs
def test_require_dir_names_the_producing_command(tmp_path):
    with pytest.raises(RlhfError, match=r"run `rlhf sft` first"):
        require_dir(tmp_path / "missing", "SFT model", "rlhf sft")
    (tmp_path / "d").mkdir()
    with pytest.raises(RlhfError, match="rlhf sft"):
        require_dir(tmp_path / "d", "SFT model", "rlhf sft", marker="config.json")
    (tmp_path / "d" / "config.json").write_text("{}")
    assert require_dir(tmp_path / "d", "SFT model", "rlhf sft", marker="config.json") == tmp_path / "d"
