"""The process's device: one identity, resolved once with its index, and the rules every stage shares.

accelerate names a one-process GPU run's device `cuda`, with no index (`PartialState.default_device`), while
every tensor on it reports `cuda:0`; a multi-process launch names `cuda:<local_rank>`. Comparing the two as they
come (`t.device.index != accelerator.device.index`) fails on one GPU only, so the device is resolved here, once,
to the index its tensors report, and compared only through `same`. These rules run on the CPU in the tests with
real `torch.device` objects (`cuda`, `cuda:0`, `cuda:1`, `cpu`, `meta`); what only a GPU can do (synchronise,
read its RNG) is one line each below.
"""

from __future__ import annotations

import contextlib

import torch

_INDEXLESS = ("cpu", "meta")  # one device of the kind per process: an index says nothing


def current_index(kind: str) -> int:
    """The index a tensor created on `kind` without one lands on (torch.cuda.current_device())."""
    return getattr(torch, kind).current_device()


def resolve(device) -> torch.device:
    """`device` with its index: `cuda` -> `cuda:<current>`; `cpu` and `meta` as they are (index dropped)."""
    d = torch.device(device)
    if d.type in _INDEXLESS:
        return torch.device(d.type)
    return d if d.index is not None else torch.device(d.type, current_index(d.type))


def same(a, b) -> bool:
    """Whether tensors on `a` and on `b` sit on one device (`cuda` is the current GPU, `cpu:0` is `cpu`)."""
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    return a.type in _INDEXLESS or resolve(a).index == resolve(b).index


def of_accelerator(accelerator: str) -> torch.device:
    """The device of a one-process stage (eval, chat) from `device.accelerator`: this process's GPU when that is
    cuda and one is visible, else the CPU."""
    on_gpu = str(accelerator) == "cuda" and torch.cuda.is_available()
    return resolve("cuda") if on_gpu else torch.device("cpu")


def rng_index(device) -> int | None:
    """The GPU whose random generator this process draws from on `device` (None off CUDA): the one generator a
    checkpoint saves and `fork_rng` protects, so that a resume on a machine with fewer GPUs finds it."""
    d = resolve(device)
    return d.index if d.type == "cuda" else None


def autocast(device, dtype: torch.dtype | None):
    """Forward passes at the compute dtype (`device.mixed_precision`), weights as stored; None: fp32, no autocast.
    One definition for PPO's forwards, eval's and the reward stage's score pass."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)


def synchronize(device) -> None:
    """Wait for the work queued on `device` (a GPU runs asynchronously: a clock read without this times the
    queueing, not the work); nothing to wait for on the CPU."""
    d = torch.device(device)
    if d.type == "cuda":
        torch.cuda.synchronize(resolve(d))
