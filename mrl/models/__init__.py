"""Model helpers: tiny random-weight HF models and tokenizers for tests and the CPU demo."""

from mrl.models.tiny import FAMILIES, build_tiny_hf_model, make_tiny_hf_model, tiny_hf_config, train_tiny_tokenizer

__all__ = ["FAMILIES", "build_tiny_hf_model", "make_tiny_hf_model", "tiny_hf_config", "train_tiny_tokenizer"]
