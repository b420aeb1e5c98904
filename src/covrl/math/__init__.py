"""covrl.math (layer 0): pure torch functions for RL of language models; no models, no I/O, no global state.

See docs/math.md for every formula and option name.
"""

from covrl.math._registry import reject_bool
from covrl.math._util import LOG_RATIO_CLAMP, clamped_log_ratio
from covrl.math.advantages import (
    ADVANTAGE_ESTIMATORS,
    ADVANTAGE_INPUTS,
    ADVANTAGE_SPECS,
    AdvantageBatch,
    AdvantageOutput,
    AdvantageSpec,
    advantage_metrics,
    compute_advantages,
    constant_groups,
    make_advantage_batch,
    variance_proxies,
)
from covrl.math.correction import (
    REJECTION_CRITERIA,
    CorrectionConfig,
    CorrectionOutput,
    correction_metrics,
    rollout_correction,
)
from covrl.math.entropy import ClipCovOutput, clip_cov_keep, token_covariance
from covrl.math.kl import KL_ESTIMATORS, kl_estimate
from covrl.math.logprobs import entropy_from_logits, logit_grad_proxy, sum_pi_squared, token_logprobs
from covrl.math.losses import (
    AGGREGATIONS,
    LOSS_INPUTS,
    LOSS_SPECS,
    POLICY_LOSSES,
    LossOutput,
    LossSpec,
    aggregate,
    policy_loss,
    score_centering_term,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS", "ADVANTAGE_INPUTS", "ADVANTAGE_SPECS", "AGGREGATIONS", "KL_ESTIMATORS", "LOG_RATIO_CLAMP",
    "LOSS_INPUTS",
    "LOSS_SPECS", "POLICY_LOSSES", "REJECTION_CRITERIA",
    "AdvantageBatch", "AdvantageOutput", "AdvantageSpec", "ClipCovOutput", "CorrectionConfig", "CorrectionOutput", "LossOutput",
    "LossSpec", "advantage_metrics", "aggregate", "clamped_log_ratio", "clip_cov_keep", "compute_advantages", "constant_groups", "correction_metrics",
    "entropy_from_logits", "kl_estimate", "logit_grad_proxy", "make_advantage_batch", "policy_loss",
    "reject_bool", "rollout_correction", "score_centering_term", "sum_pi_squared", "token_covariance", "token_logprobs", "variance_proxies",
]
