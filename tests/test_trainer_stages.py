"""The trl-backed stages (sft, reward): fp32 master weights under bf16 autocast, the stop at the first
non-finite value (nothing published, an earlier output untouched), the progress lines, and the one-line error
when max_length leaves nothing to train on."""

from __future__ import annotations

import importlib
import math
from pathlib import Path

import pytest
import torch
from clitools import EVAL_ROWS, rlhf

from rlhf_cli.config import compose
from rlhf_cli.errors import RlhfError
from rlhf_cli.hardware import setup_torch
from rlhf_cli.stages._common import (
    metrics_line,
    require_finite,
    require_finite_weights,
    training_precision,
)


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    """The embedded tiny base model, built once and shared (`model.tiny.dir`, `reward.init_from=base`)."""
    from rlhf_cli.tiny import build_tiny_base

    return build_tiny_base(tmp_path_factory.mktemp("tiny") / "base")


def stage_cfg(command: str, run_dir: Path, tiny_base: Path, *overrides: str):
    return compose(command, [f"run_dir={run_dir}", f"model.tiny.dir={tiny_base}", "device.threads=1",
                             "data.max_rows=64", "reward.init_from=base", *overrides])


def build(command: str, cfg, out: Path):
    setup_torch(cfg)
    return importlib.import_module(f"rlhf_cli.stages.{command}").build_trainer(cfg, out)[0]


def one_step_changes(trainer) -> dict[str, float]:
    """Train (max_steps=1 in the config) and return, per trainable parameter, the fraction of the elements
    with a non-zero gradient that the optimizer step changed (AdamW leaves zero-gradient elements alone:
    embedding rows of tokens not in the batch, LoRA's A while B is still zero)."""
    from transformers import TrainerCallback

    params = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    before = {n: p.detach().clone() for n, p in params.items()}
    moved: dict[str, torch.Tensor] = {}

    class GradMask(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            for n, p in params.items():
                moved[n] = p.grad is not None and p.grad != 0

    trainer.add_callback(GradMask())
    trainer.train()
    out = {}
    for n, p in params.items():
        mask = moved[n]
        if isinstance(mask, torch.Tensor) and mask.any():
            out[n] = (p.detach() != before[n])[mask].float().mean().item()
    return out


# ------------------------------------------------------------------------------------------------ precision
def test_training_precision_full_fine_tune_is_fp32_with_autocast_lora_keeps_storage(tmp_path, tiny_base):
    cfg = stage_cfg("sft", tmp_path, tiny_base, "model.dtype=bfloat16", "device.mixed_precision=bf16")
    assert training_precision(cfg) == (torch.float32, {"bf16": True, "fp16": False})
    assert training_precision(cfg, adapters=True) == (torch.bfloat16, {"bf16": True, "fp16": False})
    cfg = stage_cfg("sft", tmp_path, tiny_base, "device.mixed_precision=fp16")
    assert training_precision(cfg) == (torch.float32, {"bf16": False, "fp16": True})
    cfg = stage_cfg("sft", tmp_path, tiny_base)  # the CPU default: auto -> fp32 compute
    assert training_precision(cfg) == (torch.float32, {"bf16": False, "fp16": False})


@pytest.mark.parametrize("command", ["sft", "reward"])
def test_one_bf16_step_at_lr_1e5_moves_every_fp32_master_weight(command, tmp_path, tiny_base):
    """model.dtype=bfloat16 applies to frozen weights only: the stage's trainer holds fp32 weights, runs the
    step under bf16 autocast (on the CPU too), and a 1e-5 update survives in (nearly) every element."""
    cfg = stage_cfg(command, tmp_path, tiny_base, "model.dtype=bfloat16", "device.mixed_precision=bf16",
                    f"{command}.learning_rate=1e-5", f"{command}.max_steps=1", f"{command}.lr_scheduler_type=constant")
    trainer = build(command, cfg, tmp_path / "out")
    assert trainer.args.bf16 and trainer.accelerator.mixed_precision == "bf16"
    dtypes = {p.dtype for p in trainer.model.parameters() if p.requires_grad}
    assert dtypes == {torch.float32}
    changed = one_step_changes(trainer)
    assert any("norm" in n for n in changed)
    low = {n: f for n, f in changed.items() if f < 0.9}
    assert not low, low


def test_bf16_weights_lose_the_same_step(tmp_path, tiny_base):
    """The old path (weights stored and trained in bf16, no master copy): the same step rounds away, the norm
    weights (values near 1, bf16 spacing 2^-7) do not move at all."""
    cfg = stage_cfg("sft", tmp_path, tiny_base, "device.mixed_precision=bf16", "sft.learning_rate=1e-5",
                    "sft.max_steps=1", "sft.lr_scheduler_type=constant")
    trainer = build("sft", cfg, tmp_path / "out")
    trainer.model.to(torch.bfloat16)
    changed = one_step_changes(trainer)
    norms = [f for n, f in changed.items() if "norm" in n]
    assert norms and max(norms) < 0.1, norms
    assert sum(changed.values()) / len(changed) < 0.5, changed


def test_lora_stores_the_frozen_base_in_model_dtype_and_trains_fp32_adapters(tmp_path, tiny_base):
    cfg = stage_cfg("sft", tmp_path, tiny_base, "sft.lora.enabled=true", "model.dtype=bfloat16",
                    "device.mixed_precision=bf16", "sft.learning_rate=1e-5", "sft.max_steps=1")
    trainer = build("sft", cfg, tmp_path / "out")
    frozen = {p.dtype for p in trainer.model.parameters() if not p.requires_grad}
    trained = {n: p.dtype for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert frozen == {torch.bfloat16}
    assert trained and set(trained.values()) == {torch.float32} and all("lora_" in n for n in trained)
    changed = one_step_changes(trainer)  # step 1 moves B (A's gradient is zero while B is zero)
    assert any("lora_B" in n for n in changed)
    assert min(changed.values()) >= 0.9, changed


# ----------------------------------------------------------------------------------------------- max_length
@pytest.mark.parametrize("command", ["sft", "reward"])
def test_max_length_shorter_than_every_example_is_a_one_line_error(command, tmp_path, tiny_base):
    cfg = stage_cfg(command, tmp_path, tiny_base, f"{command}.max_length=8")
    with pytest.raises(RlhfError) as e:
        build(command, cfg, tmp_path / "out")
    msg = str(e.value)
    assert f"{command}.max_length=8" in msg and "raise" in msg and "\n" not in msg, msg


# ------------------------------------------------------------------------------------------- pure helpers
def test_metrics_line_is_one_readable_line_with_progress_and_eta():
    logs = {"loss": 2.345678, "grad_norm": 1.5, "learning_rate": 0.001, "num_tokens": 3117.0, "epoch": 0.01}
    assert metrics_line("sft", logs, 10, 40, 5.0, 10) == \
        "sft step 10/40 (25%, 00:05<00:15): loss 2.346, grad_norm 1.5, learning_rate 0.001"
    ev = {"eval_loss": 7.0, "eval_runtime": 1.2, "eval_samples_per_second": 400.0, "eval_accuracy": 0.75}
    assert metrics_line("reward", ev, 0, 0, 0.0, 0) == "reward before training eval: loss 7, accuracy 0.75"
    assert metrics_line("sft", {"train_runtime": 3.0, "train_loss": 1.0}, 40, 40, 20.0, 40) is None


def test_non_finite_values_are_one_line_errors_naming_the_learning_rate():
    with pytest.raises(RlhfError, match=r"reward: score mean is nan at step 5; .*reward.learning_rate \(now 0.001\)"):
        require_finite("reward", {"mean": math.nan, "std": 1.0, "n": 8}, "score", 1e-3, 5)
    require_finite("reward", {"mean": 0.5, "std": 1.0, "n": 8}, "score", 1e-3, 5)
    layer = torch.nn.Linear(2, 2)
    require_finite_weights(layer, "sft", 1e-3, 3)
    with torch.no_grad():
        layer.weight[0, 0] = math.inf
    with pytest.raises(RlhfError, match=r"sft: trained weight weight is not finite at step 3"):
        require_finite_weights(layer, "sft", 1e-3, 3)


# ------------------------------------------------------------------------------------- the real CLI, NaN
def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_base):
    """A working directory with a good sft and reward output (a few steps each); returns (cwd, common args)."""
    cwd = tmp_path_factory.mktemp("stages")
    common = [f"model.tiny.dir={tiny_base}", "device.threads=1", "data.max_rows=64", "reward.init_from=base",
              "sft.eval_steps=1000", "reward.eval_steps=1000", EVAL_ROWS]
    for command in ("sft", "reward"):
        proc = rlhf(cwd, command, *common, f"{command}.max_steps=2", f"{command}.logging_steps=1")
        assert proc.returncode == 0, proc.stderr[-3000:]
    return cwd, common


@pytest.mark.parametrize("command", ["sft", "reward"])
def test_progress_goes_out_as_metric_lines_not_raw_dicts(command, trained):
    cwd, _ = trained
    log_text = (cwd / f"runs/tiny/logs/{command}/cli.log").read_text()
    assert f"{command} step 1/2 (50%, " in log_text and "loss " in log_text, log_text
    assert f"{command} step 2/2 (100%, " in log_text
    assert "{'loss'" not in log_text
    final_evals = [line for line in log_text.splitlines() if "step 2/2" in line and " eval: " in line]
    assert len(final_evals) == 1, log_text  # the trainer's end-of-training eval, not run a second time


@pytest.mark.parametrize("command", ["sft", "reward"])
def test_huge_learning_rate_stops_with_one_line_and_keeps_the_earlier_output(command, trained):
    cwd, common = trained
    out = cwd / f"runs/tiny/{command}"
    before = snapshot(out)
    assert "model.safetensors" in before
    proc = rlhf(cwd, command, *common, f"{command}.max_steps=3", f"{command}.learning_rate=1e6")
    assert proc.returncode != 0
    err = proc.stderr.strip()
    assert "Traceback" not in err, err[-2000:]
    last = err.splitlines()[-1]
    assert last.startswith(f"rlhf {command}: error: {command}: "), last
    assert " is nan at step " in last or " is inf at step " in last or "not finite" in last, last
    assert f"lower {command}.learning_rate (now 1e+06)" in last, last
    assert snapshot(out) == before
    assert not [p.name for p in out.parent.iterdir() if p.name.startswith(f".{command}.")]
