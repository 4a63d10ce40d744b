"""Shared test setup: one thread everywhere, and a fixture that runs the installed `rlhf` command."""

from __future__ import annotations

import inspect
import os
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from clitools import rlhf

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # read once, at import, by huggingface_hub: the in-process CLI is offline too

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None
if torch is not None:
    torch.set_num_threads(1)



@pytest.fixture
def run_cli(tmp_path):
    """`run_cli(*args, cwd=None, timeout=1500, stdin="")` -> (returncode, stdout, stderr) of the real `rlhf`
    command in `cwd` (default: the test's empty tmp_path), one thread, no hub access (clitools.rlhf: in this
    process, or the console script with RLHF_TEST_CLI=process)."""

    def run(*args: str, cwd: str | Path | None = None, timeout: float = 1500, stdin: str = ""):
        proc = rlhf(Path(cwd or tmp_path), *args, timeout=timeout, stdin=stdin)
        return proc.returncode, proc.stdout, proc.stderr

    return run


@pytest.fixture(scope="session")
def base(tmp_path_factory):
    """A tiny random Qwen3 (vocabulary 600, hidden 32, one layer) with its tokenizer, for library tests."""
    from rlhf_cli.tiny import build_tiny_base

    return build_tiny_base(tmp_path_factory.mktemp("base") / "base", vocab_size=600, hidden_size=32,
                           intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=16)


@pytest.fixture(scope="session")
def tok(base):
    from rlhf_cli.models import load_tokenizer

    return load_tokenizer(base)


_STARTS_RLHF = re.compile(r"\brun_cli\b|\brlhf\(|\bone_process\(|rlhf_cli\.cli\b")


def pytest_collection_modifyitems(config, items):
    """Tests that start the `rlhf` command as a process (seconds of imports each) are marked `cli`, so that
    `make test-fast` can leave them to `make test`."""
    for item in items:
        fn = getattr(item, "function", None)
        try:
            source = inspect.getsource(fn) if fn is not None else ""
        except (OSError, TypeError):
            source = ""
        if "run_cli" in getattr(item, "fixturenames", ()) or _STARTS_RLHF.search(source):
            item.add_marker(pytest.mark.cli)
    _longest_modules_first(items)


# What a test costs, roughly, by its markers (CPU seconds on the tiny recipe: a 2-process run ~60, a CLI chain
# ~20 a stage, a CLI call ~3, a unit test well under 1).
_COST = {"dist": 60.0, "slow": 20.0, "cli": 3.0}


def _longest_modules_first(items) -> None:
    """Orders whole modules by their estimated cost, the costliest first (a stable sort: each module's tests keep
    their order). `make test` hands whole modules to its 2 workers in this order (xdist's --dist loadscope with
    --no-loadscope-reorder; its default order is by number of tests, which put the few-test, minutes-long
    modules last, one worker busy with them while the other idled): the long ones start first, the many short
    ones fill in around them."""
    cost: dict[str, float] = {}
    for item in items:
        marks = {m.name for m in item.iter_markers()}
        key = item.nodeid.split("::")[0]
        cost[key] = cost.get(key, 0.0) + max([0.2] + [c for name, c in _COST.items() if name in marks])
    items.sort(key=lambda item: -cost[item.nodeid.split("::")[0]])
