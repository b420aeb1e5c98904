"""Response-length-triggered LR decay (docs/theory.md §8; Zhang, Li et al. 2026, arXiv 2602.01826).

A surge in mean response length is an early warning that gradient noise and the sampler–trainer mismatch are
about to rise together; shrinking the update size suppresses both. The schedule keeps an exponential moving
average (EMA) of a scalar signal (mean response length by default) and, when the current value exceeds the EMA by
a factor `ratio` after warm-up, multiplies a persistent LR scale by `factor` (never below `floor`, at most
`max_decays` times, at least `cooldown` rollouts apart). The same mechanics work on other signals: the gradient
noise proxy of §7 (`trigger="noise"`) or the mismatch metric of §6 (`trigger="mismatch"`).

Time runs on the data clock (docs/theory.md §9): warm-up and cooldown are counted in rollouts consumed. They can be given
in optimizer steps instead (`warmup_steps`, `cooldown_steps`); these are converted once, at construction, with the
run's rollouts per step: `cooldown = cooldown_steps · rollouts_per_step`.

Usage in a training loop (the trainer multiplies its base lr by `.scale`):

    schedule = LengthSurgeSchedule(cfg, rollouts_per_step=B)
    ...after each step (rollouts = cumulative rollouts consumed, including this step's B)...
    metrics |= schedule.update(mean_response_length, rollouts)
    for group in optimizer.param_groups: group["lr"] = base_lr(rollouts) * schedule.scale
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field

from covrl.settings import Section

# Default metric (in the trainer's per-step metrics dict) that feeds each trigger; `signal_metric` overrides it.
# "noise" reads the monitor's fast EMA of the noise proxy so that the schedule compares a short-horizon average
# with its own slow EMA (a per-step proxy alone is too noisy to threshold).
TRIGGER_METRICS: dict[str, str] = {
    "length": "response/length_mean",
    "noise": "noise/noise_ema",
    "mismatch": "mismatch/k3",
}

_EPS = 1e-12


class LengthSurgeConfig(Section):
    """Options of the length-surge LR decay (docs/theory.md §8). Warm-up and cooldown run on the data clock (rollouts)."""

    enabled: bool = Field(False, description="apply the decay; when off the EMA and ratio are still logged, scale stays 1")
    trigger: Literal["length", "noise", "mismatch"] = Field(
        "length", description="signal compared with its EMA: mean response length, gradient-noise proxy, or mismatch")
    signal_metric: str | None = Field(
        None, description="key of the per-step metric read by update_from_metrics; None = the trigger's default")
    ema_alpha: float = Field(0.05, gt=0.0, le=1.0, description="EMA weight of the newest signal (updated after the test)")
    # inf is a setting here (the trigger never fires); nan still fails gt=1
    ratio: float = Field(1.2, gt=1.0, allow_inf_nan=True, description="decay when signal / EMA >= ratio")
    factor: float = Field(0.5, gt=0.0, lt=1.0, description="multiply the LR scale by this at each decay")
    floor: float = Field(0.125, gt=0.0, le=1.0, description="the LR scale never goes below this")
    max_decays: int = Field(3, ge=0, description="at most this many decays over the run")
    cooldown: int | None = Field(
        None, ge=0, description="rollouts between two decays; None = cooldown_steps x rollouts per step")
    cooldown_steps: int = Field(100, ge=0, description="cooldown in optimizer steps, used when cooldown is None")
    warmup: int | None = Field(
        None, ge=0, description="rollouts consumed before the first test; None = warmup_steps x rollouts per step")
    warmup_steps: int = Field(20, ge=0, description="warm-up in optimizer steps (1/ema_alpha by default), used when warmup is None")

    def in_rollouts(self, rollouts_per_step: int | None) -> tuple[int, int]:
        """(warmup, cooldown) in rollouts. A value given in rollouts wins; one given in steps is multiplied once by
        `rollouts_per_step` (required then)."""
        needs_conversion = self.warmup is None or self.cooldown is None
        if needs_conversion and (rollouts_per_step is None or rollouts_per_step < 1):
            missing = [n for n in ("warmup", "cooldown") if getattr(self, n) is None]
            raise ValueError(
                f"LengthSurgeConfig: {', '.join(missing)} given in steps; pass rollouts_per_step >= 1 to "
                f"LengthSurgeSchedule (got {rollouts_per_step!r}) or set {', '.join(missing)} in rollouts")
        warmup = self.warmup if self.warmup is not None else self.warmup_steps * int(rollouts_per_step)
        cooldown = self.cooldown if self.cooldown is not None else self.cooldown_steps * int(rollouts_per_step)
        return int(warmup), int(cooldown)

    @property
    def metric_key(self) -> str:
        return self.signal_metric or TRIGGER_METRICS[self.trigger]


class LengthSurgeSchedule:
    """Persistent LR scale driven by surges of a signal over its EMA.

    At each `update(L, rollouts)`:
      ratio = L / EMA  (1 on the first call, when the EMA is initialised to L);
      if enabled, rollouts >= warmup, rollouts − last_decay >= cooldown, decays < max_decays, scale > floor and
      ratio >= cfg.ratio:  scale ← max(floor, factor · scale), decays += 1, last_decay = rollouts;
      then (after the test, so a surge cannot mask itself) EMA ← (1 − α)·EMA + α·L.
    `rollouts` is the cumulative number of rollouts consumed (the data clock) and must not decrease.
    """

    def __init__(self, cfg: LengthSurgeConfig | None = None, *, rollouts_per_step: int | None = None):
        self.cfg = cfg if cfg is not None else LengthSurgeConfig()
        self.warmup, self.cooldown = self.cfg.in_rollouts(rollouts_per_step)
        self.scale = 1.0
        self.ema: float | None = None
        self.decays = 0
        self.last_decay_rollouts: int | None = None
        self.last_rollouts: int | None = None

    def update(self, signal: float, rollouts: int) -> dict[str, float]:
        """Test `signal` against the EMA, maybe decay, then update the EMA. Returns the logged metrics
        `lr_surge/scale`, `lr_surge/ema` (after the update), `lr_surge/ratio`, `lr_surge/triggered` (0/1),
        `lr_surge/decays`."""
        signal = float(signal)
        if not math.isfinite(signal) or signal < 0:
            raise ValueError(f"LengthSurgeSchedule.update: signal must be finite and >= 0, got {signal!r} "
                             f"(trigger={self.cfg.trigger!r})")
        rollouts = int(rollouts)
        if rollouts < 0 or (self.last_rollouts is not None and rollouts < self.last_rollouts):
            raise ValueError(f"LengthSurgeSchedule.update: rollouts is the cumulative data clock and must not "
                             f"decrease; got {rollouts} after {self.last_rollouts}")
        ratio = 1.0 if self.ema is None else signal / max(self.ema, _EPS)
        triggered = (
            self.cfg.enabled
            and self.ema is not None
            and rollouts >= self.warmup
            and (self.last_decay_rollouts is None or rollouts - self.last_decay_rollouts >= self.cooldown)
            and self.decays < self.cfg.max_decays
            and self.scale > self.cfg.floor
            and ratio >= self.cfg.ratio
        )
        if triggered:
            self.scale = max(self.cfg.floor, self.scale * self.cfg.factor)
            self.decays += 1
            self.last_decay_rollouts = rollouts
        a = self.cfg.ema_alpha
        self.ema = signal if self.ema is None else (1.0 - a) * self.ema + a * signal
        self.last_rollouts = rollouts
        return {
            "lr_surge/scale": self.scale,
            "lr_surge/ema": self.ema,
            "lr_surge/ratio": ratio,
            "lr_surge/triggered": float(triggered),
            "lr_surge/decays": float(self.decays),
        }

    def update_from_metrics(self, metrics: dict[str, float], rollouts: int) -> dict[str, float]:
        """`update(metrics[cfg.metric_key], rollouts)`; the key is the trigger's default (TRIGGER_METRICS) unless
        `signal_metric` is set."""
        key = self.cfg.metric_key
        if key not in metrics:
            raise KeyError(f"LengthSurgeSchedule: metric {key!r} (trigger={self.cfg.trigger!r}) not in this step's "
                           f"metrics; set lr_surge.signal_metric to one of {sorted(metrics)}")
        return self.update(metrics[key], rollouts)

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale, "ema": self.ema, "decays": self.decays,
            "last_decay_rollouts": self.last_decay_rollouts, "last_rollouts": self.last_rollouts,
            "warmup": self.warmup, "cooldown": self.cooldown,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict()`. Warm-up and cooldown come from the state, so a resumed run keeps the clock it
        started with even if rollouts per step changed."""
        expected = {"scale", "ema", "decays", "last_decay_rollouts", "last_rollouts", "warmup", "cooldown"}
        missing = expected - set(state)
        if missing:
            raise KeyError(f"LengthSurgeSchedule.load_state_dict: missing keys {sorted(missing)}")
        self.scale = float(state["scale"])
        self.ema = None if state["ema"] is None else float(state["ema"])
        self.decays = int(state["decays"])
        self.last_decay_rollouts = None if state["last_decay_rollouts"] is None else int(state["last_decay_rollouts"])
        self.last_rollouts = None if state["last_rollouts"] is None else int(state["last_rollouts"])
        self.warmup = int(state["warmup"])
        self.cooldown = int(state["cooldown"])
