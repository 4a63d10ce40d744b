"""Peak RSS growth of one `rlhf` stage in this process, for checking the doctor's memory plan (run by
tests/test_doctor.py::test_tiny_plans_within_20_percent_of_measured_rss; the calibration note in rlhf_cli/memory.py).

    python bench/probes/rss_probe.py ppo run_dir=... ppo.total_episodes=64   -> one JSON line on stdout
    python bench/probes/rss_probe.py --fork RUNS.json   -> one JSON line per run, in order

The baseline is taken after importing what the stage imports (torch, transformers with the Qwen3 model code,
peft, accelerate, trl for sft/reward, TensorBoard), so the growth counts what the run allocates: models,
optimizer, activations, generation buffers, plus the allocator's and the libraries' runtime overhead.
A thread samples the resident set size every 2 ms; `ru_maxrss` (the kernel's high-water mark) checks it.

`--fork RUNS.json` (a list of [command, override, ...]): the runs one after another, each in a process forked
from one that has imported what every stage imports (the stage's own imports, trl for sft/reward, follow in the
fork): each starts where a new process of the single-run form stands after its imports, without paying for
them again. A failed run ends the whole with its exit code.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import threading
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")


def anon_rss() -> int:
    """Anonymous resident memory (bytes): what the run allocates. Unlike the whole RSS it leaves out the pages of
    mapped library files, whose resident share depends on the page cache (a freshly installed environment maps
    more of each file), not on the run."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def common_imports() -> None:
    """What every stage imports, before its baseline."""
    import accelerate  # noqa: F401
    import peft  # noqa: F401
    import psutil  # noqa: F401
    import torch  # noqa: F401
    import torch.utils.tensorboard  # noqa: F401
    import transformers  # noqa: F401
    from transformers.models.qwen3 import modeling_qwen3  # noqa: F401

    import rlhf_cli.stages  # noqa: F401
    from rlhf_cli.config import compose  # noqa: F401


def forked(runs: list[list[str]]) -> int:
    """Each run in a fork of this process (see the module's docstring); the first failure's exit code, else 0."""
    common_imports()
    sys.stdout.flush()
    sys.stderr.flush()
    for run in runs:
        pid = os.fork()
        if pid == 0:  # the child: one run, then out without the parent's exit handlers
            code = 0
            try:
                main(run)
            except BaseException:  # noqa: BLE001 - reported like an uncaught exception, then the exit code
                import traceback

                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            return code if code > 0 else 128 - code
    return 0


def main(argv: list[str]) -> None:
    import psutil

    command, overrides = argv[0], argv[1:]
    common_imports()
    import torch

    from rlhf_cli.config import compose

    if command in ("sft", "reward"):
        import trl  # noqa: F401
        from trl import RewardTrainer, SFTTrainer  # noqa: F401
    import importlib

    stage = importlib.import_module(f"rlhf_cli.stages.{command}")
    torch.set_num_threads(1)
    cfg = compose(command, overrides)
    proc = psutil.Process()
    baseline, anon_base = proc.memory_info().rss, anon_rss()
    peak, anon_peak = [baseline], [anon_base]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            anon_peak[0] = max(anon_peak[0], anon_rss())
            time.sleep(0.002)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    t0 = time.perf_counter()
    stage.run(cfg)
    done.set()
    t.join()
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    top = max(peak[0], maxrss)
    print(json.dumps({"command": command, "baseline_mib": baseline / 2**20, "peak_mib": top / 2**20,
                      "growth_mib": (top - baseline) / 2**20, "anon_growth_mib": (anon_peak[0] - anon_base) / 2**20,
                      "seconds": time.perf_counter() - t0}))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--fork"]:
        with open(sys.argv[2], encoding="utf-8") as f:
            sys.exit(forked(json.load(f)))
    main(sys.argv[1:])
