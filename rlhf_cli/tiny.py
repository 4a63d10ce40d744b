"""The zero-download default base model (``model.name_or_path: tiny``).

A byte-level BPE tokenizer is trained locally on the shipped demo training data (or on a user's data: see
rlhf_cli.own_data) and paired with a
randomly initialised two-layer Qwen3 model (about half a million parameters). Everything is built
deterministically from a seed and cached in a directory, so the whole pipeline runs offline and quickly on
a CPU.

Tokenizer special tokens: ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` (eos, end of a chat turn) and
``<|pad|>`` (padding, distinct from eos). Like Qwen3, the tokenizer has no bos token (``bos_token`` is
None) and never adds one; the model config's ``bos_token_id`` points at ``<|endoftext|>`` as Qwen3's does.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from rlhf_cli.errors import RlhfError

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedTokenizerFast

__all__ = [
    "TINY_NAME",
    "SPECIAL_TOKENS",
    "CHAT_TEMPLATE",
    "MARKER_FILE",
    "is_tiny_spec",
    "train_tokenizer",
    "build_tiny_base",
]

TINY_NAME = "tiny"
MARKER_FILE = "tiny_base.json"
# Bump when the build recipe changes so that cached directories are rebuilt.
_RECIPE_VERSION = 1

SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")

# ChatML. Every role is rendered as ``<|im_start|>role\ncontent<|im_end|>\n``; the assistant content and its
# ``<|im_end|>`` sit inside generation markers so that assistant-only loss masks exactly the reply and the
# end-of-turn token. ``enable_thinking`` (and any other extra variable) is accepted and ignored.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- set content = message['content'] if message['content'] is string else '' -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- generation -%}"
    "{{- content + '<|im_end|>' -}}"
    "{%- endgeneration -%}"
    "{{- '\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)


def is_tiny_spec(name: str) -> bool:
    """True if a model name means the embedded tiny model (the literal name ``tiny``)."""
    return isinstance(name, str) and name.strip() == TINY_NAME


def train_tokenizer(texts: Iterable[str], vocab_size: int = 2000) -> PreTrainedTokenizerFast:
    """Train a deterministic byte-level BPE tokenizer on ``texts`` and wrap it for transformers.

    The vocabulary may stay below ``vocab_size`` when the texts run out of pairs to merge.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [t for t in texts if t]
    if not texts:
        raise RlhfError("train_tokenizer: no training texts given; pass at least one non-empty string")
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise RlhfError(f"train_tokenizer: vocab_size={vocab_size} is too small; use at least 260")

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        max_token_length=12,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        unk_token=None,
        bos_token=None,
        chat_template=CHAT_TEMPLATE,
        padding_side="left",
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )


def _demo_texts(train_file: Path) -> list[str]:
    texts: list[str] = []
    with open(train_file, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise RlhfError(f"{train_file}:{lineno}: invalid JSON ({e.msg}); regenerate it with "
                                "`python -m rlhf_cli.demo.make_data`") from None
            texts.extend(str(row[k]) for k in ("question", "chosen", "rejected") if row.get(k))
    return texts


def _file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _texts_sha256(texts: list[str]) -> str:
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode("utf-8") + b"\0")
    return h.hexdigest()


def _read_marker(out_dir: Path) -> dict | None:
    try:
        return json.loads((out_dir / MARKER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence transformers' progress bars and info/warning logs for the duration of the build."""
    from transformers.utils import logging as hf_logging

    bars_were_on = hf_logging.is_progress_bar_enabled()
    verbosity = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars_were_on:
            hf_logging.enable_progress_bar()


def build_tiny_base(
    out_dir: str | os.PathLike,
    *,
    seed: int = 0,
    vocab_size: int = 2000,
    hidden_size: int = 128,
    intermediate_size: int = 256,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 32,
    max_position_embeddings: int = 512,
    embedding_rows: int | None = None,
    texts: list[str] | None = None,
) -> Path:
    """Build (or reuse) the tiny base model + tokenizer in ``out_dir`` and return its path.

    ``embedding_rows``: the model's vocabulary rows (None: the tokenizer's size). More rows than tokens give the
    shape of real checkpoints (Qwen3: 151,936 rows for 151,669 tokens), e.g. the Qwen3-0.6B architecture with
    random weights for checks that need no download.

    ``texts``: what the tokenizer is trained on (None: the shipped demo's training file), e.g. a user's data
    (rlhf_cli.own_data.tokenizer_texts); the marker then records their hash instead of the demo file's.

    A ``tiny_base.json`` marker records the build arguments and the training data's hash. If ``out_dir``
    already holds a build with the same marker it is returned untouched; otherwise it is rebuilt in a
    temporary sibling directory and moved into place, so ``out_dir`` is never left half-written.
    """
    from rlhf_cli.demo import TRAIN_FILE

    out_dir = Path(out_dir).expanduser().resolve()
    if not TRAIN_FILE.is_file():
        raise RlhfError(f"demo data {TRAIN_FILE} is missing; reinstall rlhf-cli or run "
                        "`python -m rlhf_cli.demo.make_data`")
    if num_attention_heads % num_key_value_heads:
        raise RlhfError(f"tiny model: num_attention_heads={num_attention_heads} must be a multiple of "
                        f"num_key_value_heads={num_key_value_heads}")
    marker = {
        "recipe_version": _RECIPE_VERSION,
        "seed": seed,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim,
        "max_position_embeddings": max_position_embeddings,
        "train_data_sha256": _file_sha256(TRAIN_FILE) if texts is None else _texts_sha256(texts),
    }
    if texts is not None:  # only then: the demo's build keeps its marker (and its cache)
        marker["train_data"] = "texts"
    if embedding_rows is not None:  # only when set: earlier builds keep their marker (and their cache)
        marker["embedding_rows"] = int(embedding_rows)
    if _read_marker(out_dir) == marker:
        return out_dir
    if out_dir.exists() and not out_dir.is_dir():
        raise RlhfError(f"tiny model directory {out_dir} exists and is not a directory; remove it or choose "
                        "another path")
    if out_dir.is_dir() and _read_marker(out_dir) is None and any(out_dir.iterdir()):
        # Never replace a directory this module did not build.
        raise RlhfError(f"tiny model directory {out_dir} is not empty and has no {MARKER_FILE}; remove it or "
                        "choose another path")

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.building-", dir=out_dir.parent))
    try:
        _build_into(tmp_dir, marker, _demo_texts(TRAIN_FILE) if texts is None else texts)
        _move_into_place(tmp_dir, out_dir, marker)
    finally:
        if tmp_dir.exists():
            shutil.rmtree(tmp_dir, ignore_errors=True)
    return out_dir


def _build_into(tmp_dir: Path, marker: dict, texts: list[str]) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    with _quiet():
        tok = train_tokenizer(texts, vocab_size=marker["vocab_size"])
        ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
        rows = marker.get("embedding_rows") or len(tok)
        if rows < len(tok):
            raise RlhfError(f"model.tiny.embedding_rows={rows} is smaller than the tokenizer ({len(tok)} tokens)")
        config = Qwen3Config(
            vocab_size=rows,
            hidden_size=marker["hidden_size"],
            intermediate_size=marker["intermediate_size"],
            num_hidden_layers=marker["num_hidden_layers"],
            num_attention_heads=marker["num_attention_heads"],
            num_key_value_heads=marker["num_key_value_heads"],
            head_dim=marker["head_dim"],
            max_position_embeddings=marker["max_position_embeddings"],
            tie_word_embeddings=True,
            pad_token_id=ids["<|pad|>"],
            bos_token_id=ids["<|endoftext|>"],
            eos_token_id=ids["<|im_end|>"],
        )
        # Seed a private RNG state so that the caller's global torch RNG is left as it was.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(marker["seed"])
            model = Qwen3ForCausalLM(config)
        model.generation_config.pad_token_id = ids["<|pad|>"]
        model.generation_config.eos_token_id = ids["<|im_end|>"]
        model.generation_config.bos_token_id = ids["<|endoftext|>"]
        model.save_pretrained(tmp_dir, safe_serialization=True)
        tok.save_pretrained(tmp_dir)
    # The marker is written last: its presence means the directory is complete.
    (tmp_dir / MARKER_FILE).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    # mkdtemp (and the weights writer) create owner-only entries; make the cache readable like a normal dir.
    os.chmod(tmp_dir, 0o755)
    for path in tmp_dir.iterdir():
        if path.is_file():
            os.chmod(path, 0o644)


def _move_into_place(tmp_dir: Path, out_dir: Path, marker: dict) -> None:
    old: Path | None = None
    if out_dir.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        os.replace(out_dir, old / "stale")
    try:
        os.rename(tmp_dir, out_dir)
    except OSError:
        # Another process finished the same build first: keep its result if it matches.
        if _read_marker(out_dir) != marker:
            raise RlhfError(
                f"could not move the tiny model into {out_dir}; remove that directory and retry"
            ) from None
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
