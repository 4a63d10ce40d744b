"""Benchmark workloads shared by both sides of the PPO speed comparison.

Runs in either virtual environment: it needs only torch, transformers and tokenizers.

    python bench/workload.py tiny bench/work/tiny
    python bench/workload.py small bench/work/small
    python bench/workload.py real bench/work/real     # Qwen3-0.6B's exact shape, random weights (~2.5 GB)

Sizes: tiny (hidden 64, 2 layers), mini (128, 4), mid (256, 4), small (512, 6) share one 1,500-token tokenizer
and 8-24-token plain-text prompts. `real` is Qwen3-0.6B's architecture (vocabulary rows 151,936, hidden 1024,
28 layers, 16 heads, 8 kv heads, head_dim 128, intermediate 3072, tied embeddings) with a tokenizer laid out
like Qwen3's (151,669 ids: a BPE trained here, filler tokens up to id 151,642, then Qwen3's 26 special tokens at
their ids, so eos <|im_end|> = 151645 and pad <|endoftext|> = 151643) and chat-templated prompts of 30-60
tokens (Qwen3's ChatML with a system turn and the empty think block of enable_thinking=false). Its weights are
stored in bf16, as the released checkpoint is.

Layout written into OUT_DIR:

    tokenizer/       byte-level BPE tokenizer (AutoTokenizer.from_pretrained), left padding,
                     eos <|im_end|>, pad <|pad|>, bos <|endoftext|>, no chat template
    policy/          random-init Qwen3ForCausalLM (seed 0), tied embeddings
    reward/          random-init Qwen3ForSequenceClassification, num_labels=1 (seed 1), pad_token_id set
    prompts.jsonl    one {"prompt": str, "n_tokens": int} per line, 8-24 tokens each, plain text
    workload.json    manifest: name, model shape, vocab size, special token ids, prompt count
    .done            written last; its presence means the directory is complete

Everything is deterministic: the same name always gives the same files.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
VOCAB_SIZE = 1500
N_PROMPTS = 768
PROMPT_MIN_TOKENS = 8
PROMPT_MAX_TOKENS = 24
FORMAT_VERSION = 1

SHAPES = {
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
    ),
    "mini": dict(
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=384,
    ),
    "mid": dict(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=768,
    ),
    "small": dict(
        hidden_size=512,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=1536,
    ),
    # between mid and small (a size no rule in rlhf_cli was measured on when it was added)
    "midsmall": dict(
        hidden_size=384,
        num_hidden_layers=5,
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=64,
        intermediate_size=1152,
    ),
}

# Qwen3-0.6B (config.json of the released model); `real` builds this shape with random weights.
REAL_SHAPE = dict(
    hidden_size=1024,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=3072,
)
REAL_ROWS = 151936            # embedding / LM-head rows
REAL_FIRST_SPECIAL = 151643   # Qwen3's tokenizer: regular ids below, its 26 special tokens from here
REAL_SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>",
]
REAL_PROMPT_TOKENS = (30, 60)
REAL_TRAINED_VOCAB = 4000     # BPE merges learnt from the corpus (it runs out of pairs near here)
REAL_SYSTEM = "You are a helpful assistant."
ALL_NAMES = sorted([*SHAPES, "real"])

# ---------------------------------------------------------------------------------------------
# Deterministic text generation
# ---------------------------------------------------------------------------------------------

_WORDS = (
    "the a an of to in on for with about from at by and or but not very more most some any "
    "every each this that these those my your our their his her its we you they i he she it "
    "is are was were be been have has had do does did can could will would should may might "
    "please tell me explain describe write give show help make find list suggest compare "
    "summarize translate answer question story poem letter email note recipe plan idea "
    "weather city river mountain forest garden ocean island village market school library "
    "computer program language music painting movie book game sport team friend family "
    "morning evening night day week month year spring summer autumn winter time place "
    "good bad happy sad quick slow big small old new young bright dark warm cold quiet loud "
    "simple short long clear polite kind rude friendly helpful careful strange famous "
    "how why what when where which who whose thank thanks sorry hello goodbye yes no "
    "cat dog bird fish horse tree flower stone water fire air light sound color word "
    "learn teach read speak listen think know feel want need like love hate try keep start"
).split()

_SYLLABLES = (
    "ka ki ku ke ko sa si su se so ta ti tu te to na ni nu ne no ma mi mu me mo ra ri ru re "
    "ro la li lu le lo ba bi bu be bo da di du de do ga gi gu ge go pa pi pu pe po va vi vu "
    "ve vo za zi zu ze zo tha thi sha shi cha chi str bl gr pl tr an en in on un ar er ir or"
).split()

_PROMPT_TEMPLATES = [
    "Please tell me about the {adj} {noun}.",
    "Can you explain why the {noun} is so {adj}?",
    "Write a short {kind} about a {adj} {noun} in the {place}.",
    "What do you think of {name} and the {noun}?",
    "Describe a {adj} {place} in {season}.",
    "How can I make my {noun} more {adj}?",
    "Give me three ideas for a {adj} {kind}.",
    "Why would {name} want a {adj} {noun} at {time}?",
    "Suggest a polite reply to {name} about the {noun}.",
    "Summarize the {kind} about {name} and the {adj} {place}.",
    "Is it true that every {noun} in the {place} is {adj}?",
    "Help me write a {adj} note to {name}.",
    "My friend {name} lives near the {adj} {place}; what should we do there on a {season} {time}?",
    "Compare the {adj} {noun} with the old {noun2} and tell me which one {name} would like more, and why.",
]


def _rng(seed: int) -> random.Random:
    return random.Random(seed)


def _make_names(rng: random.Random, n: int) -> list[str]:
    names = []
    for _ in range(n):
        k = rng.randint(2, 4)
        w = "".join(rng.choice(_SYLLABLES) for _ in range(k))
        names.append(w.capitalize())
    return names


def _make_pseudo_words(rng: random.Random, n: int) -> list[str]:
    return ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(n)]


def _corpus(seed: int = 1234) -> list[str]:
    """A few thousand lines of mixed English-like and pseudo-word text (enough pairs for ~1500 merges)."""
    rng = _rng(seed)
    names = _make_names(rng, 300)
    pseudo = _make_pseudo_words(rng, 1200)
    lines = []
    for i in range(6000):
        n = rng.randint(4, 16)
        toks = []
        for _ in range(n):
            r = rng.random()
            if r < 0.60:
                toks.append(rng.choice(_WORDS))
            elif r < 0.85:
                toks.append(rng.choice(pseudo))
            elif r < 0.95:
                toks.append(rng.choice(names))
            else:
                toks.append(str(rng.randint(0, 2025)))
        line = " ".join(toks)
        line = line[0].upper() + line[1:] + rng.choice([".", "?", "!", ","])
        lines.append(line)
    lines.extend(_prompt_candidates(seed + 1, 2000))
    return lines


def _prompt_candidates(seed: int, n: int) -> list[str]:
    rng = _rng(seed)
    names = _make_names(_rng(seed + 7), 120)
    adjs = ("good bad happy sad quick slow big small old new young bright dark warm cold quiet loud simple short long "
            "clear polite kind rude friendly helpful careful strange famous").split()
    nouns = ("weather city river mountain forest garden ocean island village market school library computer program "
             "language music painting movie book game team friend family cat dog bird fish horse tree flower "
             "stone").split()
    kinds = "story poem letter email note recipe plan song speech joke".split()
    places = "city river mountain forest garden ocean island village market school library park kitchen office".split()
    seasons = "spring summer autumn winter".split()
    times = "morning evening night noon midnight dawn".split()
    out = []
    for _ in range(n):
        t = rng.choice(_PROMPT_TEMPLATES)
        out.append(
            t.format(
                adj=rng.choice(adjs),
                noun=rng.choice(nouns),
                noun2=rng.choice(nouns),
                kind=rng.choice(kinds),
                place=rng.choice(places),
                season=rng.choice(seasons),
                time=rng.choice(times),
                name=rng.choice(names),
            )
        )
    return out


# ---------------------------------------------------------------------------------------------
# Builders
# ---------------------------------------------------------------------------------------------


def build_tokenizer(out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|im_start|>"],
        padding_side="left",
        model_max_length=512,
    )
    fast.save_pretrained(str(out))
    return fast


def _config(name: str, tok, num_labels: int | None = None):
    from transformers import Qwen3Config

    kw = dict(SHAPES[name])
    cfg = Qwen3Config(
        vocab_size=len(tok),
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **kw,
    )
    if num_labels is not None:
        cfg.num_labels = num_labels
    return cfg


def _set_generation_ids(model, tok) -> None:
    gen = model.generation_config
    gen.pad_token_id = tok.pad_token_id
    gen.eos_token_id = tok.eos_token_id
    gen.bos_token_id = tok.bos_token_id


def build_policy(name: str, tok, out: Path) -> int:
    import torch
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(_config(name, tok))
    _set_generation_ids(model, tok)
    model.save_pretrained(str(out))
    return sum(p.numel() for p in model.parameters())


def build_reward(name: str, tok, out: Path) -> int:
    import torch
    from transformers import Qwen3ForSequenceClassification

    torch.manual_seed(1)
    model = Qwen3ForSequenceClassification(_config(name, tok, num_labels=1))
    model.config.pad_token_id = tok.pad_token_id
    model.save_pretrained(str(out))
    return sum(p.numel() for p in model.parameters())


def build_prompts(tok, out: Path) -> int:
    seen = set()
    rows = []
    for text in _prompt_candidates(seed=4242, n=20000):
        if text in seen:
            continue
        seen.add(text)
        n = len(tok(text, add_special_tokens=False)["input_ids"])
        if PROMPT_MIN_TOKENS <= n <= PROMPT_MAX_TOKENS:
            rows.append({"prompt": text, "n_tokens": n})
        if len(rows) >= N_PROMPTS:
            break
    if len(rows) < 512:
        raise RuntimeError(f"only {len(rows)} prompts within {PROMPT_MIN_TOKENS}-{PROMPT_MAX_TOKENS} tokens")
    with open(out, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return len(rows)


# ---------------------------------------------------------------------------------------------
# real: Qwen3-0.6B's shape and tokenizer layout
# ---------------------------------------------------------------------------------------------


def _filler(i: int) -> str:
    """The i-th filler token: a space and lower-case letters (byte-level BPE spells the space "Ġ"), so it decodes
    to ordinary text; no merge produces it, so encoding never emits it."""
    letters = ""
    i += 1
    while i:
        i, r = divmod(i - 1, 26)
        letters = chr(97 + r) + letters
    return "Ġzq" + letters


def build_real_tokenizer(out: Path):
    """A tokenizer with Qwen3's id layout: BPE trained on the corpus, fillers up to id 151642, then the 26 special
    tokens at Qwen3's ids (151643-151668): 151,669 tokens for 151,936 embedding rows, as in the released model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=REAL_TRAINED_VOCAB, min_frequency=1, special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    # the chat template's words and blank lines as Qwen3's tokenizer has them: one token each
    tok.train_from_iterator(_corpus() + [REAL_SYSTEM, "system", "user", "assistant", "\n\n"] * 50, trainer=trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    i = 0
    while len(vocab) < REAL_FIRST_SPECIAL:
        f = _filler(i)
        i += 1
        if f not in vocab:
            vocab[f] = len(vocab)
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.add_special_tokens(REAL_SPECIALS)
    if tok.token_to_id("<|endoftext|>") != REAL_FIRST_SPECIAL or tok.get_vocab_size() != REAL_FIRST_SPECIAL + 26:
        raise RuntimeError("real tokenizer: special tokens are not at Qwen3's ids")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   padding_side="left", model_max_length=40960)
    fast.save_pretrained(str(out))
    return fast


def _real_config(tok, num_labels: int | None = None):
    from transformers import Qwen3Config

    cfg = Qwen3Config(vocab_size=REAL_ROWS, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                      tie_word_embeddings=True, bos_token_id=REAL_FIRST_SPECIAL, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, **REAL_SHAPE)
    if num_labels is not None:
        cfg.num_labels = num_labels
    return cfg


def build_real_model(tok, out: Path, seq_cls: bool) -> int:
    """Random-init policy (seed 0) or reward model (seed 1) of Qwen3-0.6B's shape, saved in bf16."""
    import torch
    from transformers import Qwen3ForCausalLM, Qwen3ForSequenceClassification

    torch.manual_seed(1 if seq_cls else 0)
    if seq_cls:
        model = Qwen3ForSequenceClassification(_real_config(tok, num_labels=1))
    else:
        model = Qwen3ForCausalLM(_real_config(tok))
        _set_generation_ids(model, tok)
        model.generation_config.bos_token_id = REAL_FIRST_SPECIAL
    n = sum(p.numel() for p in model.parameters())
    model.to(torch.bfloat16).save_pretrained(str(out))
    return n


def real_prompt(question: str) -> str:
    """Qwen3's chat template for one user turn after a system turn, generation prompt with enable_thinking=false."""
    return (f"<|im_start|>system\n{REAL_SYSTEM}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def build_real_prompts(tok, out: Path) -> int:
    """Chat-templated prompts of 30-60 tokens: one or two questions in the user turn."""
    rng = _rng(77)
    pool = _prompt_candidates(seed=4343, n=6000)
    seen, rows = set(), []
    lo, hi = REAL_PROMPT_TOKENS
    for q in pool:
        question = q if rng.random() < 0.5 else f"{q} {rng.choice(pool)}"
        if question in seen:
            continue
        seen.add(question)
        text = real_prompt(question)
        n = len(tok(text, add_special_tokens=False)["input_ids"])
        if lo <= n <= hi:
            rows.append({"prompt": text, "n_tokens": n})
        if len(rows) >= N_PROMPTS:
            break
    if len(rows) < 512:
        raise RuntimeError(f"only {len(rows)} chat prompts within {lo}-{hi} tokens")
    with open(out, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return len(rows)


def build(name: str, out_dir: str | os.PathLike, force: bool = False) -> Path:
    """Build workload `name` (see ALL_NAMES) into out_dir; a complete directory is left as it is."""
    if name not in ALL_NAMES:
        raise ValueError(f"unknown workload {name!r}; choose from {ALL_NAMES}")
    out = Path(out_dir)
    done = out / ".done"
    if done.exists() and not force:
        try:
            meta = json.loads((out / "workload.json").read_text())
            if meta.get("name") == name and meta.get("format_version") == FORMAT_VERSION:
                return out
        except (OSError, ValueError):
            pass
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)

    if name == "real":
        tok = build_real_tokenizer(out / "tokenizer")
        n_policy = build_real_model(tok, out / "policy", seq_cls=False)
        n_reward = build_real_model(tok, out / "reward", seq_cls=True)
        n_prompts = build_real_prompts(tok, out / "prompts.jsonl")
    else:
        tok = build_tokenizer(out / "tokenizer")
        n_policy = build_policy(name, tok, out / "policy")
        n_reward = build_reward(name, tok, out / "reward")
        n_prompts = build_prompts(tok, out / "prompts.jsonl")
    real = name == "real"
    meta = {
        "name": name,
        "format_version": FORMAT_VERSION,
        "shape": REAL_SHAPE if real else SHAPES[name],
        "tie_word_embeddings": True,
        "vocab_size": len(tok),  # the tokenizer's ids
        "embedding_rows": REAL_ROWS if real else len(tok),
        "weights_dtype": "bfloat16" if real else "float32",
        "special_tokens": {
            "bos": [tok.bos_token, tok.bos_token_id],  # None for real (Qwen3 has no bos token)
            "eos": [tok.eos_token, tok.eos_token_id],
            "pad": [tok.pad_token, tok.pad_token_id],
            "im_start": ["<|im_start|>", tok.convert_tokens_to_ids("<|im_start|>")],
        },
        "padding_side": tok.padding_side,
        "policy_params": n_policy,
        "reward_params": n_reward,
        "policy_seed": 0,
        "reward_seed": 1,
        "n_prompts": n_prompts,
        "prompt_tokens": list(REAL_PROMPT_TOKENS) if real else [PROMPT_MIN_TOKENS, PROMPT_MAX_TOKENS],
        "prompt_format": "Qwen3 chat template (system + user, empty think block)" if real else "plain text",
        "layout": {
            "tokenizer": "tokenizer/",
            "policy": "policy/",
            "reward": "reward/",
            "prompts": "prompts.jsonl",
        },
    }
    (out / "workload.json").write_text(json.dumps(meta, indent=2) + "\n")
    done.write_text("ok\n")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Build a PPO benchmark workload (tokenizer, policy, reward, prompts).")
    p.add_argument("name", choices=ALL_NAMES)
    p.add_argument("out_dir")
    p.add_argument("--force", action="store_true", help="rebuild even if the directory is complete")
    a = p.parse_args(argv)
    out = build(a.name, a.out_dir, force=a.force)
    meta = json.loads((out / "workload.json").read_text())
    print(
        f"{a.name}: {out} vocab={meta['vocab_size']} policy_params={meta['policy_params']} "
        f"reward_params={meta['reward_params']} prompts={meta['n_prompts']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
