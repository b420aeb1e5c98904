"""`sampler:` section of a run (SamplerConfig) and the truncation rule it implies."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from covrl.math.truncation import TruncationRule
from covrl.models.compiled import CompileBackend
from covrl.rollout.registry import SAMPLER_BACKENDS, unknown_backend
from covrl.rollout.vllm import VLLM_EXTRA_HINT, VLLMEngineConfig, vllm_available
from covrl.settings import Section

__all__ = ["SamplerConfig", "truncation_rule"]


class SamplerConfig(Section):
    """How rollouts are generated."""

    backend: str = Field("hf", description="sampler backend registry name: hf (transformers, CPU/GPU), "
                         "vllm (a vLLM engine in this process or its own, sampler.vllm.engine_process; the vllm extra)")
    temperature: float = Field(1.0, gt=0.0, le=100.0, description="softmax temperature of the sampler")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus filter: keep the smallest set with mass >= p")
    top_k: int = Field(0, ge=0, description="keep only the k most likely tokens (0 = off)")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="keep the tokens with probability >= min_p x the most "
                         "likely one's (0 = off)")
    max_new_tokens: Annotated[int, Field(ge=1, le=65536)] | Literal["auto"] = Field(
        24, description="longest response in tokens; auto: sized by the run's probe before step 1 (sizing)")
    stop_strings: list[str] = Field(default_factory=list, description="a row also ends when its decoded response "
                                    "contains one of these (the tokens up to it are kept; hf sampler)")
    stop_token_ids: list[int] = Field(default_factory=list, description="token ids that end a row besides EOS "
                                      "(kept in the response, as EOS is)")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="sampler weights dtype; None = the trainer model's dtype")
    return_topk: int = Field(0, ge=0, le=1024, description="also return the sampler's top-k ids and log-probs "
                             "per token (score centring); 0 = off")
    max_batch: int = Field(64, ge=1, description="rows generated together (prompts x n are chunked)")
    sync_every: int = Field(1, ge=1, description="trainer steps between weight syncs into the sampler")
    share_weights: Literal["auto", "always", "never"] = Field(
        "auto", description="use the trainer's module directly (no copy): auto = when dtypes match and "
        "sync_every == 1; a separate copy is required for staleness (sync_every > 1) or another dtype")
    vllm: VLLMEngineConfig = Field(default_factory=VLLMEngineConfig,
                                   description="engine options (sampler.backend=vllm, or distill.engine=vllm's "
                                               "teacher; refused otherwise by the run's config)")
    compile: bool = Field(
        False, description="torch.compile of the hf sampler's decode step over a static KV cache (rows padded "
                           "to a power of two, cache length to a multiple of sampler.compile_bucket; finished rows "
                           "stay in the batch); the first batch of each shape pays the compile, reported as "
                           "timing.compile_s (docs/performance.md). sampler.backend=hf only")
    compile_backend: CompileBackend = Field(
        "inductor", description="torch.compile backend with sampler.compile: inductor (kernels; needs a C++ "
                                "compiler on CPU), aot_eager / eager (capture only, eager kernels: tests, debugging)")
    compile_bucket: int = Field(64, ge=1, le=65536, description="with sampler.compile, the static cache length "
                                "(longest prompt + max_new_tokens) is rounded up to a multiple of this, so that "
                                "prompt lengths in one bucket share a compiled graph")

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, v: str) -> str:
        # checked here so that a bad backend stops the run at config load, naming the file and line
        if v not in SAMPLER_BACKENDS:
            raise ValueError(unknown_backend(v))
        if v == "vllm" and not vllm_available():   # at config load, not after the model has loaded
            raise ValueError(VLLM_EXTRA_HINT)
        return v

    @model_validator(mode="after")
    def _compile_hf_only(self):
        if self.compile and self.backend != "hf":
            raise ValueError(f"sampler.compile=true compiles the hf sampler's decode loop; sampler.backend="
                             f"{self.backend!r} has its own (set sampler.compile=false)")
        return self


def truncation_rule(cfg: SamplerConfig) -> TruncationRule:
    """The sampler's top-k / top-p / min-p as covrl.math's rule (the definition the trainer replays)."""
    return TruncationRule(top_k=cfg.top_k, top_p=cfg.top_p, min_p=cfg.min_p)
