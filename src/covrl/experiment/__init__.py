"""What experiments and benchmarks build on: an arm driven step by step through covrl.api (`ArmRunner`) and the
override sets experiments start from. The studies of the repository's studies/ folder and `covrl bench` use it."""

from covrl.experiment.harness import Arm, ArmRunner, Step, numeric, pick
from covrl.experiment.presets import DRIVEN, ONE_DIGIT_ADDITION

__all__ = ["DRIVEN", "ONE_DIGIT_ADDITION", "Arm", "ArmRunner", "Step", "numeric", "pick"]
