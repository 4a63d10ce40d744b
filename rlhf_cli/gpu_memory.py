"""Peak GPU memory per phase of a run.

The CUDA allocator keeps one running peak per device. A phase resets it when it begins and reads it when it ends,
so each figure is that phase's own: PPO's generation, scoring, training epochs and held-out evaluation; for the
trainer-driven stages (sft, reward, dpo) the training steps between two logs, and each evaluation. Metrics are
GiB of tensors allocated (`torch.cuda.max_memory_allocated`), the figure `rlhf doctor` plans. Off CUDA nothing is
measured and no metric is added.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

GIB = 2 ** 30


def on_cuda(device) -> bool:
    return torch.device(device).type == "cuda"


class PhasePeaks:
    """`with peaks.phase("generate"): ...` records that block's peak; `take()` returns the highest peak of each
    phase since the last take as `memory/<phase>_peak_gib` (and `memory/peak_gib`, the highest of all) and starts
    over. A phase entered several times (one per micro-batch) keeps its highest."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.on = on_cuda(self.device)
        self.peaks: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not self.on:
            yield
            return
        torch.cuda.reset_peak_memory_stats(self.device)
        try:
            yield
        finally:
            peak = torch.cuda.max_memory_allocated(self.device) / GIB
            self.peaks[name] = max(self.peaks.get(name, 0.0), peak)

    def take(self) -> dict[str, float]:
        out = {f"memory/{name}_peak_gib": v for name, v in self.peaks.items()}
        if out:
            out["memory/peak_gib"] = max(self.peaks.values())
        self.peaks = {}
        return out


def trainer_callback():
    """A transformers `TrainerCallback` that adds to each training log `memory/peak_gib`, the peak of the steps
    since the previous log, and to each evaluation's log `eval_memory/peak_gib`, the evaluation's own peak (the
    trainer tells a callback of an evaluation after its first batch, so that batch counts with the training steps
    before it). It must run before the callbacks that write the logs (`add_first`)."""
    from transformers import TrainerCallback

    def read_and_reset(device) -> float:
        peak = torch.cuda.max_memory_allocated(device) / GIB
        torch.cuda.reset_peak_memory_stats(device)
        return peak

    class GpuPeaks(TrainerCallback):
        def __init__(self):
            self.train_peak, self.in_eval = 0.0, False
            self.run = {}  # the run's highest: gpu_train_peak_gib, gpu_eval_peak_gib

        def keep(self, key: str, value: float) -> float:
            self.run[key] = max(self.run.get(key, 0.0), value)
            return value

        def on_train_begin(self, args, state, control, **kwargs):
            if on_cuda(args.device):
                torch.cuda.reset_peak_memory_stats(args.device)

        def on_prediction_step(self, args, state, control, **kwargs):
            if on_cuda(args.device) and not self.in_eval:  # an evaluation begins: training's peak kept aside
                self.train_peak, self.in_eval = max(self.train_peak, read_and_reset(args.device)), True

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not on_cuda(args.device) or logs is None or "train_runtime" in logs:
                return
            if any(k.startswith("eval_") for k in logs):
                logs["eval_memory/peak_gib"] = self.keep("gpu_eval_peak_gib", read_and_reset(args.device))
                self.in_eval = False
            else:
                peak = max(self.train_peak, read_and_reset(args.device))
                logs["memory/peak_gib"], self.train_peak = self.keep("gpu_train_peak_gib", peak), 0.0

    return GpuPeaks()


def run_peaks(trainer) -> dict[str, float]:
    """The highest training and evaluation peaks of the logs so far ({} off CUDA), for a stage's metrics.json."""
    for cb in trainer.callback_handler.callbacks:
        if type(cb).__name__ == "GpuPeaks":
            return {k: round(v, 3) for k, v in cb.run.items()}
    return {}


def add_first(trainer, callback) -> None:
    """Put `callback` ahead of the trainer's own (TensorBoard, wandb, the console), so what it adds to a log is
    written with it."""
    trainer.callback_handler.callbacks.insert(0, callback)
