"""CPU seconds an `rlhf` command spends before its stage (translating the overrides, composing the config with
Hydra, the checks), in a process that has already imported the libraries, as the test suite runs the CLI
(tests/clitools.py). The stage itself is replaced by a no-op. Median and minimum of 10 calls after a warm-up.

    python bench/probes/command_start.py [sft device.threads=1]
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))


def main(args: list[str]) -> None:
    import torch

    import rlhf_cli.cli as cli
    from clitools import rlhf

    torch.set_num_threads(1)
    cli.run_stage = lambda cfg: None  # everything a command does before its stage
    with tempfile.TemporaryDirectory() as tmp:
        rlhf(Path(tmp), *args)
        times = []
        for _ in range(10):
            t = time.process_time()
            proc = rlhf(Path(tmp), *args)
            times.append(time.process_time() - t)
            assert proc.returncode == 0, proc.stderr[-2000:]
    times.sort()
    print(f"rlhf {' '.join(args)}: {times[5]:.3f} CPU s before the stage (median of 10), {times[0]:.3f} s at least")


if __name__ == "__main__":
    main(sys.argv[1:] or ["sft", "device.threads=1"])
