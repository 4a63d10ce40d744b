"""Memory plan of a recipe: bytes per process for each training stage, from the model's config values.

Pure Python (no torch): `rlhf doctor` answers in seconds. Sizes are estimates of what each process holds at
its peak; every term is listed so that a plan can be checked by hand.

Parameters (Qwen3 / Llama-style decoder: RMSNorm, grouped-query attention, SwiGLU MLP)
    embeddings V·h; per layer q h·(n_h·d) + k, v h·(n_kv·d) each + o (n_h·d)·h + MLP 3·h·i + norms 2h (+ 2d
    q/k norms); final norm h; LM head V·h unless tied. The reward / value model is the same backbone with a
    1-output score head (h) instead of the LM head. LoRA adds r·(in + out) per adapted linear layer
    ("all-linear": q, k, v, o, gate, up, down; the LM head only when named, and never on a value model).

Precision (rlhf_cli.precision, the rule hardware.resolve_precision applies too)
    `model.dtype` (wb) stores FROZEN weights: the PPO policy's base (with its adapter disabled, also the
    reference), the reward model, a LoRA value model's trunk. `device.mixed_precision` (cb) is the compute
    dtype of activations and logits (autocast). Every TRAINABLE parameter is fp32 with fp32 gradients and
    AdamW states, 4 + 4 + 8 bytes, so a full fine-tune stores fp32 weights even when model.dtype is bf16;
    under autocast each training step also holds a cb copy of every trainable weight (cast once per forward,
    kept for its backward). DDP adds its communication buckets (4 bytes per trainable parameter). DeepSpeed
    runs the module in the compute dtype and keeps an fp32 master copy and fp32 states: cb + cb + 12 bytes.
    ZeRO-1/2 divide optimizer states (and ZeRO-2 the gradients) by the number of processes, ZeRO-3 and FSDP
    divide weights, gradients and states; offload moves states (and ZeRO-3 parameters) to CPU memory.
    `model.quantization` (rlhf_cli.quantization) stores the decoder's linear layers of the frozen models that
    are quantized (a LoRA policy's base, a LoRA value trunk, PPO's reward model) in nf4, 0.5 B + a 4 B absmax
    per 64 weights = 0.5625 B/weight, or int8, 1 B/weight + a 4 B scale per output row; their embeddings,
    norms and output layers stay in model.dtype.

Activations kept for the backward pass, per token per decoder layer, in bytes (q = n_h·d, kv = n_kv·d),
measured with saved-tensor hooks on the tiny shape (within 3% for fp32, bf16 autocast, full and LoRA):
    RMSNorm inputs (2 layer norms, per-head q/k norms): Qwen3's RMSNorm upcasts its input to fp32 and
      keeps that copy, whatever the compute dtype                                   4·(2h + q + kv)
    linear-layer inputs, for layers with a trained weight or a LoRA adapter: in fp32 compute one tensor
      per distinct input (2h + q + i); under autocast each adapted layer keeps its own cast copy (peft casts
      the input to the fp32 adapter, autocast casts it back: Σ in), and a full fine-tune's q/k/v and
      gate/up each cast the fp32 norm output (5h + q + i)                           × cb
    attention: rotated q, k and v repeated to every head (transformers' SDPA path repeats them when there
      is a padding mask), output: 4q; under autocast also the mask, cast per layer: T  × cb
    MLP: gate, SiLU(gate), up (their product is the down projection's input): 3i  × cb
    trained norm weights (full fine-tune): the normalised tensors, 2h in the residual stream's dtype
      (fp32 trainable weights: 4) and q + kv at cb
    LoRA: each adapter's A output, r per adapted layer                              × cb
    SDPA kernels keep no T×T score matrix. With activation checkpointing only each layer's input (h, in the
    residual stream's dtype) is kept, plus one layer's full set during recomputation. Times micro-batch ×
    sequence length × layers.
Logits. SFT (trl's fused LM head): tiles of at most 4096 tokens × 32768 vocabulary entries at cb, never the
whole (B, T, V) tensor (fused_head_bytes). PPO: the LM head runs on the response positions only, at cb; a
training step runs the policy (activations, logits, and the fp32 log-softmax and entropy temporaries while
`ppo.core.logprobs_and_entropy` runs: logit_temporaries, measured) and its backward before the value model, so
its peak is the larger of the two.
Generation (PPO rollout, no gradients) of F sequences of S = prompt + response tokens
    sampling: KV cache 2·L·n_kv·d·F·S at cb, one step's (F, V) logits with their fp32 temporaries (cb + 32 B
    each: the sampling loop's log-softmax, probabilities, entropy and float64 CDF of the draw; generate()'s fp32
    copy, the step kept until its token is drawn and its log-softmax, softmax and entropy product; no engine keeps
    the logits of earlier steps: ppo.sampling.StepStats), and with a LoRA policy the
    merged copy (W + B·A, in model.dtype) of each adapted weight that sampling runs on; scoring: the
    reference's (F, R, V) logits with the log-sum-exp temporaries (cb + 8), or, when the old log-probs are
    recomputed (`ppo.recompute_logprobs`), the log-softmax and entropy temporaries (logit_temporaries), and
    one layer's working set.

Sequence lengths: every batch is padded to its longest row, so a stage's peak follows the longest row it
meets. `rlhf doctor` tokenizes the training data with the model's tokenizer when both are on this machine
(`Lengths`); otherwise the plan takes the configured maxima (data.max_prompt_length, <stage>.max_length).

Runtime overhead (measured, see RUNTIME_OVERHEAD_MIB and ALLOCATOR_SLACK): on the CPU, the anonymous memory a
stage allocates besides tensors (library objects created on first use, tokenizer, data, thread pools) and
glibc's habit of keeping freed large blocks (peak RSS ≈ 2 × the training loop's transient tensors; an evaluation
that needs more adds its excess once); on a GPU the CUDA context and the caching allocator. The pages of mapped
library files are left out: how many of them are resident depends on the page cache (a freshly installed
environment maps more of each file), not on the run.
"""

# The planner's public names, for `rlhf doctor` (rlhf_cli.stages.doctor), the tests and bench/; the package's
# modules: arch (shapes and counts), plan (setups, items, the sft / reward / dpo planners), ppo_plan, advice
from rlhf_cli.memory.advice import PLANNERS, fmt_bytes, format_plan, plan_stage, remedies
from rlhf_cli.memory.arch import (
    KNOWN_ARCHS,
    LORA_TARGETS,
    Arch,
    GiB,
    MiB,
    activation_bytes_per_token_layer,
    arch_for_model,
    arch_from_config,
    cached_model_dirs,
    causal_lm_params,
    layer_working_bytes,
    lora_params,
    quantized_linears,
    seq_cls_params,
)
from rlhf_cli.memory.plan import RUNTIME_OVERHEAD_MIB, Lengths, Setup, StagePlan, setup_from

__all__ = ["KNOWN_ARCHS", "LORA_TARGETS", "PLANNERS", "RUNTIME_OVERHEAD_MIB", "Arch", "GiB", "Lengths", "MiB", "Setup",
           "StagePlan", "activation_bytes_per_token_layer", "arch_for_model", "arch_from_config", "cached_model_dirs",
           "causal_lm_params", "fmt_bytes", "format_plan", "layer_working_bytes", "lora_params", "plan_stage",
           "quantized_linears", "remedies", "seq_cls_params", "setup_from"]
