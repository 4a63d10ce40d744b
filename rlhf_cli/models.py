"""Model sources (embedded tiny, local directory, ModelScope, Hugging Face), dtype, tokenizer and model loading."""

from __future__ import annotations

import logging
import os
import random
import warnings
from pathlib import Path

import torch

from rlhf_cli.errors import RlhfError

log = logging.getLogger("rlhf")


# ------------------------------------------------------------------------------------------------- process
def setup_torch(cfg) -> None:
    """Thread count and seeds, first thing in every stage (two threads per process on a busy 2-core box can
    run 20x slower than one, so the count is explicit)."""
    threads = int(cfg.device.get("threads") or 0)
    if threads > 0:
        torch.set_num_threads(threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    seed = int(cfg.seed)
    random.seed(seed)
    torch.manual_seed(seed)
    import transformers

    import datasets

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    datasets.utils.logging.disable_progress_bar()
    datasets.utils.logging.set_verbosity_error()
    # library-internal notices a user cannot act on: peft reads a renamed transformers attribute, and warns about
    # a LoRA on a tied lm_head, which merge_lora and merged sampling handle (the embeddings stay as they are)
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*ensure_weight_tying.*", category=UserWarning)
    warnings.filterwarnings("ignore", message=".*save_embedding_layers.*", category=UserWarning)


def resolve_dtype(name: str, accelerator: str) -> torch.dtype:
    """auto: bf16 on GPUs that support it, else fp16 on CUDA, fp32 on the CPU."""
    if name in (None, "auto"):
        if accelerator == "cuda" and torch.cuda.is_available():
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    try:
        dtype = getattr(torch, str(name))
    except AttributeError:
        dtype = None
    if not isinstance(dtype, torch.dtype):
        raise RlhfError(f"model.dtype={name} is not a torch dtype; use auto, float32, bfloat16 or float16")
    return dtype


# -------------------------------------------------------------------------------------------------- sources
def base_model_dir(cfg) -> Path:
    """The base model directory: the embedded tiny model (built on first use), a local dir, or a hub id."""
    m = cfg.model
    if str(m.name_or_path) == "tiny":
        from rlhf_cli import tiny

        t = m.tiny
        return tiny.build_tiny_base(t.dir, seed=int(t.seed), vocab_size=int(t.vocab_size),
                                    hidden_size=int(t.hidden_size), intermediate_size=int(t.intermediate_size),
                                    num_hidden_layers=int(t.num_hidden_layers),
                                    num_attention_heads=int(t.num_attention_heads),
                                    num_key_value_heads=int(t.num_key_value_heads), head_dim=int(t.head_dim))
    return resolve_model_source(str(m.name_or_path), hub=m.hub, revision=m.revision, cache_dir=m.cache_dir,
                                offline=bool(m.offline))


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name


def resolve_model_source(name: str, hub: str = "modelscope", revision: str | None = None,
                         cache_dir: str | None = None, offline: bool = False) -> Path:
    """A local directory as is; a hub id from the local cache first, then (unless offline) the network.

    ModelScope retries for ~22 s when offline, so the cache is asked first with `local_files_only=True`, which
    answers at once.
    """
    p = Path(name).expanduser()
    if p.is_dir():
        if not (p / "config.json").exists():
            raise RlhfError(f"model directory {p} has no config.json; point model.name_or_path at a saved model")
        return p
    if _looks_like_path(name):
        raise RlhfError(f"model path {p} does not exist; set model.name_or_path to a model directory or a hub id "
                        "such as Qwen/Qwen3-0.6B")
    if hub not in ("modelscope", "hf"):
        raise RlhfError(f"model.hub={hub} is unknown; use modelscope or hf")
    fetch = _modelscope_snapshot if hub == "modelscope" else _hf_snapshot
    try:
        return Path(fetch(name, revision, cache_dir, local_files_only=True))
    except Exception as cached_err:  # noqa: BLE001 - not in the cache: fall through to the network
        if offline:
            raise RlhfError(f"{name} is not in the local {hub} cache and model.offline=true; download it once "
                            f"with network access, or set model.name_or_path to a local directory") from cached_err
    log.info("downloading %s from %s", name, hub)
    try:
        return Path(fetch(name, revision, cache_dir, local_files_only=False))
    except Exception as e:  # noqa: BLE001 - network errors, unknown ids, auth: all one line for the user
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise RlhfError(f"could not get model '{name}' from {hub} ({type(e).__name__}: {first}); check the id and "
                        f"the network, try model.hub={'hf' if hub == 'modelscope' else 'modelscope'}, "
                        "or set model.name_or_path to a local directory") from e


def _modelscope_snapshot(name, revision, cache_dir, local_files_only):
    from modelscope import snapshot_download

    kwargs = {"cache_dir": cache_dir, "local_files_only": local_files_only}
    if revision:
        kwargs["revision"] = revision
    return snapshot_download(name, **kwargs)


def _hf_snapshot(name, revision, cache_dir, local_files_only):
    from huggingface_hub import snapshot_download

    return snapshot_download(name, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only)


# ------------------------------------------------------------------------------------------------ tokenizer
def load_tokenizer(path: str | Path, model_cfg=None):
    """Tokenizer with a pad token distinct from EOS (so masks can tell padding from a real end) and a chat
    template; left padding for generation."""
    from transformers import AutoTokenizer

    trust = bool(model_cfg.trust_remote_code) if model_cfg is not None else False
    tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust)
    pad = model_cfg.get("pad_token") if model_cfg is not None else None
    if pad:
        if tok.convert_tokens_to_ids(pad) in (None, tok.unk_token_id):
            raise RlhfError(f"model.pad_token={pad!r} is not in the tokenizer's vocabulary at {path}")
        tok.pad_token = pad
    if tok.eos_token_id is None:
        raise RlhfError(f"tokenizer at {path} has no EOS token; set eos_token in its tokenizer_config.json")
    if tok.pad_token_id is None or tok.pad_token_id == tok.eos_token_id:
        what = "no pad token" if tok.pad_token_id is None else f"pad == EOS ({tok.eos_token!r})"
        raise RlhfError(f"tokenizer at {path} has {what}, so padding and the end of a "
                        "response cannot be told apart; set model.pad_token to another existing token, "
                        "e.g. model.pad_token='<|endoftext|>'")
    if tok.chat_template is None:
        from rlhf_cli.tiny import CHAT_TEMPLATE

        log.warning("tokenizer at %s has no chat template; using rlhf's ChatML template", path)
        tok.chat_template = CHAT_TEMPLATE
    tok.padding_side = "left"
    return tok


# --------------------------------------------------------------------------------------------------- models
def _abs(path) -> str:
    # adapters record their base by this string: an absolute path keeps them loadable from any directory
    p = Path(path).expanduser()
    return str(p.resolve()) if p.exists() else str(path)


def load_kwargs(model_cfg) -> dict:
    """from_pretrained options from the model config: remote code, and the attention kernel (null: the
    library's default, sdpa; e.g. flash_attention_2 on GPUs that have it, eager)."""
    if model_cfg is None:
        return {"trust_remote_code": False}
    kw = {"trust_remote_code": bool(model_cfg.trust_remote_code)}
    if model_cfg.get("attn_implementation"):
        kw["attn_implementation"] = str(model_cfg.attn_implementation)
    return kw


def _from_pretrained(auto_cls, path, model_cfg, **kw):
    """`auto_cls.from_pretrained` with the config's options; an attention kernel the library refuses is named
    by its key."""
    opts = load_kwargs(model_cfg)
    try:
        return auto_cls.from_pretrained(_abs(path), **kw, **opts)
    except (ValueError, ImportError) as e:
        if "attn_implementation" in opts and "attn_implementation" in str(e):
            raise RlhfError(f"model.attn_implementation={opts['attn_implementation']} cannot be used here "
                            f"({str(e).splitlines()[0][:160]}); use null (the library default), sdpa or eager") from e
        raise


def load_causal_lm(path, dtype: torch.dtype, model_cfg=None):
    from transformers import AutoModelForCausalLM

    return _from_pretrained(AutoModelForCausalLM, path, model_cfg, dtype=dtype)


def load_seq_cls(path, tokenizer, dtype: torch.dtype, model_cfg=None):
    """`AutoModelForSequenceClassification(num_labels=1)`: a reward or value model; pad id set so batched
    scores are read at the last non-pad token."""
    from transformers import AutoModelForSequenceClassification

    model = _from_pretrained(AutoModelForSequenceClassification, path, model_cfg, num_labels=1, dtype=dtype)
    model.config.pad_token_id = tokenizer.pad_token_id
    return model


def lora_config(lcfg, task_type: str):
    from peft import LoraConfig

    targets = lcfg.target_modules
    if not isinstance(targets, str):
        targets = list(targets)
    return LoraConfig(r=int(lcfg.r), lora_alpha=int(lcfg.alpha), lora_dropout=float(lcfg.dropout),
                      target_modules=targets, task_type=task_type)


def merge_lora(peft_model):
    """`merge_and_unload()` that is safe with tied input/output embeddings. A LoRA on the output layer
    (``lm_head``) of a model that ties it to the input embeddings would, merged in place, change the embeddings
    too; the output layer is untied first (its own copy of the weight, ``tie_word_embeddings=False``)."""
    base = peft_model.get_base_model()
    out, emb = base.get_output_embeddings(), base.get_input_embeddings()
    layer = getattr(out, "base_layer", None)
    if layer is not None and emb is not None and layer.weight is emb.weight:
        layer.weight = torch.nn.Parameter(layer.weight.detach().clone(), requires_grad=False)
        base.config.tie_word_embeddings = False
        text_cfg = base.config.get_text_config() if hasattr(base.config, "get_text_config") else None
        if text_cfg is not None:
            text_cfg.tie_word_embeddings = False
    return peft_model.merge_and_unload()


def same_vocab(tok_a, tok_b) -> bool:
    return tok_a.get_vocab() == tok_b.get_vocab()


def save_tokenizer_and_model(model, tokenizer, out_dir: Path) -> None:
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
