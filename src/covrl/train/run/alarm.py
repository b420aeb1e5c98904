"""The weight-sync alarm: weights that silently stop reaching the engine look like staleness, so every step
compares the sampler's log q with the trainer's log π on the drawn tokens of the rows generated at the trainer's
own version (`mismatch/fresh_k3`, token k3). At equal weights that is the engine floor (precision, kernels);
the alarm measures the floor over the first steps and fires when a step's value exceeds `factor` times it.

    sync_alarm.mode: warn (default; the run goes on, the message says what to check) | raise (the run stops,
    exit code 7) | off

The floor is the largest fresh k3 of the first `calibration_steps` steps that have fresh rows, and at least
`floor_min` (an engine that shares the trainer's module has a floor of ~1e-11, which rounding alone can
multiply). A bf16 engine against an fp32 trainer calibrates its own floor (~1e-3) and does not fire.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field

from covrl.settings import Section

__all__ = ["SyncAlarm", "SyncAlarmConfig", "SyncAlarmError"]


class SyncAlarmConfig(Section):
    mode: Literal["warn", "raise", "off"] = Field(
        "warn", description="when the sampler's log-probs at the trainer's own version depart from the engine "
                            "floor: warn (the run goes on), raise (stop, exit code 7), off")
    factor: float = Field(100.0, gt=1.0, description="fire when mismatch/fresh_k3 exceeds this many times the floor")
    calibration_steps: int = Field(3, ge=1, description="steps (with rows at the trainer's version) that measure "
                                                        "the engine floor at the start of the run")
    floor_min: float = Field(1e-8, gt=0.0, description="the smallest floor: below it, rounding alone moves k3 "
                                                       "by large factors")


class SyncAlarmError(RuntimeError):
    """The sampler's log-probs at the trainer's own version departed from the engine floor (sync_alarm.mode=raise)."""


class SyncAlarm:
    """Checkpointed with the run (its calibration survives a resume)."""

    def __init__(self, cfg: SyncAlarmConfig, describe_engine: str = ""):
        self.cfg = cfg
        self.engine = describe_engine
        self.samples: list[float] = []
        self.fired = 0
        self._firing = False

    @property
    def floor(self) -> float | None:
        if len(self.samples) < self.cfg.calibration_steps:
            return None
        return max(max(self.samples), self.cfg.floor_min)

    def check(self, metrics: dict[str, float], step: int) -> tuple[dict[str, float], str | None]:
        """(this step's alarm metrics, the warning when it fires); raises SyncAlarmError under mode=raise."""
        value = metrics.get("mismatch/fresh_k3")
        if self.cfg.mode == "off" or value is None or not metrics.get("mismatch/fresh_rows"):
            return {}, None
        floor = self.floor
        if floor is None:   # still calibrating
            if math.isfinite(value):
                self.samples.append(float(value))
            return {"sync_alarm/floor": max([*self.samples, self.cfg.floor_min])}, None
        ratio = value / floor
        out = {"sync_alarm/floor": floor, "sync_alarm/ratio": ratio, "sync_alarm/fired": 0.0}
        if not (ratio > self.cfg.factor):
            self._firing = False
            return out, None
        already, self._firing = self._firing, True
        self.fired += 1
        out["sync_alarm/fired"] = 1.0
        text = (f"weight-sync alarm at step {step}: the sampler's log-probs at the trainer's own version differ "
                f"from the trainer's by token k3 = {value:.3g}, {ratio:.3g} x the engine floor {floor:.3g} measured "
                f"over the first {self.cfg.calibration_steps} steps (sync_alarm.factor = {self.cfg.factor:g}). "
                "Likely causes: the weights did not reach the engine (a skipped or failed push), a LoRA adapter "
                "was not applied (sampler.vllm.lora_sync), or the engine's dtype or kernels changed "
                f"(sampler.dtype){'; engine: ' + self.engine if self.engine else ''}.")
        if self.cfg.mode == "raise":
            raise SyncAlarmError(text + " Stopped (sync_alarm.mode=raise).")
        return out, None if already else text   # warned once per stretch of firing steps

    def state_dict(self) -> dict[str, Any]:
        return {"samples": list(self.samples), "fired": self.fired}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.samples = [float(v) for v in state["samples"]]
        self.fired = int(state["fired"])
