"""PPOConfig against the schema: its fields are the `ppo.*` keys that are hyper-parameters, with the types the
schema's entries give, built from the composed config by one function; and the lists of allowed values are the
ones in rlhf_cli.choices, used by the code that acts on them."""

from __future__ import annotations

import typing
from dataclasses import fields

import pytest

from rlhf_cli import choices, schema
from rlhf_cli.config import compose
from rlhf_cli.ppo.config import NOT_FIELDS, PPOConfig

PPO_KEYS = {k.removeprefix("ppo.") for k in schema.SCHEMA if k.startswith("ppo.")}
# schema kind -> the type a field of that kind holds (lists: tuples)
KIND_TYPES = {"int": int, "float": float, "bool": bool, "text": str, "enum": str, "scheduler": str,
              "int_list": tuple, "number_list": tuple, "sources": tuple}


def test_fields_are_the_schema_ppo_keys_less_the_non_hyper_parameters():
    assert NOT_FIELDS <= PPO_KEYS, sorted(NOT_FIELDS - PPO_KEYS)
    assert {f.name for f in fields(PPOConfig)} == PPO_KEYS - NOT_FIELDS


def test_field_types_follow_the_schema():
    hints = typing.get_type_hints(PPOConfig)
    for f in fields(PPOConfig):
        rule = schema.SCHEMA[f"ppo.{f.name}"]
        hint = hints[f.name]
        args = typing.get_args(hint)
        nullable = type(None) in args
        base = next((a for a in args if a is not type(None)), hint) if nullable else hint
        assert nullable == rule.nullable, (f.name, hint, rule)
        assert (typing.get_origin(base) or base) is KIND_TYPES[rule.kind], (f.name, hint, rule.kind)


@pytest.mark.parametrize("overrides", [
    [],
    ["recipe=tiny-grpo"],
    ["ppo.reward=[model,rlhf_cli.demo:polite_reward]", "ppo.reward_weights=[1,0.5]",
     "ppo.recompute_logprobs=true", "ppo.stop_token=null"],
])
def test_from_cfg_casts_every_value_to_its_field_type(overrides):
    c = PPOConfig.from_cfg(compose("ppo", overrides).ppo)
    hints = typing.get_type_hints(PPOConfig)
    for f in fields(PPOConfig):
        v = getattr(c, f.name)
        kind = KIND_TYPES[schema.SCHEMA[f"ppo.{f.name}"].kind]
        assert v is None or type(v) is kind, (f.name, v, hints[f.name])
    assert c.recompute_logprobs in ("auto", "true", "false")


def test_reward_weights_are_floats_and_a_single_source_is_a_tuple():
    c = PPOConfig.from_cfg(compose("ppo", ["ppo.reward=[model,rlhf_cli.demo:polite_reward]",
                                           "ppo.reward_weights=[1,0.5]"]).ppo)
    assert c.reward == ("model", "rlhf_cli.demo:polite_reward") and c.reward_weights == (1.0, 0.5)
    assert all(type(w) is float for w in c.reward_weights)
    p = dict(compose("ppo").ppo)
    p["reward"] = "model"
    assert PPOConfig.from_cfg(p).reward == ("model",)


def test_choice_lists_are_defined_once():
    """The schema checks against rlhf_cli.choices and the code that acts on a value uses the same tuple."""
    pytest.importorskip("torch")
    from rlhf_cli import data, launch
    from rlhf_cli.accel import cpu_linear
    from rlhf_cli.ppo import core

    assert data.FORMATS is choices.DATA_FORMATS
    assert launch.STRATEGIES is choices.STRATEGIES
    assert core.LOSS_AGGREGATIONS is choices.LOSS_AGGREGATIONS
    assert cpu_linear.MODES is choices.CPU_MATMUL
    lists = {"ppo.advantage": choices.ADVANTAGES, "ppo.loss_aggregation": choices.LOSS_AGGREGATIONS,
             "ppo.kl_estimator": choices.KL_ESTIMATORS, "ppo.kl_loss_estimator": choices.KL_ESTIMATORS,
             "device.cpu_matmul": choices.CPU_MATMUL, "device.fast_paths": choices.FAST_PATHS,
             "device.strategy": choices.STRATEGIES, "model.dtype": choices.DTYPES,
             "device.mixed_precision": choices.MIXED_PRECISIONS, "command": choices.COMMANDS,
             "doctor.stages": choices.TRAIN_STAGES}
    for key, values in lists.items():
        assert schema.SCHEMA[key].choices == values, key
    assert schema.SCHEMA["data.format"].choices == ("auto", *choices.DATA_FORMATS)


def test_fast_paths_is_a_device_key():
    assert compose("ppo").device.fast_paths == "auto"
    assert compose("ppo", ["device=cuda"]).device.fast_paths == "auto"
    from rlhf_cli.errors import RlhfError

    with pytest.raises(RlhfError, match=r"^device\.fast_paths=fast is unknown; use one of auto, on, off"):
        compose("ppo", ["device.fast_paths=fast"])
    assert "the speed paths of rlhf_cli.accel" in schema.SCHEMA["device.fast_paths"].help
