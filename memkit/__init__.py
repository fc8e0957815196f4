"""memkit: predict, plan and emit memory-fitting training configs for Hugging Face models."""

__version__ = "0.1.0"
