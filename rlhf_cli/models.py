"""Tokenizer and model loading (policy, reward / value models, LoRA adapters on their base), LoRA wrapping and
merging, and the checks on what is loaded. Where a model comes from: rlhf_cli.sources; dtypes and the process's
torch setup: rlhf_cli.hardware."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import torch

from rlhf_cli.errors import RlhfError
from rlhf_cli.hardware import resolve_precision

log = logging.getLogger("rlhf")


# ------------------------------------------------------------------------------------------------ tokenizer
def load_tokenizer(path: str | Path, model_cfg=None, scoring: bool = False):
    """Tokenizer with a pad token distinct from EOS (so masks can tell padding from a real end) and a chat
    template; left padding for generation. `scoring=True`: the tokenizer of a reward model that reads texts
    rendered with its own template (`rlhf_cli.ppo.reward_model`): it never generates and its scores are read at
    an explicit position, so padding may be EOS (a published reward model's usual setting) and the policy's
    `model.pad_token` does not apply; long texts are cut from the left, keeping the end a score is read at."""
    from transformers import AutoTokenizer

    trust = bool(model_cfg.trust_remote_code) if model_cfg is not None else False
    tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust)
    if scoring:
        if tok.eos_token_id is None:
            raise RlhfError(f"the reward model's tokenizer at {path} has no EOS token; set eos_token in its "
                            "tokenizer_config.json")
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        _default_chat_template(tok, path)
        tok.padding_side, tok.truncation_side = "left", "left"
        return tok
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
    _default_chat_template(tok, path)
    tok.padding_side = "left"
    return tok


def _default_chat_template(tok, path) -> None:
    # one fallback for policies and reward models alike, so two copies of one template-less tokenizer stay the same
    if tok.chat_template is None:
        from rlhf_cli.tiny import CHAT_TEMPLATE

        log.warning("tokenizer at %s has no chat template; using rlhf's ChatML template", path)
        tok.chat_template = CHAT_TEMPLATE


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


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


def refuse_pickle(path) -> None:
    """Nothing is unpickled from disk: a local model directory with pickle weights and no safetensors is one line
    naming the file and how to convert it."""
    d = Path(str(path))
    if not d.is_dir() or any(d.glob("*.safetensors")):
        return
    pickled = sorted(f.name for f in d.iterdir() if f.suffix in PICKLE_SUFFIXES and "model" in f.name)
    if pickled:
        raise RlhfError(f"{d / pickled[0]} holds pickle weights, which rlhf never loads (unpickling runs code); "
                        "convert the model to safetensors where you trust its source, e.g. load it in transformers "
                        "and save_pretrained(dir, safe_serialization=True)")


def quantization_config(run):
    """The one `BitsAndBytesConfig` of `model.quantization` of the run's settings (`run`: rlhf_cli.settings.of;
    None: none): 4bit = nf4, 8bit = LLM.int8(); the 4-bit blocks are dequantized for each matmul in the run's
    compute dtype (`device.mixed_precision`; fp32 without autocast). Which models load with it:
    rlhf_cli.quantization."""
    from rlhf_cli.quantization import mode

    q = mode(run.model)
    if q is None:
        return None
    from transformers import BitsAndBytesConfig

    if q == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    compute = resolve_precision(run)[1] or torch.float32
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute)


def _from_pretrained(auto_cls, path, model_cfg, quant=None, **kw):
    """`auto_cls.from_pretrained` with the config's options (`quant`: a `quantization_config`, None: plain
    weights); an attention kernel the library refuses is named by its key."""
    opts = load_kwargs(model_cfg)
    if quant is not None:
        opts["quantization_config"] = quant
    refuse_pickle(path)
    try:
        model = auto_cls.from_pretrained(_abs(path), **kw, **opts, use_safetensors=True)
    except (ValueError, ImportError) as e:
        if "attn_implementation" in opts and "attn_implementation" in str(e):
            raise RlhfError(f"model.attn_implementation={opts['attn_implementation']} cannot be used here "
                            f"({str(e).splitlines()[0][:160]}); use null (the library default), sdpa or eager") from e
        raise
    except Exception as e:  # noqa: BLE001 - truncated / corrupt weight files: name the directory, not the parser
        if type(e).__name__ != "SafetensorError" and not isinstance(e, (OSError, EOFError)):
            raise
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise RlhfError(f"the model files in {path} cannot be read ({type(e).__name__}: {first}); they may be "
                        "truncated or corrupt: copy or download them again, or re-run the stage that wrote them") from e
    if getattr(quant, "load_in_4bit", False):
        _keep_the_trained_4bit_forward(model)
    return model


def _keep_the_trained_4bit_forward(model) -> None:
    """bitsandbytes' 4-bit layers on a CPU with AVX512-BF16 repack their weights for a faster inference kernel at
    their first forward in eval mode without gradients (the first sampled batch, the first evaluation) and from then
    on run every forward through it; it has no backward, so the gradient through the frozen weights (to every
    adapter below them) dropped out without an error, sampling ran another kernel than scoring, and a layer narrower
    than 64 inputs failed with a shape error. Every layer here keeps the dequantize-and-matmul forward that trains,
    on every CPU (bitsandbytes 0.50 reads `support_avx512bf16_for_cpu` at each forward)."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


KINDS = {"causal_lm": "causal language model (a policy)", "seq_cls": "sequence classifier (a reward or value model)"}


def model_kind(path) -> str | None:
    """"causal_lm" or "seq_cls" by the architectures in a local model directory's config.json; None where it does
    not say (no config.json, a hub id not yet downloaded, another head)."""
    config = Path(str(path)) / "config.json"
    if not config.is_file():
        return None
    from rlhf_cli.io import read_json

    try:
        archs = [str(a) for a in (read_json(config).get("architectures") or [])]
    except (RlhfError, AttributeError):
        return None
    if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        return "causal_lm"
    if any(a.endswith("ForSequenceClassification") for a in archs):
        return "seq_cls"
    return None


def expect_kind(path, want: str, fix: str) -> None:
    """A model directory of the other kind is an error naming it, what it holds, and what makes the right one."""
    kind = model_kind(path)
    if kind is not None and kind != want:
        raise RlhfError(f"{path} holds a {KINDS[kind]}, not a {KINDS[want]}; {fix}")


def load_causal_lm(path, dtype: torch.dtype, model_cfg=None, quant=None):
    """`quant`: frozen decoder weights quantized (`quantization_config`); everything else in `dtype`."""
    from transformers import AutoModelForCausalLM

    expect_kind(path, "causal_lm", "point at a base model or at the output of rlhf sft / rlhf ppo")
    return _from_pretrained(AutoModelForCausalLM, path, model_cfg, quant, dtype=dtype)


def load_seq_cls(path, tokenizer, dtype: torch.dtype, model_cfg=None, trained_head: bool = False, quant=None):
    """`AutoModelForSequenceClassification(num_labels=1)`: a reward or value model; pad id set so batched
    scores are read at the last non-pad token. `trained_head`: the model must already be a sequence classifier
    (a reward model scores with its head; a causal LM would get a random one). `quant`: as load_causal_lm's
    (the score head stays in `dtype`)."""
    from transformers import AutoModelForSequenceClassification

    if trained_head:
        expect_kind(path, "seq_cls", "a reward model comes from rlhf reward")
    model = _from_pretrained(AutoModelForSequenceClassification, path, model_cfg, quant, num_labels=1, dtype=dtype)
    model.config.pad_token_id = tokenizer.pad_token_id
    return model


def lora_config(lcfg, task_type: str, model=None, key: str = "lora"):
    """peft's LoraConfig from a `<stage>.lora` group. With `model`, each `modules_to_save` name must name one of
    its layers (peft skips an unknown one without a word): else one line naming `<key>.modules_to_save`."""
    from peft import LoraConfig

    targets = lcfg.target_modules
    if not isinstance(targets, str):
        targets = list(targets)
    saved = lcfg.get("modules_to_save")
    saved = [saved] if isinstance(saved, str) else list(saved) if saved else None
    if saved and model is not None:
        layers = [name for name, _ in model.named_modules()]
        unknown = [s for s in saved if not any(n == s or n.endswith("." + s) for n in layers)]
        if unknown:
            raise RlhfError(f"{key}.modules_to_save: {', '.join(unknown)} names no layer of the model; use layer "
                            "names such as lm_head or embed_tokens, or null")
    return LoraConfig(r=int(lcfg.r), lora_alpha=int(lcfg.alpha), lora_dropout=float(lcfg.get("dropout", 0.0)),
                      target_modules=targets, task_type=task_type, modules_to_save=saved,
                      ensure_weight_tying=bool(saved))


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


def merge_unquantized(peft_model, base_path, dtype: torch.dtype, model_cfg=None):
    """The LoRA adapter of `peft_model` (trained on a quantized base) merged into its base at `base_path` loaded
    unquantized in `dtype`: a plain model that loads with stock transformers. It differs from the trained
    function by the base's quantization error (the adapter learned against the quantized weights), as QLoRA
    merges do; a 4-bit base would round the merged weights back to 4 bits instead."""
    from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

    config = copy.deepcopy(peft_model.peft_config["default"])
    config.base_model_name_or_path = _abs(base_path)
    plain = get_peft_model(load_causal_lm(base_path, dtype, model_cfg), config)
    set_peft_model_state_dict(plain, {k: v.to(dtype) for k, v in get_peft_model_state_dict(peft_model).items()})
    return merge_lora(plain)


def same_vocab(tok_a, tok_b) -> bool:
    return tok_a.get_vocab() == tok_b.get_vocab()


def same_tokenizer(tok_a, tok_b) -> bool:
    """The same token ids, chat template and EOS: a model of one reads the other's token ids as they are."""
    return same_vocab(tok_a, tok_b) and tok_a.chat_template == tok_b.chat_template \
        and tok_a.eos_token == tok_b.eos_token


def check_vocab(tok, model, where) -> int:
    """The tokenizer must fit the model's embedding (ids past it would index nothing); rows past the tokenizer
    are allowed (real Qwen3: 151,669 tokens, 151,936 rows) and are never sampled. Returns the tokenizer size."""
    n_tok = len(tok)
    emb = model.get_input_embeddings()
    rows = emb.weight.shape[0] if emb is not None else n_tok
    if n_tok > rows:
        raise RlhfError(f"the tokenizer at {where} has {n_tok} tokens but the model's embedding has {rows} rows; "
                        "use the tokenizer the model was trained with (or resize the model's embeddings)")
    return n_tok


def check_finite(model, what: str, where) -> None:
    """Refuse a model with NaN/inf weights (e.g. written by a run whose learning rate was far too high)."""
    for name, p in model.named_parameters():
        # a float32 sum is finite for finite weights (short of overflow, which the exact check then settles) and
        # several times cheaper than isfinite() on bf16 tensors. Chunk by chunk: a bf16 tensor summed in float32
        # is first copied whole in float32 (an 8B model's embedding: 2.3 GiB more at its peak)
        for chunk in p.detach().reshape(-1).split(FINITE_CHUNK):
            if not bool(torch.isfinite(chunk.sum(dtype=torch.float32))) and not bool(torch.isfinite(chunk).all()):
                raise RlhfError(f"{what} at {where} has non-finite weights ({name}); it came from a diverged run: "
                                "retrain it with a lower learning rate")


FINITE_CHUNK = 1 << 24  # elements per step of check_finite: 64 MiB in float32


def fp32_trainables(model) -> None:
    """Trainable parameters in fp32 (master weights for AdamW; bf16 would round small updates to nothing),
    frozen ones left in their storage dtype."""
    for p in model.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()


def _adapter_base(path: Path, fallback) -> Path:
    """The base of an adapter directory: the one rlhf recorded relative to it (adapter_base.json: follows a copied
    or moved run; `rlhf_cli.ppo.checkpoint.save_model`), else peft's `base_model_name_or_path`, else `fallback`."""
    from rlhf_cli.io import read_json

    recorded = read_json(path / "adapter_config.json").get("base_model_name_or_path")
    cands = [recorded, fallback]
    if recorded and not Path(recorded).expanduser().is_absolute():  # a relative one, as earlier versions wrote
        cands.insert(0, Path(path).resolve() / recorded)
    if (path / "adapter_base.json").is_file():
        cands.insert(0, Path(path).resolve() / str(read_json(path / "adapter_base.json").get("relative", "")))
    for cand in cands:
        if cand and Path(cand).expanduser().is_dir() and str(cand) != str(Path(path).resolve() / ""):
            return Path(cand).expanduser().resolve()
    raise RlhfError(f"the base model of the adapter at {path} is not found (recorded: {recorded}, configured: "
                    f"{fallback}); set ppo.policy_dir to the SFT model it was trained on")


def check_adapter_base(adapter: Path, base: Path, model_cfg=None) -> None:
    """The adapter at `adapter` was trained on the content `base` holds now (the identity its adapter_base.json
    records, `rlhf_cli.identity`), unless `model.adapter_base_check=false`; an adapter that records none (an older
    rlhf, or another tool) is not checked."""
    from rlhf_cli.identity import identity
    from rlhf_cli.io import read_json

    if model_cfg is not None and not model_cfg.get("adapter_base_check", True):
        return
    try:
        recorded = read_json(adapter / "adapter_base.json").get("identity")
    except (OSError, ValueError, AttributeError):
        return
    now = identity(base)
    if recorded and now and recorded != now:
        raise RlhfError(f"the adapter at {adapter} was trained on a base of content {recorded}, but {base} now holds "
                        f"{now} (retrained since?); retrain the adapter on it, point the config at the base it was "
                        "trained on, or set model.adapter_base_check=false to load it anyway")


def load_policy(path, dtype: torch.dtype, model_cfg=None, base_dir=None, merge: bool = False, check: bool = True,
                quant=None):
    """The one way to load a policy: a plain model directory, or a LoRA adapter on top of its base (the base
    it records, a relative one read against the adapter's directory, else `base_dir`: `_adapter_base`). An SFT
    adapter used as a base is merged first, so that "adapter disabled" is exactly the SFT policy. merge=True
    returns a plain model (tied output layers handled). `quant`: the plain model (or the adapter's base) stored
    quantized (`quantization_config`), as PPO and eval run a QLoRA policy; rlhf export merges without it."""
    path = Path(path)
    if not (path / "adapter_config.json").exists():
        if not (path / "config.json").exists():
            raise RlhfError(f"{path} holds no model (config.json or adapter_config.json); point the config at "
                            "an `rlhf sft` or `rlhf ppo` output")
        model = load_causal_lm(path, dtype, model_cfg, quant)
    else:
        from peft import PeftModel

        base_path = _adapter_base(path, base_dir)
        check_adapter_base(path, base_path, model_cfg)
        base = load_policy(base_path, dtype, model_cfg, merge=True, check=False, quant=quant)
        model = PeftModel.from_pretrained(base, str(path))
        if merge:
            model = merge_lora(model)
    if check:
        check_finite(model, "the policy", path)
    return model
