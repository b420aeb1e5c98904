"""Rollout generation: the Sampler protocol, its backends (hf, vllm) and the RolloutBatch type."""

from covrl.rollout.config import SamplerConfig, truncation_rule
from covrl.rollout.hf import HFSampler, filtered_logprobs, sample_from_logprobs  # registers "hf"
from covrl.rollout.protocol import Sampler
from covrl.rollout.registry import SAMPLER_BACKENDS, build_sampler
from covrl.rollout.text import decode_responses
from covrl.rollout.types import RolloutBatch, RolloutTiming, ScoredBatch, concat_batches

__all__ = ["SAMPLER_BACKENDS", "HFSampler", "RolloutBatch", "RolloutTiming", "Sampler", "ScoredBatch", "concat_batches", "SamplerConfig", "build_sampler",
           "decode_responses", "filtered_logprobs", "sample_from_logprobs", "truncation_rule"]
