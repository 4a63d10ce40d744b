"""Config composition (recipes, overrides), free-text quoting, the schema every key is checked against, and
the PPO batch arithmetic."""

from __future__ import annotations

import copy
import functools
import logging
import math
from pathlib import Path

import pytest
from omegaconf import DictConfig, OmegaConf

from rlhf_cli import schema
from rlhf_cli.config import (
    COMMANDS,
    CONF_DIR,
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
    assert resolved["chat"]["model_dir"] is None  # the newest trained policy (rlhf_cli.stages.chat.newest_policy)
    # every recipe's PPO batch sizes are consistent
    ppo_sizes(cfg.ppo)


@pytest.mark.parametrize("recipe", recipe_names())
def test_no_config_of_rlhf_sets_hydra_mode(recipe):
    """rlhf_cli.cli reads hydra.mode from the command line only (Hydra would compose the config once more to find
    it there): no config group or shipped recipe may set it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        cfg = hydra_compose(config_name="config", overrides=translate_overrides("sft", [f"recipe={recipe}"]),
                            return_hydra_config=True)
    assert cfg.hydra.mode is None


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
    cfg = compose("sft", ["recipe=qwen3-0.6b", "sft.learning_rate=0.5", "device=cpu"])
    assert cfg.sft.learning_rate == 0.5
    assert cfg.device.accelerator == "cpu"
    assert cfg.model.name_or_path == "Qwen/Qwen3-0.6B"
    with pytest.raises(RlhfError, match="new is not a config key"):  # a new top-level key is a typo's twin
        compose("sft", ["recipe=qwen3-0.6b", "+new=1"])


def test_device_group_override():
    cfg = compose("sft", ["device=cuda"])
    assert cfg.device.accelerator == "cuda"
    assert cfg.device.threads == 0
    assert compose("sft").device.threads == 1


def test_unknown_key_raises_an_error_naming_it():
    with pytest.raises(RlhfError, match="nosuch.key is not a config key"):
        compose("sft", ["nosuch.key=1"])  # not one of the project's groups: refused before Hydra, in one line
    with pytest.raises(RlhfError, match="sft.not_a_key is not a config key"):
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
    assert translate_overrides("chat", ["prompt='hi there'"])[-1] == "chat.prompt='hi there'"  # quoted: kept as is


# ------------------------------------------------------------------------------------------------- schema
DEVICES = sorted(p.stem for p in (CONF_DIR / "device").glob("*.yaml"))
MODELS = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))
DATA = sorted(p.stem for p in (CONF_DIR / "data").glob("*.yaml"))
# keys another change adds to conf/ at the same time; the schema knows them before the yaml does
PENDING = {"device.collective_timeout_s"}


def leaf_keys(node, prefix: str = ""):
    """Dotted paths of the leaves below `node` (lists and free-form mappings are leaves)."""
    for key, value in node.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and path not in schema.SCHEMA:
            yield from leaf_keys(value, path + ".")
        else:
            yield path


def group_leaves(cfg: DictConfig) -> set[str]:
    raw = OmegaConf.to_container(cfg, resolve=False)
    return {k for k in leaf_keys(raw) if k.split(".", 1)[0] in schema.GROUPS or "." not in k}


def composed_configs():
    """(name, config) of every recipe and command and of every group option: composed once per test process
    (Hydra composition is most of three tests' time), each caller getting its own copies."""
    for name, cfg in _composed_once():
        yield name, copy.deepcopy(cfg)


@functools.cache
def _composed_once() -> tuple[tuple[str, DictConfig], ...]:
    out = []
    for recipe in recipe_names():
        for command in COMMANDS:
            out.append((f"{command} recipe={recipe}", compose(command, [f"recipe={recipe}"], validate=False)))
    for group, options in (("device", DEVICES), ("model", MODELS), ("data", DATA)):
        for option in options:
            out.append((f"{group}={option}", compose("sft", [f"{group}={option}"], validate=False)))
    return tuple(out)


def test_schema_knows_every_key_of_every_composed_config():
    unknown = {}
    for name, cfg in composed_configs():
        for key in group_leaves(cfg) - set(schema.SCHEMA):
            unknown.setdefault(key, name)
    assert not unknown, f"keys in conf/ or recipes/ that rlhf_cli/keys.py does not know: {unknown}"


def test_every_schema_key_is_in_the_config():
    keys = set()
    for _, cfg in composed_configs():
        keys |= group_leaves(cfg)
    stale = set(schema.SCHEMA) - keys - PENDING
    assert not stale, f"schema keys that no config has (renamed or removed in conf/?): {sorted(stale)}"


@pytest.mark.parametrize("path", sorted([*CONF_DIR.rglob("*.yaml"), *RECIPES_DIR.glob("*.yaml")]),
                         ids=lambda p: str(p.relative_to(p.parents[1])))
def test_every_yaml_key_is_in_the_schema(path):
    """The files themselves, before composition: a key a recipe sets under a group is a key of that group."""
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    raw.pop("defaults", None)
    raw.pop("hydra", None)
    rel = path.relative_to(CONF_DIR).parts if CONF_DIR in path.parents else ("recipes",)
    prefix = {"stage": path.stem + ".", "recipes": ""}.get(rel[0], "" if len(rel) == 1 else rel[0] + ".")
    for key in leaf_keys(raw, prefix):
        assert key in schema.SCHEMA, f"{path}: {key} is not in rlhf_cli/keys.py"
        value = raw
        for part in key[len(prefix):].split(".") if prefix else key.split("."):
            value = value[part]
        if not (isinstance(value, str) and ("${" in value or value == "???")):  # checked once composed
            assert schema.check_value(key, value, schema.SCHEMA[key]) is None, (path, key, value)


def test_default_configs_validate():
    for _, cfg in composed_configs():
        schema.validate(cfg)


def test_pending_keys_are_checked_when_present():
    cfg = compose("sft")
    for key in PENDING:
        if OmegaConf.select(cfg, key) is None:
            continue
        with pytest.raises(RlhfError, match=rf"^{key}=0 is out of range"):
            compose("sft", [f"{key}=0"])


@pytest.mark.parametrize("key,value,needle", [
    ("ppo.total_episodes", "abc", "ppo.total_episodes=abc is not an integer; use a whole number ≥ 1"),
    ("ppo.total_episodes", 64.0, "ppo.total_episodes=64.0 is not an integer"),
    ("ppo.total_episodes", True, "ppo.total_episodes=true is not an integer"),
    ("sft.per_device_train_batch_size", 0, "sft.per_device_train_batch_size=0 is out of range; use a whole"),
    ("reward.gradient_accumulation_steps", -2, "reward.gradient_accumulation_steps=-2 is out of range"),
    ("sft.learning_rate", math.nan, "sft.learning_rate=nan is not a finite number; use a number > 0"),
    ("ppo.learning_rate", 0, "ppo.learning_rate=0 is out of range; use a number > 0"),
    ("ppo.learning_rate", math.inf, "ppo.learning_rate=inf is not a finite number"),
    ("ppo.learning_rate", "fast", "ppo.learning_rate=fast is not a number"),
    ("ppo.learning_rate", None, "ppo.learning_rate=null is not allowed; use a number > 0"),
    ("ppo.value_learning_rate", -1e-5, "ppo.value_learning_rate=-1e-05 is out of range; use a number > 0"),
    ("ppo.top_p", 0.0, "ppo.top_p=0.0 is out of range; use a number in (0, 1]"),
    ("ppo.gamma", 1.5, "ppo.gamma=1.5 is out of range; use a number in [0, 1]"),
    ("sft.warmup_ratio", 1, "sft.warmup_ratio=1 is out of range; use a number in [0, 1)"),
    ("sft.max_steps", 0, "sft.max_steps=0 is out of range; use -1 or a whole number ≥ 1"),
    ("device.num_processes", "two", "device.num_processes=two is not an integer; use auto or a whole number"),
    ("device.main_process_port", 70000, "device.main_process_port=70000 is out of range; use a whole"),
    ("ppo.kl_estimator", "k2", "ppo.kl_estimator=k2 is unknown; use one of k1, k3, abs, mse"),
    ("ppo.stop_token", "eot", "ppo.stop_token=eot is unknown; use eos or null"),
    ("ppo.recompute_logprobs", "yes", "ppo.recompute_logprobs=yes is unknown; use one of auto, true, false"),
    ("ppo.recompute_logprobs", 1, "ppo.recompute_logprobs=1 is unknown"),
    ("device.mixed_precision", "fp8", "device.mixed_precision=fp8 is unknown; use one of auto, no, bf16"),
    ("device.strategy", "mpi", "device.strategy=mpi is unknown; use one of single, ddp, deepspeed, fsdp"),
    ("model.hub", "github", "model.hub=github is unknown; use modelscope or hf"),
    ("model.dtype", "float64", "model.dtype=float64 is unknown; use one of auto, float32, bfloat16"),
    ("sft.lr_scheduler_type", "cosinus", "sft.lr_scheduler_type=cosinus is unknown; use one of linear"),
    ("ppo.lr_scheduler_type", "cosine_with_min_lr", "ppo.lr_scheduler_type=cosine_with_min_lr needs"),
    ("ppo.adaptive_kl", "yes", "ppo.adaptive_kl=yes is not true or false"),
    ("sft.output_dir", "", "sft.output_dir is empty"),
    ("model.name_or_path", 7, "model.name_or_path=7 is not text; quote it (model.name_or_path='7')"),
    ("ppo.stop_token_ids", [1, -2], "ppo.stop_token_ids=[1, -2] is not a list of token ids"),
    ("ppo.lora.target_modules", [], "ppo.lora.target_modules=[] is not a module name or a list of them"),
    ("doctor.stages", ["sft", "rlhf"], "doctor.stages: rlhf is unknown; use a list of sft, reward, ppo"),
    ("eval.policies", {}, "eval.policies={} is not a mapping of names to directories"),
    ("eval.policies", {"ppo": None}, "eval.policies={ppo: null} leaves nothing"),  # null leaves one out
    ("eval.policies", {"sft": "s", "ppo": 3}, "eval.policies.ppo=3 is not a directory"),
])
def test_bad_values_name_the_key_the_value_and_the_range(key, value, needle):
    message = schema.check_value(key, value, schema.SCHEMA[key])
    assert message is not None and message.startswith(needle), message
    assert "\n" not in message


@pytest.mark.parametrize("key,value", [
    ("ppo.total_episodes", 64), ("sft.max_steps", -1), ("device.num_processes", "auto"), ("ppo.top_p", 1.0),
    ("ppo.top_k", 0), ("ppo.stop_token", None), ("ppo.recompute_logprobs", False), ("ppo.target_kl", None),
    ("ppo.lora.target_modules", "all-linear"), ("ppo.lora.target_modules", ["q_proj", "lm_head"]),
    ("ppo.stop_token_ids", []), ("eval.policies", {"sft": "runs/tiny/sft"}),
    ("eval.policies", {"sft": "runs/tiny/sft", "ppo": None}), ("chat.prompt", ""),
    ("ppo.missing_eos_penalty", -1.5), ("device.zero_stage", 3), ("sft.learning_rate", 1),
])
def test_good_values_pass(key, value):
    assert schema.check_value(key, value, schema.SCHEMA[key]) is None


def test_schedulers_are_transformers_scheduler_types():
    names = set(schema.scheduler_types())
    assert set(schema.SCHEDULERS) <= names and set(schema.SCHEDULERS_NOT_RUN) <= names
    # a schedule a newer transformers adds gets a decision: runnable here, or not
    assert names == set(schema.SCHEDULERS) | set(schema.SCHEDULERS_NOT_RUN)


def test_doctor_stages_are_the_memory_planners():
    from rlhf_cli.memory import PLANNERS

    assert schema.SCHEMA["doctor.stages"].choices == tuple(PLANNERS)


def test_compose_validates_and_names_the_first_bad_key_and_the_others():
    with pytest.raises(RlhfError, match=r"^ppo\.total_episodes=abc is not an integer"):
        compose("ppo", ["ppo.total_episodes=abc"])
    with pytest.raises(RlhfError, match=r"^sft\.learning_rate=nan .*\(also check sft\.max_grad_norm\)$"):
        compose("sft", ["sft.learning_rate=nan", "sft.max_grad_norm=-1"])
    cfg = compose("ppo", ["ppo.total_episodes=abc"], validate=False)
    assert cfg.ppo.total_episodes == "abc"


def test_interpolated_keys_are_checked_resolved():
    # eval.temperature is ${ppo.temperature}: one bad value, both keys named
    with pytest.raises(RlhfError, match=r"^ppo\.temperature=0 is out of range.*also check eval\.temperature"):
        compose("eval", ["ppo.temperature=0"])
    with pytest.raises(RlhfError, match=r"sft\.output_dir cannot be resolved"):
        compose("sft", ["sft.output_dir=${nosuch.key}"])


@pytest.mark.parametrize("override,needle", [
    ("+sft.max_step=2", "sft.max_step is not a config key; did you mean sft.max_steps?"),
    ("sft.max_step=2", "sft.max_step is not a config key; did you mean sft.max_steps?"),
    ("++ppo.lora_r=4", "ppo.lora_r is not a config key; did you mean ppo.lora.r?"),
    ("+ppo.target_kl_value=6", "ppo.target_kl_value is now ppo.adaptive_kl_target"),
    ("+ppo.lora.dropout=0.1", "ppo.lora.dropout is not a config key any more"),
    ("+export.dir=x", "export.dir is not a config key; export has output_dir"),
    ("+ppo.lr=1", "ppo.lr is not a config key; `rlhf ppo --cfg job` prints the keys"),
])
def test_unknown_keys_are_refused_with_a_suggestion(override, needle):
    with pytest.raises(RlhfError) as e:
        compose("ppo", [override])
    assert str(e.value).startswith(needle), str(e.value)


def test_unknown_keys_from_a_recipe_are_refused_after_composition():
    cfg = compose("ppo", validate=False)
    OmegaConf.set_struct(cfg, False)
    cfg.ppo.target_kl_value = 6.0  # what an old recipe file would add
    with pytest.raises(RlhfError, match="ppo.target_kl_value is now ppo.adaptive_kl_target"):
        schema.validate(cfg)


@pytest.mark.parametrize("overrides", [
    ["device=cuda", "model=qwen3-0.6b", "data=file"],                    # group choices
    ["+eval.policies.ppo2=runs/other/ppo"],                                # free-form mapping
    ["seed=1", "hydra.job.chdir=false"],                                   # top-level and Hydra's own keys
    ["ppo.lora.target_modules=[q_proj,v_proj]", "sft.learning_rate=1e-3,3e-4"],  # lists, sweeps
])
def test_override_keys_that_pass(overrides):
    schema.check_override_keys(overrides, "ppo")


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


def test_ppo_sizes_says_what_it_does_with_the_remainder(caplog):
    with caplog.at_level(logging.WARNING, logger="rlhf"):
        s = ppo_sizes(ppo_cfg(num_mini_batches=2, total_episodes=100))
    assert (s.batch_size, s.num_updates) == (64, 1)
    want = "ppo.total_episodes=100 is not a multiple of the 64-episode batch; training 64 episodes (1 update)"
    assert want in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rlhf"):
        ppo_sizes(ppo_cfg(total_episodes=128))
    assert not caplog.text


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


# ------------------------------------------------------------------------------- config and recipe folders
def test_config_root_prefers_the_copy_inside_an_installed_package(tmp_path):
    from rlhf_cli.config import config_root

    package = tmp_path / "site" / "rlhf_cli"
    package.mkdir(parents=True)
    assert config_root(package) == tmp_path / "site"  # a checkout: conf/ and recipes/ beside the package
    (package / "_config" / "conf").mkdir(parents=True)
    (package / "_config" / "conf" / "config.yaml").write_text("command: ???\n")
    assert config_root(package) == package / "_config"  # a wheel


def test_shipped_configs_are_found_from_this_checkout():
    assert (CONF_DIR / "config.yaml").is_file()
    assert {"tiny", "qwen3-0.6b"} <= {p.stem for p in RECIPES_DIR.glob("*.yaml")}


def _edit(path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))


def test_user_recipes_come_first_and_say_what_they_replace(tmp_path, monkeypatch):
    from rlhf_cli.config import copy_recipe, find_recipes

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RLHF_RECIPES", raising=False)
    assert copy_recipe("tiny", "my-tiny") == Path("recipes/my-tiny.yaml")
    assert copy_recipe("tiny") == Path("recipes/tiny.yaml")
    found = find_recipes()
    assert list(found) == sorted(found) and {"my-tiny", "tiny", "qwen3-0.6b"} <= set(found)
    assert not found["my-tiny"].shipped and found["my-tiny"].hides is None
    assert not found["tiny"].shipped and found["tiny"].hides == RECIPES_DIR / "tiny.yaml"
    assert found["qwen3-0.6b"].shipped
    # a copy composes under its own name and run directory; the user's tiny replaces the shipped default
    _edit(tmp_path / "recipes" / "tiny.yaml", "kl_coef: 0.06", "kl_coef: 0.5")
    cfg = compose("ppo", ["recipe=my-tiny"])
    assert (cfg.recipe, cfg.run_dir, cfg.ppo.kl_coef) == ("my-tiny", "runs/my-tiny", 0.06)
    assert cfg.model.name_or_path == "tiny"  # the recipe's defaults list (override /model) still applies
    assert compose("ppo").ppo.kl_coef == 0.5
    assert compose("ppo", ["recipe=tiny"]).ppo.kl_coef == 0.5
    out = translate_overrides("sft", ["recipe=qwen3-0.6b,my-tiny"])  # a multirun over recipes
    assert "recipes=qwen3-0.6b,user/my-tiny" in out


def test_recipe_folders_from_the_environment(tmp_path, monkeypatch):
    from rlhf_cli.config import copy_recipe, find_recipes, recipe_dirs

    monkeypatch.chdir(tmp_path)
    shared = tmp_path / "team recipes"
    monkeypatch.setenv("RLHF_RECIPES", str(shared))
    copy_recipe("qwen3-0.6b", str(shared / "big.yaml"))
    copy_recipe("tiny", "big")  # ./recipes comes before $RLHF_RECIPES
    assert recipe_dirs() == [tmp_path / "recipes", shared, RECIPES_DIR]
    found = find_recipes()
    assert found["big"].path == Path("recipes/big.yaml").absolute()
    assert found["big"].hides == shared / "big.yaml"
    (tmp_path / "recipes" / "big.yaml").unlink()
    cfg = compose("sft", ["recipe=big"])
    assert (cfg.recipe, cfg.model.name_or_path) == ("big", "Qwen/Qwen3-0.6B")
    with pytest.raises(RlhfError, match=r"unknown recipe 'nope'.*big.*searched .*team recipes"):
        compose("sft", ["recipe=nope"])


def test_recipe_copy_is_a_commented_file_named_after_the_copy(tmp_path, monkeypatch):
    from rlhf_cli.config import copy_recipe, recipe_summary

    monkeypatch.chdir(tmp_path)
    path = copy_recipe("tiny", "my-tiny")
    text = path.read_text()
    assert text.startswith("# @package _global_\n"
                           "# my-tiny: a copy of recipe tiny (shipped with rlhf), to edit\n")
    assert "rlhf sft recipe=my-tiny" in text and "# Notes of tiny:" in text
    assert "\nrecipe: my-tiny\n" in text and "\nrecipe: tiny" not in text
    assert "# Batch arithmetic" in text  # the source's own notes are kept
    assert recipe_summary(path) == "my-tiny: a copy of recipe tiny (shipped with rlhf), to edit"
    assert recipe_summary(RECIPES_DIR / "tiny.yaml").startswith("tiny: the whole chain")


@pytest.mark.parametrize("args,needle", [
    (("tiny", "my-tiny"), "recipes/my-tiny.yaml exists; choose another name"),
    (("tiny", "bad name"), "'bad name' cannot be a recipe name"),
    (("nope",), "unknown recipe 'nope'"),
])
def test_recipe_copy_refusals(tmp_path, monkeypatch, args, needle):
    from rlhf_cli.config import copy_recipe

    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "my-tiny.yaml").write_text("# mine\n")
    with pytest.raises(RlhfError) as e:
        copy_recipe(*args)
    assert needle in str(e.value)
    assert (tmp_path / "recipes" / "my-tiny.yaml").read_text() == "# mine\n"


def test_broken_user_recipe_is_a_one_line_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "broken.yaml").write_text("recipe: broken\nppo: [unclosed\n")
    with pytest.raises(RlhfError, match=r"^recipe .*broken.yaml is not valid YAML \(.*\); fix the file$"):
        compose("sft", ["recipe=broken"])
    compose("sft")  # other recipes are not affected


def test_user_recipe_without_package_header_is_global(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "plain.yaml").write_text("recipe: plain\nsft:\n  learning_rate: 0.25\n")
    cfg = compose("sft", ["recipe=plain"])
    assert (cfg.recipe, cfg.sft.learning_rate, cfg.model.name_or_path) == ("plain", 0.25, "tiny")


@pytest.mark.parametrize("num,overrides,name", [
    (0, "sft.learning_rate=0.001", "0_sft.learning_rate=0.001"),
    (3, "data.train_path=/data/a b.jsonl,seed=1", "3_data.train_path=_data_a_b.jsonl,seed=1"),
    (1, "", "1"),
    (12, "x=" + "9" * 200, "12_x=" + "9" * 94),
])
def test_multirun_job_directory_names(num, overrides, name):
    from rlhf_cli.config import job_dir_name

    assert job_dir_name(num, overrides) == name


def test_logging_keys_default_and_checks():
    cfg = compose("sft")
    assert list(cfg.logging.report_to) == ["tensorboard"]
    assert cfg.logging.wandb.mode is None and cfg.logging.wandb.group == "tiny"
    both = compose("sft", ["logging.report_to=[tensorboard,wandb]"]).logging.report_to
    assert list(both) == ["tensorboard", "wandb"]
    with pytest.raises(RlhfError, match=r"^logging\.report_to: mlflow is unknown; use a list of tensorboard"):
        compose("sft", ["logging.report_to=[tensorboard,mlflow]"])
    with pytest.raises(RlhfError, match=r"^logging\.wandb\.mode=sometimes is unknown"):
        compose("sft", ["logging.wandb.mode=sometimes"])
    with pytest.raises(RlhfError, match="logging.wandb.projekt is not a config key; did you mean"):
        compose("sft", ["+logging.wandb.projekt=x"])


def test_own_train_file_is_evaluated_on_its_own_split_without_the_demo_checker(tmp_path):
    """`data.train_path=mine.jsonl` on the default (demo) data config: the demo's held-out file and ground truth
    go with the demo's training file, so the user's rows are evaluated on their own split, with no checker."""
    from rlhf_cli.config import compose

    demo = compose("reward", [])
    assert demo.data.eval_path.endswith("polite_test.jsonl") and demo.data.ground_truth == "demo_polite"
    mine = compose("reward", [f"data.train_path={tmp_path / 'mine.jsonl'}"])
    assert mine.data.eval_path is None and mine.data.ground_truth is None
    both = compose("ppo", [f"data.train_path={tmp_path / 'mine.jsonl'}", "data.ground_truth=demo_polite",
                           f"data.eval_path={tmp_path / 'held.jsonl'}"])
    assert both.data.eval_path == str(tmp_path / "held.jsonl") and both.data.ground_truth == "demo_polite"
