"""rlhf: a config-driven SFT -> reward model -> PPO pipeline for causal language models."""

__version__ = "0.1.0"
