"""The process's device (rlhf_cli/devices.py) with real `torch.device` objects: `cuda` without an index (what
accelerate names a one-process GPU run's device), `cuda:0`, `cuda:1`, `cpu`, `meta`. No GPU is needed: the index
a bare `cuda` stands for (torch.cuda.current_device()) and the CUDA calls are replaced where a rule reads them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlhf_cli import devices
from rlhf_cli.ppo import checkpoint
from rlhf_cli.ppo.trainer import PPOTrainer

CUDA, CUDA0, CUDA1, CPU, META = (torch.device(d) for d in ("cuda", "cuda:0", "cuda:1", "cpu", "meta"))


@pytest.fixture
def gpu(monkeypatch):
    """This process's GPU is `index` (torch.cuda.current_device())."""
    def on(index: int):
        monkeypatch.setattr(devices, "current_index", lambda kind: index)
    on(0)
    return on


def test_resolve_gives_a_bare_cuda_the_current_index(gpu):
    assert devices.resolve(CUDA) == CUDA0 and devices.resolve("cuda") == CUDA0
    gpu(1)
    assert devices.resolve(CUDA) == CUDA1
    assert devices.resolve(CUDA0) == CUDA0  # an index given is kept
    assert devices.resolve(CPU) == CPU and devices.resolve(torch.device("cpu", 0)) == CPU
    assert devices.resolve(META) == META


@pytest.mark.parametrize("a, b, current, expected", [
    (CUDA0, CUDA, 0, True),    # one GPU: accelerate's device and its tensors'
    (CUDA, CUDA0, 0, True),
    (CUDA1, CUDA, 0, False),   # another process's GPU
    (CUDA1, CUDA, 1, True),
    (CUDA0, CUDA1, 0, False),
    (CUDA, CUDA, 3, True),
    (CPU, CPU, 0, True),
    (torch.device("cpu", 0), CPU, 0, True),
    (CPU, CUDA, 0, False),
    (CUDA0, CPU, 0, False),
    (META, META, 0, True),
    (META, CPU, 0, False),
])
def test_same_device(gpu, a, b, current, expected):
    gpu(current)
    assert devices.same(a, b) is expected


class OnDevice:
    """A tensor's device and shape, where no such device exists here."""

    def __init__(self, device):
        self.device, self.shape = torch.device(device), (2,)


def trainer_on(device, world: int = 1):
    return SimpleNamespace(device=device, world=world, acc=None)


def test_reduce_takes_this_gpus_tensors_in_a_one_process_run(gpu):
    """accelerate's one-process device is a bare `cuda`; every tensor reports cuda:0. The collective check compared
    the indexes as they came (0 != None) and stopped every single-GPU PPO run at its first update."""
    t = OnDevice("cuda:0")
    assert PPOTrainer.reduce(trainer_on(CUDA), t, "sum") is t
    assert PPOTrainer.reduce(trainer_on(CUDA0), t, "mean") is t


@pytest.mark.parametrize("process, tensor, current", [(CUDA, "cuda:1", 0), (CUDA1, "cuda:0", 0), (CUDA0, "cpu", 0),
                                                      (CPU, "cuda:0", 0), (CPU, "meta", 0)])
def test_reduce_refuses_a_tensor_on_another_device(gpu, process, tensor, current):
    gpu(current)
    with pytest.raises(RuntimeError, match="would enter a collective"):
        PPOTrainer.reduce(trainer_on(process), OnDevice(tensor), "sum")


def test_reduce_on_the_cpu_and_meta():
    t = torch.zeros(2)
    assert PPOTrainer.reduce(trainer_on(CPU), t, "sum") is t
    m = torch.zeros(2, device="meta")
    assert PPOTrainer.reduce(trainer_on(META), m, "sum") is m


def test_rng_index_is_this_processs_gpu(gpu):
    gpu(2)
    assert devices.rng_index(CUDA) == 2 and devices.rng_index(CUDA1) == 1 and devices.rng_index(CUDA0) == 0
    assert devices.rng_index(CPU) is None and devices.rng_index(META) is None


def test_checkpoint_rng_holds_this_processs_gpu_only(gpu, monkeypatch):
    """A checkpoint saves the generator of the process's own GPU, not every visible one (a resume on a machine
    with fewer GPUs failed on the ordinal), and restores into that GPU."""
    got, put = [], []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda i: got.append(i) or torch.full((8,), i, dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: pytest.fail("every GPU's state read"))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, i: put.append((s.tolist(), i)))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda s: pytest.fail("every GPU's state written"))
    js, tensors = checkpoint.rng_state(CUDA1)
    assert sorted(tensors) == ["cuda", "torch"] and got == [1] and tensors["cuda"].tolist() == [1] * 8
    gpu(3)
    checkpoint.set_rng_state(js, tensors, CUDA)  # resumed as another process whose GPU is 3
    assert put == [([1] * 8, 3)]
    put.clear()
    checkpoint.set_rng_state(js, tensors, CPU)  # a GPU checkpoint resumed on the CPU: the CPU streams only
    assert put == []
    js, tensors = checkpoint.rng_state(CPU)
    assert sorted(tensors) == ["torch"]
    checkpoint.set_rng_state(js, tensors, CUDA0)  # a CPU checkpoint on a GPU: the GPU's stream as seeded
    assert put == []


def test_checkpoint_rng_check_refuses_a_gpu_state_that_is_none(tmp_path):
    js, tensors = checkpoint.rng_state(CPU)
    tensors["cuda"] = torch.zeros(4, dtype=torch.float32)
    from rlhf_cli.errors import RlhfError

    with pytest.raises(RlhfError, match="rng/0/cuda is torch.float32"):
        checkpoint.check_rng(js, tensors, tmp_path / "state.json", tmp_path / "state.safetensors", tmp_path, 0)


def test_of_accelerator(gpu, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert devices.of_accelerator("cuda") == CPU and devices.of_accelerator("cpu") == CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    gpu(1)
    assert devices.of_accelerator("cuda") == CUDA1 and devices.of_accelerator("cpu") == CPU


def test_synchronize_waits_on_this_gpu_only_when_there_is_one(gpu, monkeypatch):
    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d: waited.append(d))
    devices.synchronize(CPU)
    devices.synchronize(META)
    assert waited == []
    gpu(1)
    devices.synchronize(CUDA)
    devices.synchronize("cuda:0")
    assert waited == [CUDA1, CUDA0]


def test_autocast_at_the_compute_dtype():
    with devices.autocast(CPU, None):
        assert not torch.is_autocast_enabled("cpu")
    with devices.autocast(CPU, torch.bfloat16):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert torch.nn.functional.linear(torch.ones(1, 2), torch.ones(3, 2)).dtype == torch.bfloat16


def test_trainer_and_stages_resolve_the_device_once():
    """Every place that takes accelerate's device resolves it (a source check: the places that compare or place
    tensors read the resolved device)."""
    from pathlib import Path

    pkg = Path(devices.__file__).parent
    trainer = (pkg / "ppo" / "trainer.py").read_text()
    assert "self.device = devices.resolve(accelerator.device)" in trainer
    assert "devices.same(t.device, self.device)" in trainer
    assert "build_ppo_models(typed, tok, devices.resolve(acc.device)" in (pkg / "stages" / "ppo.py").read_text()
    # nothing else compares device indexes by hand
    offenders = [p.name for p in pkg.rglob("*.py") if p.name != "devices.py" and ".index !=" in p.read_text()]
    assert offenders == []
