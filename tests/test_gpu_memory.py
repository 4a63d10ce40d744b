"""Peak GPU memory per phase (rlhf_cli/gpu_memory.py), with CUDA's allocator faked: each phase's figure is its own
(the peak is reset when a phase begins), a phase entered per micro-batch keeps its highest, sft / reward / dpo logs
carry the training window's and the evaluation's peaks, PPO measures generation, scoring, training and evaluation
separately, and off CUDA nothing is added."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from test_ppo_eval import held_out, trainer

from rlhf_cli import gpu_memory
from rlhf_cli.gpu_memory import GIB, PhasePeaks

CUDA = torch.device("cuda", 0)


class Allocator:
    """CUDA's caching allocator as the peak statistics see it: what is allocated now and the highest since the
    last reset."""

    def __init__(self):
        self.now = self.peak = 0.0
        self.resets = 0

    def use(self, gib: float) -> None:
        self.now = gib
        self.peak = max(self.peak, gib)

    def spike(self, gib: float) -> None:  # a transient: allocated and freed within the phase
        self.peak = max(self.peak, gib)

    def reset_peak_memory_stats(self, device=None) -> None:
        self.peak, self.resets = self.now, self.resets + 1

    def max_memory_allocated(self, device=None) -> int:
        return int(self.peak * GIB)


@pytest.fixture
def alloc(monkeypatch) -> Allocator:
    a = Allocator()
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", a.reset_peak_memory_stats)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", a.max_memory_allocated)
    return a


def test_each_phase_gets_its_own_peak_and_keeps_its_highest(alloc):
    p = PhasePeaks(CUDA)
    alloc.use(2.0)
    alloc.spike(9.0)                   # before any phase: belongs to none of them
    with p.phase("generate"):
        alloc.spike(3.0)
    with p.phase("score"):
        alloc.spike(5.0)
    with p.phase("generate"):          # the next micro-batch's generation
        alloc.spike(4.0)
    assert p.take() == {"memory/generate_peak_gib": 4.0, "memory/score_peak_gib": 5.0, "memory/peak_gib": 5.0}
    assert p.take() == {}              # a take starts over
    with p.phase("train"):
        pass                           # nothing above what stays allocated
    assert p.take() == {"memory/train_peak_gib": 2.0, "memory/peak_gib": 2.0}


def test_off_cuda_nothing_is_measured(alloc):
    p = PhasePeaks("cpu")
    with p.phase("generate"):
        alloc.spike(3.0)
    assert not p.on and p.take() == {} and alloc.resets == 0


def test_trainer_logs_carry_the_window_and_the_evaluation_peaks(alloc):
    """Two logging windows with an evaluation between them (at a step that does not log): the evaluation's peak
    is its own, the training steps before it count for the next training log."""
    cb, args, state = gpu_memory.trainer_callback(), SimpleNamespace(device=CUDA), SimpleNamespace()
    alloc.use(1.0)
    cb.on_train_begin(args, state, None)
    alloc.spike(6.0)                                       # training steps
    logs = {"loss": 0.5}
    cb.on_log(args, state, None, logs=logs)
    assert logs["memory/peak_gib"] == 6.0
    alloc.spike(3.0)                                       # steps, then an evaluation begins
    cb.on_prediction_step(args, state, None)
    alloc.spike(2.0)
    eval_logs = {"eval_loss": 0.4}
    cb.on_log(args, state, None, logs=eval_logs)
    assert eval_logs["eval_memory/peak_gib"] == 2.0
    alloc.spike(2.5)                                       # steps after the evaluation
    logs = {"loss": 0.3}
    cb.on_log(args, state, None, logs=logs)
    assert logs["memory/peak_gib"] == 3.0                  # the window's highest, before the evaluation
    end = {"train_runtime": 10.0}
    cb.on_log(args, state, None, logs=end)
    assert "memory/peak_gib" not in end                    # the trainer's closing summary is left alone
    trainer_like = SimpleNamespace(callback_handler=SimpleNamespace(callbacks=[object(), cb]))
    assert gpu_memory.run_peaks(trainer_like) == {"gpu_train_peak_gib": 6.0, "gpu_eval_peak_gib": 2.0}


def test_trainer_callback_off_cuda_adds_nothing(alloc):
    cb, args = gpu_memory.trainer_callback(), SimpleNamespace(device=torch.device("cpu"))
    logs = {"loss": 0.5}
    cb.on_train_begin(args, None, None)
    cb.on_prediction_step(args, None, None)
    cb.on_log(args, None, None, logs=logs)
    assert logs == {"loss": 0.5} and alloc.resets == 0
    trainer_like = SimpleNamespace(callback_handler=SimpleNamespace(callbacks=[cb]))
    assert gpu_memory.run_peaks(trainer_like) == {}


def test_a_trainer_stage_writes_the_peaks_with_its_logs():
    """The callback goes ahead of the trainer's own, so TensorBoard and the console see what it adds."""
    from rlhf_cli.stages._common import training_console

    handler = SimpleNamespace(callbacks=["tensorboard", "console"])
    trainer_like = SimpleNamespace(callback_handler=handler, remove_callback=lambda cls: None,
                                   add_callback=handler.callbacks.append)
    with training_console(trainer_like, "sft", 1e-4):
        assert type(handler.callbacks[0]).__name__ == "GpuPeaks"


class Recorder:
    """The phases entered between two takes, in order; a take adds their number to the metrics."""

    def __init__(self):
        self.names: list[str] = []
        self.taken: list[str] = []

    @contextlib.contextmanager
    def phase(self, name: str):
        self.names.append(name)
        yield

    def take(self) -> dict[str, float]:
        self.taken.append("+".join(self.names))
        out, self.names = {"memory/phases": float(len(self.names))}, []
        return out


def test_ppo_measures_generation_scoring_training_and_evaluation_apart(base, tok, tmp_path, monkeypatch):
    t = trainer(base, tok, tmp_path, monkeypatch, held_out(tok), eval_every=2)  # 4 updates, one chunk each
    assert not t.peaks.on                                                        # the CPU: no figures
    t.peaks = Recorder()
    seen = {}
    t.hooks.on_update = lambda update, m: seen.__setitem__(update, m["memory/phases"])
    t.train()
    assert t.peaks.taken == ["generate+score+train", "generate+score+train+eval", "generate+score+train",
                             "generate+score+train+eval"]
    assert seen == {1: 3.0, 2: 4.0, 3: 3.0, 4: 4.0}  # what a take returns is in the update's metrics
