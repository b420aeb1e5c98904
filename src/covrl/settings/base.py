"""The one base class of every config section, so that every section validates the same way."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["SECTION_POLICY", "Section"]

# extra="forbid": a misspelt key is an error, not a silently ignored setting;
# validate_assignment: `cfg.optim.lr = -1` in code is checked like the same value in a file;
# allow_inf_nan=False: inf/nan are refused at start-up (a field where inf means something opts in explicitly).
# covrl.math.CorrectionConfig repeats this dict (math imports nothing from covrl); a test checks they agree.
SECTION_POLICY = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class Section(BaseModel):
    """Base of every config section (and of the root models such as `TrainConfig`)."""

    model_config = SECTION_POLICY
