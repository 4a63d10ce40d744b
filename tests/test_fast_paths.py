"""`device.fast_paths` (rlhf_cli.accel): one switch for every speed path. `auto` is on for the CPU and off on CUDA
(nothing proven there yet); `off` gives transformers' and peft's stock forwards and `generate()`; and a PPO update
gives the same numbers either way."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from places import CUDA
from torch import nn

from rlhf_cli import accel
from rlhf_cli.config import compose, ppo_sizes

PROMPTS = [f"<|im_start|>user\nHow do I cook rice, question {i}?<|im_end|>\n<|im_start|>assistant\n" for i in range(8)]


@pytest.mark.parametrize("mode, device, on", [("auto", "cpu", True), ("auto", "cuda", False), ("auto", "xpu", False),
                                              ("on", "cuda", True), ("off", "cpu", False), ("on", "cpu", True)])
def test_auto_is_on_for_the_cpu_only(mode, device, on):
    assert accel.enabled(mode, device) is on


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="device.fast_paths must be one of auto, on, off"):
        accel.enabled("fast", "cpu")


def cfg_for(base, mode: str, *more: str):
    return compose("ppo", ["recipe=tiny-rule", f"device.fast_paths={mode}", f"ppo.policy_dir={base}",
                           "ppo.per_device_train_batch_size=4", "ppo.gradient_accumulation_steps=2",
                           "ppo.num_mini_batches=1", "ppo.rollout_forward_batch_size=8", "ppo.total_episodes=16",
                           "ppo.response_length=6", "ppo.num_ppo_epochs=2", "ppo.warmup_ratio=0", "ppo.temperature=1.0",
                           "ppo.lora.r=4", "ppo.lora.alpha=8", "ppo.lora.target_modules=all-linear", *more])


def swapped(model: nn.Module) -> list[str]:
    """Modules whose forward was replaced on the instance."""
    return [name for name, m in model.named_modules() if "forward" in m.__dict__]


def test_on_a_cuda_device_auto_keeps_the_stock_code(base, tok):
    """A faked CUDA device: `auto` resolves to the stock paths, and installing them changes no module."""
    from rlhf_cli.accel import cpu_linear
    from rlhf_cli.ppo.build import build_ppo_models

    cfg = cfg_for(base, "auto")
    paths = accel.configure(cfg, "cuda")
    assert not paths.on and paths.sampler == "generate" and cpu_linear._state["mode"] == "blas"
    models = build_ppo_models(cfg, tok, torch.device("cpu"), torch.float32, paths)  # built on the CPU, as on CUDA
    assert all(not swapped(m) for m in (models.policy, models.value)) and not models.on_optimizer
    on = accel.configure(cfg, "cpu")
    assert on.on and on.sampler == "loop" and on.sparse_embedding
    models = build_ppo_models(cfg, tok, torch.device("cpu"), torch.float32, on)
    assert swapped(models.policy) and swapped(models.value) and len(models.on_optimizer) == 1




def one_update(base, tok, tmp_path, mode: str, device: str = "cpu") -> dict:
    from accelerate import Accelerator

    from rlhf_cli.ppo.build import build_ppo_models
    from rlhf_cli.ppo.config import PPOConfig
    from rlhf_cli.ppo.trainer import PPOTrainer, PromptStream
    from rlhf_cli.stages import _sampling

    cfg = cfg_for(base, mode)
    torch.manual_seed(0)
    paths = accel.configure(cfg, device)
    models = build_ppo_models(cfg, tok, torch.device(device), torch.float32, paths)
    # greedy: both engines pick the same tokens (sampled ones would come from two random streams)
    s = replace(_sampling.sampling(cfg, tok, len(tok), recompute=False, engine=paths.sampler), greedy=True)
    trainer = PPOTrainer(PPOConfig.from_cfg(cfg.ppo), ppo_sizes(cfg.ppo), models, tok,
                         PromptStream(PROMPTS, 0, 0, 1), s, Accelerator(cpu=device == "cpu"), tmp_path / mode)
    exp = trainer.compute_advantages(trainer.make_experience())
    metrics = trainer.metrics(exp, trainer.update(exp))
    weights = {n: p.detach().clone() for n, p in trainer.unwrapped.named_parameters() if p.requires_grad}
    weights.update({f"value.{n}": p.detach().clone() for n, p in trainer.value_model().named_parameters()})
    return {"metrics": metrics, "weights": weights, "texts": exp.texts}


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_one_ppo_update_gives_the_same_numbers_on_and_off(base, tok, tmp_path, device):
    """Tolerance: fp32, the fused / span / sparse paths sum in another order than the stock ones: 1e-4 relative
    on every metric and every trained weight after two PPO epochs. On CUDA this is the check that a path must
    pass before `auto` may turn it on there (bench/gpu_check.sh runs it)."""
    on, off = one_update(base, tok, tmp_path, "on", device), one_update(base, tok, tmp_path, "off", device)
    assert on["texts"] == off["texts"]
    assert on["metrics"].keys() == off["metrics"].keys()
    for k, v in off["metrics"].items():
        assert on["metrics"][k] == pytest.approx(v, rel=1e-4, abs=1e-5), k
    assert on["weights"].keys() == off["weights"].keys()
    for k, w in off["weights"].items():
        torch.testing.assert_close(on["weights"][k], w, rtol=1e-4, atol=1e-5, msg=k)
    moved = sum(int(not torch.equal(w, 0 * w)) for k, w in off["weights"].items() if "lora_B" in k)
    assert moved > 0  # the update did something
