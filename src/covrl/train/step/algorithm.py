"""The algorithm of a run, bound once from its config: advantage estimator, policy loss, rollout correction.

`bind_algorithm(cfg)` resolves the registry names of `cfg.algorithm` to their covrl.math entries and checks and
binds their options, so the Trainer calls `Algorithm.correct` / `.advantages` / `.policy_loss` every step
without string lookups or signature inspection. The pairing rule (docs/theory.md §6) is the loss entry's
`takes_is_weights`: a loss whose ratio is against the sampler (ppo_clip) gets no extra IS weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch

from covrl.math import (
    ADVANTAGE_SPECS,
    LOSS_SPECS,
    AdvantageOutput,
    AdvantageSpec,
    ClipCovOutput,
    CorrectionConfig,
    CorrectionOutput,
    LossOutput,
    LossSpec,
    advantage_metrics,
    aggregate,
    clip_cov_keep,
    correction_metrics,
    make_advantage_batch,
    rollout_correction,
    score_centering_term,
)

if TYPE_CHECKING:   # the run's config composes this room's sections: imported for types only
    from covrl.train.config import TrainConfig


@dataclass(frozen=True)
class Algorithm:
    """Estimator and loss entries with their bound (type-checked) options, the correction config and the
    algorithm flags of one run."""

    estimator: AdvantageSpec
    loss: LossSpec
    correction: CorrectionConfig
    advantage_options: Mapping[str, Any]
    loss_options: Mapping[str, Any]
    agg_mode: str
    norm_constant: float | None
    is_weights_in_advantage: bool
    score_centering: bool
    score_centering_truncation: float | None
    # the reward terms the run's task scores (task.rewards, or one; + the overlong penalty): an estimator that
    # takes per-term rewards (gdpo) must get them from every batch when there are several
    reward_term_count: int = 1
    # Clip-Cov's share of each group's tokens (0: off)
    clip_cov: float = 0.0

    # ---------------------------------------------------------------------------------------- properties
    @property
    def loss_takes_is_weights(self) -> bool:
        """The pairing rule: False for a loss whose ratio is against the sampler (ppo_clip)."""
        return self.loss.takes_is_weights

    @property
    def uses_is_weights(self) -> bool:
        """Whether the correction produces IS weights (correction.is_level set)."""
        return self.correction.is_level is not None

    @property
    def estimator_takes_is_weights(self) -> bool:
        """Whether the estimator's advantages depend on the IS weights (OTB with is_weights_in_advantage)."""
        return self.uses_is_weights and self.is_weights_in_advantage and "is_weights" in self.estimator.inputs

    @property
    def needs_batch_statistics(self) -> bool:
        """Whether the correction or the estimator needs the whole batch at once (batch-normalised IS weights,
        GDPO's batch normalisation)."""
        return self.correction.is_batch_normalize or self.estimator.spans_batch(self.advantage_options)

    @property
    def token_local_weights(self) -> bool:
        """Whether each IS weight depends on its own token only (not on row sums or the batch)."""
        return self.correction.is_level != "sequence" and not self.correction.is_batch_normalize

    @property
    def token_local_correction(self) -> bool:
        """Whether weights and keep-mask both depend on each token only (token-level IS, token_* criteria)."""
        return self.token_local_weights and all(name.startswith("token_") for name in self.correction.rs)

    # ------------------------------------------------------------------------------------------- calls
    def correct(self, trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor, *,
                with_metrics: bool = True) -> CorrectionOutput:
        return rollout_correction(trainer_logprobs, sampler_logprobs, mask, self.correction,
                                  with_metrics=with_metrics)

    def correction_metrics(self, trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor,
                           mask: torch.Tensor, weights: torch.Tensor, keep: torch.Tensor) -> dict[str, float]:
        """`correct(...).metrics` from given (e.g. assembled) weights and keep-mask."""
        return correction_metrics(trainer_logprobs, sampler_logprobs, mask, weights, keep, self.correction)

    def is_weights(self, corr: CorrectionOutput) -> torch.Tensor | None:
        """The IS weights of a correction, None when the correction makes none (is_level unset)."""
        return corr.weights if self.uses_is_weights else None

    def _advantage_weights(self, is_weights: torch.Tensor | None) -> torch.Tensor | None:
        return is_weights if self.is_weights_in_advantage else None

    def advantages(self, *, rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor,
                   logprobs: torch.Tensor, sum_pi_sq: torch.Tensor, is_weights: torch.Tensor | None,
                   reward_terms: torch.Tensor | None = None, reward_weights: torch.Tensor | None = None,
                   with_metrics: bool = True) -> AdvantageOutput:
        """The estimator on trainer log-probs / Σπ², the correction's IS weights (passed on only with
        is_weights_in_advantage) and the batch's per-term rewards (ScoredBatch.reward_terms / reward_weights)."""
        if ("reward_terms" in self.estimator.inputs and reward_terms is None and self.reward_term_count > 1):
            raise ValueError(f"algorithm.advantage={self.estimator.name} normalises each of the task's "
                             f"{self.reward_term_count} reward terms, and this batch carries no per-term rewards "
                             "(ScoredBatch.reward_terms: score it with the task, e.g. covrl.train.run.sources."
                             "score_rollouts)")
        return self.estimator.compute(rewards=rewards, mask=mask, group_ids=group_ids, logprobs=logprobs,
                                      sum_pi_sq=sum_pi_sq, is_weights=self._advantage_weights(is_weights),
                                      reward_terms=reward_terms, reward_weights=reward_weights,
                                      options=self.advantage_options, with_metrics=with_metrics)

    @staticmethod
    def term_inputs(batch) -> dict[str, torch.Tensor | None]:
        """A scored batch's per-term rewards as `advantages` inputs (reward_terms [B, K], reward_weights [K];
        None for a batch without them)."""
        return {"reward_terms": getattr(batch, "reward_terms", None),
                "reward_weights": getattr(batch, "reward_weights", None)}

    def advantage_metrics(self, *, rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor,
                          advantages: torch.Tensor, logprobs: torch.Tensor, sum_pi_sq: torch.Tensor,
                          is_weights: torch.Tensor | None) -> dict[str, float]:
        """`advantages(...).metrics` for given (e.g. assembled) advantages, without running the estimator."""
        return advantage_metrics(make_advantage_batch(rewards, mask, group_ids), advantages, logprobs=logprobs,
                                 sum_pi_sq=sum_pi_sq, is_weights=self._advantage_weights(is_weights))

    def policy_loss(self, *, logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor, is_weights: torch.Tensor | None) -> LossOutput:
        """The loss aggregated with agg_mode; the IS weights are dropped by the pairing rule where they would
        correct twice."""
        return self.loss.compute(logprobs=logprobs, sampler_logprobs=sampler_logprobs, advantages=advantages,
                                 mask=mask, is_weights=is_weights if self.loss_takes_is_weights else None,
                                 agg_mode=self.agg_mode, norm_constant=self.norm_constant,
                                 options=self.loss_options)

    def score_centering_term(self, trainer_topk_logprobs: torch.Tensor, sampler_topk_logprobs: torch.Tensor,
                             advantages: torch.Tensor, mask: torch.Tensor) -> LossOutput:
        return score_centering_term(trainer_topk_logprobs, sampler_topk_logprobs, advantages, mask,
                                    truncation=self.score_centering_truncation, agg_mode=self.agg_mode,
                                    norm_constant=self.norm_constant)

    def clip_cov_keep(self, advantages: torch.Tensor, sampler_logprobs: torch.Tensor, keep: torch.Tensor,
                      group_ids: torch.Tensor) -> ClipCovOutput:
        """`keep` less Clip-Cov's tokens. The covariance is taken with the sampler's log-probs: on-policy they are
        the trainer's up to the measured mismatch, and the selection then does not depend on how the trainer's
        forward is split or cast."""
        return clip_cov_keep(advantages, sampler_logprobs, keep, group_ids, self.clip_cov)

    def aggregate(self, token_loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """`token_loss` reduced with the run's agg_mode (and norm_constant)."""
        return aggregate(token_loss, mask, self.agg_mode, norm_constant=self.norm_constant)


def bind_algorithm(cfg: TrainConfig) -> Algorithm:
    """The Algorithm of `cfg` (algorithm + correction sections); options are type-checked and coerced by the
    registry entries' option models (the config validated them already)."""
    a = cfg.algorithm
    estimator, loss = ADVANTAGE_SPECS[a.advantage], LOSS_SPECS[a.loss]
    return Algorithm(estimator=estimator, loss=loss, correction=cfg.correction,
                     advantage_options=MappingProxyType(estimator.validate_options(a.advantage_options)),
                     loss_options=MappingProxyType(loss.validate_options(a.loss_options)),
                     agg_mode=a.agg_mode, norm_constant=a.norm_constant,
                     is_weights_in_advantage=a.is_weights_in_advantage,
                     score_centering=a.score_centering, score_centering_truncation=a.score_centering_truncation,
                     clip_cov=a.clip_cov,
                     reward_term_count=max(len(cfg.task.rewards), 1) + int(cfg.task.overlong_reward.buffer > 0))
