"""grpokit: GRPO and its family for Hugging Face causal LMs."""
__version__ = "0.1.0"
