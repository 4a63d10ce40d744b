"""`rlhf chat`: answer prompts from stdin in a loop, or `prompt="..."` once, from an SFT directory or a PPO
output (its LoRA adapter is merged on load)."""

from __future__ import annotations

import sys

import torch

from rlhf_cli.config import require_dir
from rlhf_cli.data import prompt_text
from rlhf_cli.models import load_policy, load_tokenizer, resolve_precision, setup_torch


def answer(model, tok, messages: list[dict], c, enable_thinking: bool = False) -> str:
    from transformers import GenerationConfig

    text = prompt_text(tok, messages, enable_thinking)
    enc = tok(text, return_tensors="pt", add_special_tokens=False).to(model.device)
    gen = GenerationConfig(max_new_tokens=int(c.max_new_tokens), do_sample=bool(c.do_sample),
                           temperature=float(c.temperature), top_k=int(c.top_k), top_p=float(c.top_p),
                           pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    with torch.no_grad():
        out = model.generate(**enc, generation_config=gen)
    return tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def run(cfg) -> None:
    setup_torch(cfg)
    c = cfg.chat
    path = require_dir(c.model_dir, "model to chat with (chat.model_dir)", "rlhf sft")
    device = "cuda" if cfg.device.accelerator == "cuda" and torch.cuda.is_available() else "cpu"
    model = load_policy(path, resolve_precision(cfg)[0], cfg.model, base_dir=cfg.ppo.policy_dir, merge=True)
    model, tok = model.to(device).eval(), load_tokenizer(path, cfg.model)
    system = [{"role": "system", "content": c.system_prompt}] if c.system_prompt else []
    thinking = bool(cfg.model.enable_thinking)
    if c.prompt is not None:
        print(answer(model, tok, [*system, {"role": "user", "content": str(c.prompt)}], c, thinking))
        return
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"chatting with {path} (empty line or Ctrl-D to quit)")
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or (interactive and not line.strip()):
            break
        if line.strip():
            print(answer(model, tok, [*system, {"role": "user", "content": line.strip()}], c, thinking), flush=True)

