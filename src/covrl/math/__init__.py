"""covrl.math (layer 0): pure torch functions for RL of language models; no models, no I/O, no global state.

See docs/math.md for every formula and option name.
"""

from covrl.math.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageBatch,
    AdvantageOutput,
    compute_advantages,
    variance_proxies,
)
from covrl.math.correction import REJECTION_CRITERIA, CorrectionConfig, CorrectionOutput, rollout_correction
from covrl.math.kl import KL_ESTIMATORS, kl_estimate
from covrl.math.logprobs import entropy_from_logits, logit_grad_proxy, sum_pi_squared, token_logprobs
from covrl.math.losses import (
    AGGREGATIONS,
    POLICY_LOSSES,
    LossOutput,
    aggregate,
    policy_loss,
    score_centering_term,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS", "AGGREGATIONS", "KL_ESTIMATORS", "POLICY_LOSSES", "REJECTION_CRITERIA",
    "AdvantageBatch", "AdvantageOutput", "CorrectionConfig", "CorrectionOutput", "LossOutput",
    "aggregate", "compute_advantages", "entropy_from_logits", "kl_estimate", "logit_grad_proxy", "policy_loss",
    "rollout_correction", "score_centering_term", "sum_pi_squared", "token_logprobs", "variance_proxies",
]
