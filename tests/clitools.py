"""How tests start the real `rlhf` command: one thread, no hub access, unbuffered output."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

RLHF = Path(sys.executable).with_name("rlhf")


def cli_env(**more: str) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", **more)


def rlhf(cwd: Path, *args: str, timeout: float = 1500) -> subprocess.CompletedProcess:
    """`rlhf ARGS` in `cwd` (the console script, else `python -m rlhf_cli.cli`), its output captured."""
    exe = [str(RLHF)] if RLHF.exists() else [sys.executable, "-m", "rlhf_cli.cli"]
    return subprocess.run([*exe, *map(str, args)], cwd=str(cwd), env=cli_env(), capture_output=True, text=True,
                          check=False, timeout=timeout)
