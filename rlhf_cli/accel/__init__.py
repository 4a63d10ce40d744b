"""Every speed path of rlhf in one package, installed in one place and switched by one setting.

    paths = accel.configure(run, device)      # run: settings.of(cfg); device.fast_paths: auto | on | off
    paths.install(policy, ref, value, reward) # on built models; the trainer and the maths know nothing of it
    Sampling(..., engine=paths.sampler)       # "loop" (sample_loop) or "generate" (transformers)

The paths, each giving the same numbers as the stock code it replaces (tests compare outputs and gradients):
- `sample_loop`: the sampling engine (own loop, preallocated KV cache, merged-LoRA weights, `decode`'s one-token
  steps, W·xᵀ products for few rows on CPUs where that is faster);
- `tail`: the last decoder layer run on the read positions only while scoring and in the PPO epochs;
- `fused`: fused RMSNorm and LoRA linear layers (fp32 CPU inputs);
- `cpu_linear`: fp32 linear layers on oneDNN on CPUs where it runs faster than BLAS (`device.cpu_matmul`);
- `sparse_rows`: a fully trained value model's embedding stepped through the rows its tokens reach
  (`ppo.sparse_value_embedding`).

`auto` turns them on where they are proven: on the CPU. On CUDA and other accelerators none has run yet, so `auto`
keeps transformers' and peft's own forwards and `generate()` there until `make gpu-check` shows the same logits and
gradients and a gain; `on` forces them (for that check), `off` gives the stock code everywhere (for bisecting).
This module imports no torch at import time (`limits` is read by the torch-free doctor).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from rlhf_cli.accel.limits import PROVEN_ON, enabled  # noqa: F401 - the rule lives with the doctor's constants

log = logging.getLogger("rlhf")


@dataclass(frozen=True)
class FastPaths:
    on: bool                    # the paths are installed and the fast sampling engine runs
    sparse_embedding: bool = False  # ppo.sparse_value_embedding (only where `on`)

    @property
    def sampler(self) -> str:
        """The sampling engine (`rlhf_cli.ppo.sampling`)."""
        return "loop" if self.on else "generate"

    def install(self, *models) -> dict[str, int]:
        """Install the model-level paths on each built model (None skipped); returns how many layers each path
        switched (logged, so that a run says which forwards its layers run)."""
        counts = {"fused RMSNorm": 0, "fused LoRA": 0, "last-layer span": 0, "oneDNN linear": 0}
        if not self.on:
            return counts
        from rlhf_cli.accel import cpu_linear, fused, tail

        for m in models:
            if m is not None:
                counts["fused RMSNorm"] += fused.fuse_rms_norms(m)
                counts["fused LoRA"] += fused.fuse_lora_linears(m)
                counts["last-layer span"] += tail.install(m)
                counts["oneDNN linear"] += cpu_linear.install(m)
        log.info("fast paths: %s layers switched; sampling engine %s",
                 ", ".join(f"{k} {v}" for k, v in counts.items()), self.sampler)
        return counts

    def value_embedding(self, value, world: int, weight_decay: float):
        """The value model's input embedding as a `sparse_rows.RowSparseEmbedding` (installed now: the weight leaves
        autograd), or None where it trains densely. `value`: the `TokenValueModel` (or its inner model)."""
        if value is None or not (self.on and self.sparse_embedding):
            return None
        from rlhf_cli.accel.sparse_rows import RowSparseEmbedding

        value = getattr(value, "model", value)  # the sequence-classification model inside TokenValueModel
        if not value.get_input_embeddings().weight.requires_grad:  # a LoRA value model: the embedding is frozen
            return None
        why = RowSparseEmbedding.applies(value) or ("it runs in more than one process" if world > 1 else None) \
            or (f"ppo.weight_decay={weight_decay:g}" if weight_decay else None)
        if why:
            log.info("ppo: the value model's embedding trains densely: %s", why)
            return None
        return RowSparseEmbedding(value.get_input_embeddings())


def configure(run, device_type: str) -> FastPaths:
    """The speed paths the run's settings (`run`: rlhf_cli.settings.of) ask for on this device, with the
    process-wide CPU matmul setting applied (`device.cpu_matmul`; `blas` where the paths are off)."""
    on = enabled(str(run.device.get("fast_paths") or "auto"), device_type)
    if on and str(run.device.get("strategy")) == "fsdp":
        log.info("fast paths: off under device.strategy=fsdp (they replace forwards and sampling of whole models "
                 "in one process; sharded models run transformers' forwards and generate())")
        on = False
    if on and run.get("command") == "ppo" and bool(run.ppo.get("activation_checkpointing")):
        log.info("fast paths: off with ppo.activation_checkpointing (their forwards are not checked under the "
                 "recomputation of checkpointed layers)")
        on = False
    if on and str(run.get("model", {}).get("quantization") or "none") != "none":
        log.info("fast paths: off with model.quantization (they read plain weights: bitsandbytes layers run their "
                 "own kernels through transformers' forwards and generate())")
        on = False
    from rlhf_cli.accel import cpu_linear

    cpu_linear.set_mode(str(run.device.get("cpu_matmul") or "auto") if on else "blas")
    sparse = bool(run.get("ppo", {}).get("sparse_value_embedding", False))
    return FastPaths(on=on, sparse_embedding=on and sparse)
