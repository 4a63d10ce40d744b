"""`rlhf chat`: a conversation from stdin (each answer sees the turns before it; `/reset` starts over; `exit`,
`quit`, `/exit` or `/quit` ends it), or `prompt="..."` once, with the newest trained policy (the PPO output if there is one, else the DPO output, else the
SFT model) or `chat.model_dir` (an adapter, PPO's or DPO's, is merged on load)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from rlhf_cli import devices, settings
from rlhf_cli.config import require_dir
from rlhf_cli.data import prompt_text
from rlhf_cli.errors import RlhfError
from rlhf_cli.hardware import resolve_precision, setup_torch
from rlhf_cli.models import load_policy, load_tokenizer
from rlhf_cli.stage_table import POLICIES

RESET = "/reset"
QUIT = ("exit", "quit", "/exit", "/quit")


def newest_policy(run) -> Path:
    """`chat.model_dir` of the run's settings (`run`: rlhf_cli.settings.of, or the composed config), or when unset
    the PPO output if it exists (it is trained from the SFT model), else the DPO output (trained from it too), else
    the SFT output."""
    if run.chat.model_dir is not None:
        return require_dir(run.chat.model_dir, "model to chat with (chat.model_dir)", "rlhf sft")
    for name in POLICIES:  # the stage table's order: ppo, dpo, sft
        if Path(getattr(run, name).output_dir).is_dir():
            return Path(getattr(run, name).output_dir)
    return require_dir(run.sft.output_dir, "model to chat with (the SFT output; chat.model_dir)", "rlhf sft")


def answer(model, tok, messages: list[dict], c, enable_thinking: bool = False) -> str:
    """The reply to the last turn of `messages`. Turns are dropped from the front (system prompt kept) while the
    conversation and the reply would not fit the model's positions; a last message alone too long is an error."""
    from transformers import GenerationConfig

    positions = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    # an answer budget as long as the model's positions would leave the prompt none (and skip the check): the
    # prompt keeps at least half of them, and the answer gets what is left
    reserve = min(int(c.max_new_tokens), positions // 2)
    limit = positions - reserve
    system = [m for m in messages[:1] if m["role"] == "system"]
    turns = messages[len(system):]
    while True:
        text = prompt_text(tok, [*system, *turns], enable_thinking)
        enc = tok(text, return_tensors="pt", add_special_tokens=False).to(model.device)
        n = enc["input_ids"].shape[1]
        if positions <= 0 or n <= limit:
            break
        if len(turns) <= 1:
            raise RlhfError(f"the message is {n} tokens with the chat template; this model reads at most {limit} "
                            f"before a {reserve}-token answer (chat.max_new_tokens={c.max_new_tokens}): shorten it")
        turns = turns[2:] if len(turns) > 2 else turns[-1:]  # the oldest question and its answer
    budget = int(c.max_new_tokens) if positions <= 0 else min(int(c.max_new_tokens), positions - n)
    gen = GenerationConfig(max_new_tokens=budget, do_sample=bool(c.do_sample),
                           temperature=float(c.temperature), top_k=int(c.top_k), top_p=float(c.top_p),
                           pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    with torch.no_grad():
        out = model.generate(**enc, generation_config=gen)
    return tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def run(cfg) -> None:
    typed = settings.of(cfg)
    setup_torch(typed)
    c = typed.chat
    path = newest_policy(typed)
    device = devices.of_accelerator(typed.device.accelerator)
    start = time.perf_counter()
    model = load_policy(path, resolve_precision(typed)[0], typed.model, base_dir=typed.ppo.policy_dir, merge=True)
    model, tok = model.to(device).eval(), load_tokenizer(path, typed.model)
    print(f"loaded {path} in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    system = [{"role": "system", "content": c.system_prompt}] if c.system_prompt else []
    thinking = bool(typed.model.enable_thinking)
    if c.prompt is not None:
        print(answer(model, tok, [*system, {"role": "user", "content": str(c.prompt)}], c, thinking))
        return
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"chatting with {path} (exit, an empty line or Ctrl-D to quit, {RESET} to start a new conversation)")
    history: list[dict] = []
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or (interactive and not line.strip()):
            break
        text = line.strip()
        if text.lower() in QUIT:
            break
        if text == RESET:
            history = []
            print("history cleared: a new conversation starts", file=sys.stderr, flush=True)
        elif text:
            turn = {"role": "user", "content": text}
            try:
                reply = answer(model, tok, [*system, *history, turn], c, thinking)
            except RlhfError as e:
                if not interactive:
                    raise
                print(f"error: {e}", flush=True)
                continue
            history += [turn, {"role": "assistant", "content": reply}]
            print(reply, flush=True)
