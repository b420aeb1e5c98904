"""Configuration of a training run: the trainer's own sections and the whole run composed of the sections
that the lower layers define (`ModelConfig`, `TaskConfig`, `SamplerConfig`, `CorrectionConfig`,
`LengthSurgeConfig`).

The composed `TrainConfig` lives here (layer `train`) so that the Trainer and the loops can take it without
importing upward; `load_config` / `build_config` bind the generic YAML loading, dotted overrides and error
messages of `covrl.settings` to it (`covrl.config` re-exports them as the public entry point).
Every schedule field is counted on the data clock (rollouts consumed), never in optimizer steps."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, ValidationError, field_validator, model_validator

from covrl.math import ADVANTAGE_SPECS, LOSS_SPECS, AdvantageSpec, CorrectionConfig, LossSpec, reject_bool
from covrl.models import ModelConfig
from covrl.rollout import SamplerConfig
from covrl.settings import ConfigError, Section, build_section, known_name, load_section
from covrl.tasks import TaskConfig
from covrl.train.asyncrl.config import AsyncLoopConfig
from covrl.train.parallel.wrappers import TrainerConfig
from covrl.train.run.alarm import SyncAlarmConfig
from covrl.train.run.selection import SelectionConfig
from covrl.train.run.sizing import AUTO, SizingConfig, fallback_sizes
from covrl.train.run.threads import check_num_threads
from covrl.train.step.batch_scaling import BatchScalingConfig
from covrl.train.step.lr_surge import LengthSurgeConfig
from covrl.train.step.self_teacher import SelfTeacherConfig

__all__ = ["AlgorithmConfig", "CheckpointConfig", "ConfigError", "EvalConfig", "KLConfig", "LoggingConfig",
           "LoopConfig", "OptimConfig", "RunConfig", "SFTWarmupConfig", "TrainConfig", "TrainerConfig", "build_config",
           "load_config"]

AggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
# pydantic reads a YAML `true` as 1.0 for a float field; these options refuse it as the registry options do
Number = Annotated[float, BeforeValidator(reject_bool)]




def check_registry_options(field_name: str, spec: AdvantageSpec | LossSpec, values: dict[str, Any]) -> None:
    """Raise a ValueError naming `algorithm.<field_name>.<key>` and the options of the registered function `spec`
    (covrl.math AdvantageSpec / LossSpec) when a key is not one of its options or its value has the wrong type.
    The options (names, types, defaults) are the ones the registry read from the function's signature; the
    arguments the trainer supplies itself (covrl.math ADVANTAGE_INPUTS / LOSS_INPUTS) are not options."""
    allowed = spec.describe_options()
    unknown = spec.unknown_options(values)
    if unknown:
        raise ValueError(f"algorithm.{field_name}.{unknown[0]} is not an option of {spec.name}; allowed: {allowed}")
    try:
        spec.validate_options(values)
    except ValidationError as err:
        problems = "; ".join(f"algorithm.{field_name}.{'.'.join(str(p) for p in e['loc'])}: {e['msg']} "
                             f"(got {e.get('input')!r})" for e in err.errors())
        raise ValueError(f"{problems}; options of {spec.name}: {allowed}") from None


class RunConfig(Section):
    name: str | None = Field(None, description="run folder name under output_dir (default: the config file's stem)")
    seed: int = Field(0, ge=0, le=2**63 - 1, description="one seed for python, numpy, torch and the sampler's generator")
    output_dir: str = Field("runs", min_length=1, description="folder that holds run folders")
    device: Literal["cpu", "cuda", "auto"] = Field("cpu", description="device of the trainer (and HF sampler)")
    num_threads: int | Literal["auto"] | None = Field(
        "auto", description="torch CPU threads: a count, 'auto' (the cores left free by the load average, shared "
                            "among local trainer ranks; covrl.train.run.threads) or null (torch's default: one per "
                            "core); results depend on it. A count (or auto's) also caps the processes the run "
                            "starts (OMP/MKL/tokenizers threads of the vLLM engine process, environment servers "
                            "and harnesses; sampler processes and Ray actors use async_loop.sampler_threads)")
    save_initial: bool = Field(False, description="save the weights at the start of RL in checkpoints/initial/")
    stall_warning_s: float = Field(300.0, ge=0, description="print what the run waits for when one phase of a step "
                                   "(rollouts, training, weight push, evaluation, checkpoint) lasts this long, and "
                                   "again each further period; 0 = never")

    @field_validator("num_threads", mode="before")
    @classmethod
    def _valid_num_threads(cls, v: Any) -> Any:
        return check_num_threads(v, field=None)   # the error names run.num_threads


class AlgorithmConfig(Section):
    advantage: Annotated[str, known_name(ADVANTAGE_SPECS, "advantage estimator")] = Field("otb", description="advantage estimator (covrl.math registry): grpo, dr_grpo, rloo, "
                                              "reinforce, maxrl, gdpo (per reward term of task.rewards), otb, "
                                              "otb_tir")
    advantage_options: dict[str, Any] = Field(default_factory=dict,
                                              description="extra keyword options of the estimator, e.g. "
                                                          "handle_zero_tail")
    loss: Annotated[str, known_name(LOSS_SPECS, "policy loss")] = Field("covariance", description="policy loss (covrl.math registry): covariance, reinforce, "
                      "ppo_clip, gspo, gspo_token, gmpo, cispo, sapo, dppo, dro, vespo, luspo")
    loss_options: dict[str, Any] = Field(default_factory=dict,
                                         description="extra keyword options of the loss, e.g. clip_low, clip_high, "
                                                     "dual_clip for ppo_clip")
    agg_mode: AggMode = Field("token-mean", description="how token losses are averaged over the batch")
    score_centering: bool = Field(False, description="add the score-centring term (needs sampler.return_topk > 0)")
    score_centering_truncation: Number | None = Field(None, gt=0,
                                                      description="truncation C of the centring weights (None: off)")
    norm_constant: Number | None = Field(None, gt=0,
                                         description="N of agg_mode=seq-mean-token-sum-norm: the loss is "
                                                     "sum(l*m)/(B*N); None: the step's padded response width")
    is_weights_in_advantage: bool = Field(True, description="pass rollout-correction IS weights to estimators "
                                                            "that accept them (OTB: w_t <- w_t * rho_t^2)")
    clip_cov: float = Field(0.0, ge=0, lt=1, description="Clip-Cov: in each group, drop the gradient of this "
                            "fraction of the tokens whose advantage and sampler log-prob covary most (the tokens "
                            "whose update lowers the policy's entropy most; docs/theory.md §16); 0: off")

    @model_validator(mode="after")
    def _known_options(self) -> AlgorithmConfig:
        check_registry_options("advantage_options", ADVANTAGE_SPECS[self.advantage], self.advantage_options)
        check_registry_options("loss_options", LOSS_SPECS[self.loss], self.loss_options)
        # a constant that no other mode reads would be silently ignored
        if self.norm_constant is not None and self.agg_mode != "seq-mean-token-sum-norm":
            raise ValueError(f"algorithm.norm_constant is read by agg_mode=seq-mean-token-sum-norm only "
                             f"(agg_mode is {self.agg_mode})")
        return self


class OptimConfig(Section):
    lr: float = Field(1e-5, gt=0, description="peak AdamW learning rate")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay")
    max_grad_norm: float | None = Field(1.0, gt=0, description="clip the global grad norm (None: no clipping)")
    schedule: Literal["constant", "cosine"] = Field("constant", description="lr shape after warm-up")
    warmup_rollouts: int = Field(0, ge=0, description="linear lr warm-up length, in rollouts consumed")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="cosine floor as a fraction of lr")
    micro_batch_size: int = Field(16, ge=1, description="rows per forward/backward (bounds memory)")
    share_prompts: bool = Field(True, description="run a group's shared prompt once per micro-batch (its KV "
                                                  "cache is indexed out to the rows; same values, less compute)")
    max_bad_steps: int = Field(3, ge=1, description="stop after this many skipped (non-finite) steps in a row")
    skip_zero_gradient: bool = Field(False, description="leave the weights as they are when the step's gradient "
                                     "is exactly zero (no learning signal: every group's reward constant and no "
                                     "KL/entropy term): no AdamW momentum or weight-decay move, no new policy "
                                     "version; counted in `no_signal_steps`")

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"betas must lie in [0, 1), got {v}")
        return v


class KLConfig(Section):
    coef: float = Field(0.0, ge=0, description="weight of the KL penalty to the reference (0: off, no ref model)")
    kind: Literal["k1", "k2", "k3", "abs"] = Field("k3", description="per-token KL estimator")
    mode: Literal["loss", "reward"] = Field("loss", description="add the penalty to the loss, or subtract "
                                                                "coef * sum_t KL from each sequence's reward")
    straight_through: bool = Field(False, description="straight-through gradient of the estimator (loss mode)")


class DistillConfig(Section):
    """On-policy distillation: the student samples, a frozen teacher scores the drawn tokens, and the per-token
    reverse KL is the learning signal: A_t = coef·(log p_teacher(y_t) − log π(y_t)) + reward_weight·A_task_t.
    `teacher: self` (SDFT / OPSD): the teacher is the model itself given the reference answer in its prompt."""

    teacher: ModelConfig | Literal["self"] | None = Field(
        None, description="the frozen teacher (a model section: source, path, dtype; its tokenizer must be the "
                          "student's), or self: the model itself, scoring the drawn tokens given a privileged "
                          "prompt with the example's reference answer (distill.self_teacher); None = no "
                          "distillation")
    self_teacher: SelfTeacherConfig = Field(default_factory=SelfTeacherConfig,
                                            description="the privileged prompt and weights of distill.teacher=self")
    coef: float = Field(1.0, gt=0, description="weight of the per-token reverse-KL signal")
    reward_weight: float = Field(0.0, ge=0, description="weight of the task's advantages mixed in (0: pure "
                                                        "distillation; the rewards are still scored and logged)")
    engine: Literal["trainer", "vllm"] = Field(
        "trainer", description="where the teacher scores: trainer (a frozen copy in the trainer's process, on its "
                               "device, every rank) or vllm (its own vLLM engine with sampler.vllm's options, "
                               "prompt log-probs at temperature 1 over the whole vocabulary; one trainer process)")

    @model_validator(mode="after")
    def _self_teacher_options(self):
        if self.teacher == "self" and self.engine != "trainer":
            raise ValueError(f"distill.engine={self.engine} serves a separate teacher; distill.teacher=self scores "
                             "with the trainer's own model: use distill.engine=trainer")
        if self.teacher != "self" and self.self_teacher != SelfTeacherConfig():
            raise ValueError(f"distill.self_teacher is read by distill.teacher=self only; the active choice is "
                             f"distill.teacher={'None' if self.teacher is None else 'a model'}: remove "
                             "distill.self_teacher or set distill.teacher=self")
        return self


class LoopConfig(Section):
    mode: Literal["sync", "async", "ray"] = Field(
        "sync", description="orchestration: sync (generate, then train), async (sampler thread beside the "
                            "trainer, see async_loop), ray (sampler actors; docs/async.md)")
    steps: int = Field(40, ge=1, description="optimizer steps of the run; total rollouts = steps * rollouts/step")
    prompts_per_step: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        8, description="distinct prompts per step; auto: max(1, sizing.rollouts_per_step // group_size)")
    group_size: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        8, description="completions per prompt (a group for the advantage baseline); auto: sized by the probe "
                       "before step 1 (sizing)")
    dynamic_sampling: bool = Field(False, description="DAPO dynamic sampling: drop groups whose rewards are all "
                                   "equal and generate more until prompts_per_step groups are kept (sync: "
                                   "covrl.train.run.sources.DynamicSamplingSource; async / ray: filtered chunks "
                                   "free queue capacity, docs/async.md)")
    dynamic_sampling_max_rounds: int = Field(16, ge=1, le=100_000, description="sync: generation rounds per step "
                                             "at most; then the step trains on the groups kept so far, and a step "
                                             "that kept none stops the run (DynamicSamplingError, exit 2); async: "
                                             "the run stops when this many batches' worth of rollouts were "
                                             "filtered without filling the next batch")

    @property
    def rollouts_per_step(self) -> int:
        for name in ("prompts_per_step", "group_size"):   # auto is resolved by the run's probe (sizing)
            if getattr(self, name) == AUTO:
                raise ValueError(f"loop.{name}=auto is not resolved yet: the run's probe sets it "
                                 "(covrl.train.run.sizing.size_run)")
        return self.prompts_per_step * self.group_size


class EvalConfig(Section):
    before: bool = Field(True, description="evaluate before RL (after the SFT warm-up, if any)")
    after: bool = Field(True, description="evaluate at the end of the run")
    every_rollouts: int = Field(0, ge=0, description="also evaluate every this many rollouts (0: never)")
    greedy: bool = Field(True, description="greedy decoding accuracy on the held-out prompts")
    sampled: bool = Field(True, description="one sample per prompt at the sampler's temperature")
    max_prompts: int | None = Field(None, ge=1, description="use at most this many held-out prompts")
    pass_at_k: int | None = Field(None, ge=1, le=4096, description="also sample pass_at_k_samples completions "
                                  "per held-out prompt and report the unbiased pass@k (None: off)")
    pass_at_k_samples: int | None = Field(None, ge=1, le=4096, description="samples per prompt for pass@k "
                                          "(n >= k; None = k)")

    @model_validator(mode="after")
    def _enough_samples(self):
        if self.pass_at_k and self.pass_at_k_samples and self.pass_at_k_samples < self.pass_at_k:
            raise ValueError(f"eval.pass_at_k_samples={self.pass_at_k_samples} < eval.pass_at_k={self.pass_at_k}: "
                             "the estimator needs n >= k samples per prompt")
        return self


class CheckpointConfig(Section):
    every_rollouts: int = Field(0, ge=0, description="save a checkpoint every this many rollouts (0: only at end)")
    at_end: bool = Field(True, description="save a checkpoint when the run ends")
    keep_last: int = Field(1, ge=1, description="complete checkpoints kept (older ones are deleted); 1 keeps what "
                           "--resume needs, 2 or more also an older one to fall back on when the newest is damaged")
    final: Literal["full", "weights"] = Field(
        "full", description="the checkpoint of a completed run: full (weights + optimizer state: --resume can train "
                            "it further) or weights (checkpoints/final/ without the optimizer state, which AdamW makes "
                            "twice the weights' size; the run's other checkpoints are deleted and it cannot be "
                            "resumed for more steps)")


class SFTWarmupConfig(Section):
    steps: int = Field(0, ge=0, description="supervised steps on the task's demonstrations before RL (0: off)")
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate of the warm-up")
    batch_size: int = Field(32, ge=1, description="examples per warm-up step")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay of the warm-up")


class LoggingConfig(Section):
    console: bool = Field(True, description="print progress and the key metrics to the console")
    progress_bar: bool = Field(True, description="rich live progress bar on a terminal (else plain step lines, "
                               "see plain_every_s)")
    plain_every_s: float = Field(
        10.0, ge=0, description="plain step lines (no terminal: a pipe, a file, CI, a notebook; or progress_bar "
        "off): the first and the last step, and between them at most one line per this many seconds, the newest "
        "step's; 0 = every step")
    engine_logs: Literal["quiet", "info", "debug"] = Field(
        "quiet", description="what vLLM, Ray, transformers, huggingface_hub, datasets and torch.distributed log "
        "themselves: quiet = their errors only, info / debug = that level (covrl.settings.quiet); their progress "
        "bars are drawn only when stdout is a terminal")
    tensorboard: bool = Field(False, description="write TensorBoard scalars (extra: tensorboard)")
    wandb: bool = Field(False, description="log to Weights & Biases (extra: wandb)")
    wandb_project: str = Field("covrl", description="wandb project name")
    curves: bool = Field(True, description="draw curves.png at the end of the run")
    diagnostics: bool = Field(True, description="log tangent/remainder/kl_seq/bound (docs/theory.md §5) each step")
    noise_scale: bool | None = Field(
        None, description="log the gradient noise split noise/* (docs/theory.md §7, parameter units) from micro-batch "
        "gradient norms; a step that fits one micro-batch is then run as two halves of whole groups. None: on, "
        "except under trainer.parallel=fsdp2, which cannot measure it (docs/distributed.md)")
    noise_scale_every: int = Field(
        1, ge=1, description="measure the noise split (and split a one-micro-batch step in two) on every k-th "
        "optimizer step only; the other steps log noise/signal alone and run unsplit (what the split costs: "
        "docs/performance.md)")


def fallback_sizes_of(cfg: TrainConfig, section: str) -> dict[str, int]:
    """The fallback numbers of `section`'s auto fields (a run without a probe), by field name."""
    return {k.split(".")[1]: v for k, v in fallback_sizes(cfg).items() if k.startswith(section + ".")}


class TrainConfig(Section):
    """A whole training run. Sections: run, model, task, sampler, algorithm, correction, kl, optim, lr_surge,
    loop, eval, checkpoint, sft_warmup, logging, async_loop, batch_scaling, trainer, sync_alarm, distill, selection,
    sizing. Validators check, they never fill values in: what depends on another section is resolved where it is
    read (`noise_scale_on`; the overlong penalty's budget by `build_task(..., response_budget=)`; the `auto` sizes
    by the run's probe, covrl.train.run.sizing, whose resolved config is validated again)."""

    run: RunConfig = Field(default_factory=RunConfig, description="name, seed, device, output folder")
    model: ModelConfig = Field(default_factory=ModelConfig, description="which model to train")
    task: TaskConfig = Field(default_factory=TaskConfig, description="prompts, answers and reward")
    sampler: SamplerConfig = Field(default_factory=SamplerConfig, description="rollout generation")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="advantage + loss")
    correction: CorrectionConfig = Field(default_factory=CorrectionConfig,
                                         description="rollout correction (IS weights, rejection)")
    kl: KLConfig = Field(default_factory=KLConfig, description="KL penalty to the reference model")
    distill: DistillConfig = Field(default_factory=DistillConfig,
                                   description="on-policy distillation from a frozen teacher")
    selection: SelectionConfig = Field(default_factory=SelectionConfig,
                                       description="which prompts of the stream a step trains on")
    optim: OptimConfig = Field(default_factory=OptimConfig, description="AdamW and lr schedule")
    lr_surge: LengthSurgeConfig = Field(default_factory=LengthSurgeConfig,
                                        description="length-surge lr decay (docs/theory.md §8)")
    loop: LoopConfig = Field(default_factory=LoopConfig, description="orchestration and run length")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="held-out evaluation")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="checkpoints")
    sft_warmup: SFTWarmupConfig = Field(default_factory=SFTWarmupConfig, description="supervised warm-up")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="metric sinks")
    async_loop: AsyncLoopConfig = Field(default_factory=AsyncLoopConfig,
                                        description="queue, staleness bound and backends of the async loops")
    batch_scaling: BatchScalingConfig = Field(default_factory=BatchScalingConfig,
                                              description="scale optim.lr with the rollouts per step")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig,
                                   description="data-parallel / sharded trainer on torch.distributed")
    sync_alarm: SyncAlarmConfig = Field(default_factory=SyncAlarmConfig,
                                        description="alarm when the sampler's weights stop matching the trainer's")
    sizing: SizingConfig = Field(default_factory=SizingConfig,
                                 description="how the fields set to auto are sized from a probe of the sampler")

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        if self.selection.strategy != "uniform" and (self.loop.mode != "sync" or self.loop.dynamic_sampling):
            raise ValueError(f"selection.strategy={self.selection.strategy!r} runs in the sync loop without "
                             "loop.dynamic_sampling (the async pools and dynamic sampling draw the stream "
                             "uniformly)")
        if self.selection.group_sizes == "adaptive" and (self.loop.mode != "sync" or self.loop.dynamic_sampling
                                                         or self.task.env.name):
            raise ValueError("selection.group_sizes=adaptive runs single-turn tasks in the sync loop without "
                             "loop.dynamic_sampling")
        if self.algorithm.score_centering and int(getattr(self.sampler, "return_topk", 0) or 0) <= 0:
            raise ValueError("algorithm.score_centering=true needs sampler.return_topk > 0 "
                             "(the sampler's top-k log-probs)")
        if "reward_terms" in ADVANTAGE_SPECS[self.algorithm.advantage].inputs:   # gdpo: each term of each rollout
            why = ("multi-turn episodes take their reward from the environment" if self.task.env.name
                   or self.task.name == "verifiers" else "kl.mode=reward subtracts the KL penalty from the summed "
                   "reward, past the terms (use kl.mode=loss)" if self.kl.coef > 0 and self.kl.mode == "reward"
                   else None)
            if why:
                raise ValueError(f"algorithm.advantage={self.algorithm.advantage} normalises each reward term of "
                                 f"every rollout, and this run has no per-term rewards: {why}")
        if self.loop.mode != "sync":   # auto sizes take their fallback numbers there (no probe): checked with them
            loop = self.loop.model_copy(update=fallback_sizes_of(self, "loop"))
            self.async_loop.check_against(prompts_per_step=loop.prompts_per_step,
                                          group_size=loop.group_size, sync_every=self.sampler.sync_every)
        if self.trainer.parallel != "none" and self.loop.mode == "ray" and not self.async_loop.trainer_actor:
            raise ValueError("loop.mode=ray with trainer.parallel runs the trainer ranks as Ray actors "
                             "(trainer.world_size of them): async_loop.trainer_actor=false is for one trainer")
        if self.logging.noise_scale and self.trainer.parallel == "fsdp2":
            raise ValueError("logging.noise_scale=true cannot be measured under trainer.parallel=fsdp2: the split "
                             "needs each rank's own gradient, which FSDP2 reduce-scatters without exposing it; "
                             "set logging.noise_scale=false (or use trainer.parallel=ddp; docs/distributed.md)")
        if (self.lr_surge.enabled and self.lr_surge.trigger == "noise" and self.lr_surge.signal_metric is None
                and self.logging.noise_scale_every > 1):
            raise ValueError(f"lr_surge.trigger=noise reads the noise EMA every step: it needs "
                             f"logging.noise_scale_every=1 (got {self.logging.noise_scale_every})")
        if self.trainer.autocast != "none" and self.model.dtype != "float32":
            raise ValueError(f"trainer.autocast={self.trainer.autocast} keeps fp32 master weights: it needs "
                             f"model.dtype=float32 (got {self.model.dtype}; a bf16 model is already bf16)")
        if self.loop.dynamic_sampling and self.trainer.parallel != "none":
            raise ValueError("loop.dynamic_sampling=true runs with trainer.parallel=none only (ranks would keep "
                             "different numbers of groups)")
        overlong = self.task.overlong_reward
        # unset, the penalty counts towards the sampler's budget (the run builds the task with it)
        budget = overlong.max_tokens if overlong.max_tokens is not None else self.sampler.max_new_tokens
        if budget != AUTO and overlong.buffer > budget:   # auto: the probe's budget floor is buffer + 1
            raise ValueError(f"task.overlong_reward.buffer={overlong.buffer} exceeds the response budget "
                             f"max_tokens={budget}")
        if (self.sampler.backend != "vllm" and self.distill.engine != "vllm"
                and self.sampler.vllm != type(self.sampler.vllm)()):   # they would be ignored without a word
            raise ValueError(f"sampler.vllm is read by sampler.backend=vllm (or distill.engine=vllm) only, and the "
                             f"active backend is sampler.backend={self.sampler.backend!r}: remove sampler.vllm or set "
                             "sampler.backend=vllm")
        if self.async_loop.max_staleness_rollouts is not None and self.async_loop.max_staleness_steps != 1:
            raise ValueError(f"async_loop.max_staleness_rollouts={self.async_loop.max_staleness_rollouts} and "
                             f"async_loop.max_staleness_steps={self.async_loop.max_staleness_steps} both bound the "
                             "queue: set one (rollouts, or steps x rollouts per step)")
        if self.batch_scaling.scale_lr and self.batch_scaling.base_batch_rollouts is None:
            raise ValueError("batch_scaling.scale_lr=true needs batch_scaling.base_batch_rollouts (the rollouts "
                             "per step at which optim.lr was tuned)")
        if self.batch_scaling.scale_lr and self.batch_scaling.rule == "sqrt_momentum":
            rollouts = self.loop.model_copy(update=fallback_sizes_of(self, "loop")).rollouts_per_step
            queue = self.async_loop.queue_rollouts(rollouts)
            need = max(self.batch_scaling.base_batch_rollouts, rollouts)
            if self.loop.mode == "sync" or queue < need:
                raise ValueError(f"batch_scaling.rule=sqrt_momentum corrects for momentum at the async queue's lag: "
                                 f"it needs loop.mode=async/ray and a queue of >= {need} rollouts (one step at both "
                                 f"batches); got loop.mode={self.loop.mode}, queue {queue}")
        return self

    @property
    def total_rollouts(self) -> int:
        return self.loop.steps * self.loop.rollouts_per_step

    @property
    def noise_scale_on(self) -> bool:
        """logging.noise_scale resolved: None is on wherever the per-rank gradients can be read (not fsdp2)."""
        if self.logging.noise_scale is not None:
            return self.logging.noise_scale
        return self.trainer.parallel != "fsdp2"


def build_config(data: dict, *, source: str = "<config>", lines: dict[tuple, int] | None = None,
                 overrides: dict[tuple, str] | None = None) -> TrainConfig:
    """`TrainConfig` from a nested dict; a ConfigError names each bad field with its file:line or override."""
    return build_section(TrainConfig, data, source=source, lines=lines, overrides=overrides)


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """Read `path` (YAML; None = all defaults), apply `section.key=value` overrides, validate."""
    return load_section(TrainConfig, path, overrides)
