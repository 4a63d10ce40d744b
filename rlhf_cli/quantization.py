"""`model.quantization`: which weights bitsandbytes stores quantized, what a stage may do with them, and what
they weigh. Torch-free: the CLI's checks and the doctor (`rlhf_cli.memory`) import it; the models are loaded
with the `BitsAndBytesConfig` of `rlhf_cli.models.quantization_config`.

QLoRA (Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs"): a frozen base stored in 4-bit
NormalFloat (nf4, one fp32 absmax per block of 64 weights), dequantized block by block for each matmul at the
run's compute precision, with LoRA adapters trained in fp32 on top. 8bit: int8 weights with one fp32 scale per
output row (LLM.int8()). Only the frozen weights are quantized:
    the base of a LoRA policy (sft, dpo, ppo): with its adapter disabled it is also the reference;
    a LoRA value model's trunk (ppo.value_lora=true);
    the reward model where it is frozen (ppo, eval).
bitsandbytes quantizes the decoder's linear layers; the embeddings, the norms and the output layers (LM head,
score head) stay in model.dtype. A stage that trains every weight of its policy (sft / dpo / ppo with LoRA off)
is refused before anything loads: a quantized weight cannot be trained. `rlhf reward` trains its model whole,
in fp32 as with any model.dtype; the quantization applies where that model is frozen. Merging an adapter (sft's
output, `rlhf export`) loads its base unquantized, in the run's precision; `rlhf chat` loads that way too.
"""

from __future__ import annotations

import importlib.util

from rlhf_cli.errors import RlhfError

NF4_BLOCK = 64  # weights per fp32 absmax in bitsandbytes' 4-bit blocks (its default blocksize)
# bytes per weight of a quantized linear layer, and per output row (8bit's fp32 row scale)
BYTES_PER_WEIGHT = {"4bit": 0.5 + 4 / NF4_BLOCK, "8bit": 1.0}
BYTES_PER_ROW = {"4bit": 0.0, "8bit": 4.0}
# where each stage's LoRA switch is: a quantized policy trains through an adapter only
LORA_KEYS = {"sft": "sft.lora.enabled", "dpo": "dpo.lora.enabled", "ppo": "ppo.lora.enabled"}


def mode(model_cfg) -> str | None:
    """"4bit" / "8bit", or None for `model.quantization=none` (or a config without the key)."""
    q = str(model_cfg.get("quantization") or "none") if model_cfg is not None else "none"
    return None if q == "none" else q


def check(run) -> None:
    """Refuse, before any model loads, what a quantized run cannot do (`run`: the run's settings,
    rlhf_cli.settings.of): train every weight of the policy, shard bitsandbytes weights, or run without
    bitsandbytes installed."""
    q = mode(run.get("model"))
    command = str(run.get("command") or "")
    if q is None or command not in (*LORA_KEYS, "reward", "eval"):
        return
    key = LORA_KEYS.get(command)
    if key is not None and not bool(run[command].lora.enabled):
        raise RlhfError(f"model.quantization={q} stores frozen weights only, but {key}=false trains every weight "
                        f"of the policy; set {key}=true (QLoRA: a LoRA adapter on the {q} base) or "
                        "model.quantization=none")
    strategy = str(run.device.get("strategy") or "single")
    if strategy in ("fsdp", "deepspeed"):
        raise RlhfError(f"model.quantization={q} cannot be used with device.strategy={strategy} (bitsandbytes "
                        "weights are not sharded here); use one process or device=ddp, or model.quantization=none")
    if importlib.util.find_spec("bitsandbytes") is None:
        raise RlhfError(f"model.quantization={q} needs bitsandbytes, which is not installed; "
                        "pip install 'rlhf-cli[qlora]', or set model.quantization=none")


def linear_bytes(q: str, weights: float, rows: float) -> float:
    """Bytes of quantized linear layers holding `weights` weights in `rows` output rows."""
    return weights * BYTES_PER_WEIGHT[q] + rows * BYTES_PER_ROW[q]


def describe(q: str) -> str:
    """How a quantized weight is stored, for the doctor's notes."""
    if q == "4bit":
        return f"nf4: 0.5 B + a 4 B absmax per {NF4_BLOCK} = {BYTES_PER_WEIGHT[q]:g} B/weight"
    return "int8: 1 B/weight + a 4 B scale per output row"
