"""The library tests' tiny random Qwen3 (vocabulary 600, one layer, two heads): 32 wide for most tests
(conftest's session `base`), 64 wide where bitsandbytes' 4-bit CPU kernel needs blocks of 64 (test_qlora)."""

from __future__ import annotations

from pathlib import Path


def library_base(path: Path, width: int = 32) -> Path:
    from rlhf_cli.tiny import build_tiny_base

    return build_tiny_base(path, vocab_size=600, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=width // 2)
