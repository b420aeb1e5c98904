"""covrl.api: a small, stable Python API for training loops you write yourself (docs/api.md).

`TrainingClient` (forward / forward_backward / forward_backward_custom / optim_step / save_state / load_state /
save_weights_and_get_sampling_client) and `SamplingClient` (sample) over covrl's model, losses, rollout
correction, AdamW, samplers and checkpoints; `covrl.api.tinker` maps Tinker's SDK names onto them.
"""

from covrl.api.client import SamplingClient, TrainingClient, resolve_config
from covrl.api.losses import API_LOSSES, MATH_LOSSES, TINKER_LOSSES, ApiLoss, get_loss
from covrl.api.types import (
    AdamParams,
    ForwardBackwardResult,
    ForwardResult,
    OptimStepResult,
    SampledSequence,
    SampleResult,
    SamplingParams,
    StaleSamplingClientError,
    TrainBatch,
)

__all__ = ["API_LOSSES", "MATH_LOSSES", "TINKER_LOSSES", "AdamParams", "ApiLoss", "ForwardBackwardResult",
           "ForwardResult", "OptimStepResult", "SampleResult", "SampledSequence", "SamplingClient",
           "SamplingParams", "StaleSamplingClientError", "TrainBatch", "TrainingClient", "get_loss",
           "resolve_config"]
