"""`TrainingClient` and `SamplingClient`: covrl's model, forward, losses, rollout correction, AdamW, samplers and
atomic checkpoints as building blocks for a loop the user writes (docs/api.md).

    client = TrainingClient.from_config("tiny")                 # model (+ LoRA), task, prompt stream, warm-up
    sampling = client.save_weights_and_get_sampling_client()   # the sampler, holding weights version v
    out = sampling.sample(prompts, num_samples=8)              # tokens + the sampler's log-probs
    fb = client.forward_backward(TrainBatch.from_rollouts(out.batch, advantages), loss_fn="covariance")
    client.optim_step(AdamParams(learning_rate=3e-4, ...))     # AdamW; gradients accumulated since the last step

Gradients accumulate over `forward_backward` calls until `optim_step`, as in Tinker. Rows are processed in
micro-batches of `micro_batch_size` (None: all at once); a covrl.math loss is aggregated over the whole call's
sampled tokens (each micro-batch contributes its share, as `covrl.train.step.trainer` does), so the micro-batch size
changes memory, not the gradient (up to float rounding).
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from covrl.api.losses import ApiLoss, LossInputs, get_loss
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
from covrl.config import load_config, load_preset, override_strings
from covrl.math import CorrectionConfig, aggregate, rollout_correction
from covrl.models.loading import apply_lora  # the adapters load_model adds
from covrl.rollout import SamplerConfig, build_sampler, truncation_rule
from covrl.rollout.types import ScoredBatch
from covrl.train import (
    MODEL_DIR,
    CheckpointError,
    DataStream,
    LossTerms,
    Prepared,
    Run,
    StepResult,
    TrainConfig,
    Trainer,
    apply_model_weights,
    build_adamw,
    build_components,
    collect,
    forward_batch,
    mean_over,
    micro_batch_share,
    micro_step,
    pad_cols,
    read_model_weights,
    save_checkpoint,
    truncation_replay,
)
from covrl.train import load_state as load_checkpoint_state
from covrl.train.run.sizing import fixed_sizes

STATE_KEY = "api"
SNAPSHOT_DIR = "sampler"   # <state_dir>/sampler/checkpoints/<name>/: weights saved for sampling later


def resolve_config(config: TrainConfig | str | Path, overrides: Mapping[str, Any] | list[str] | None = None
                   ) -> TrainConfig:
    """A TrainConfig as given, or loaded from a YAML path or a packaged preset name ("tiny", "default") with
    dotted overrides ({"optim.lr": 1e-3} or ["optim.lr=1e-3"])."""
    if isinstance(config, TrainConfig):
        if overrides:
            raise ValueError("overrides: apply them to the TrainConfig yourself (or pass a preset name / path)")
        return config
    strings = override_strings(dict(overrides)) if isinstance(overrides, Mapping) else list(overrides or [])
    path = Path(config)
    if not path.suffix:   # a preset name
        return load_preset(str(config), strings)
    return load_config(path, strings)


class TrainingClient:
    """Training on one model (full fine-tune, or LoRA adapters when the model is a peft model).

    `temperature`: the temperature of the trainer's log-probs (the sampler's, so that ratios compare like with
    like). `correction`: the default rollout correction (covrl.math.CorrectionConfig or its dict) applied to
    covrl.math losses when the batch has sampler log-probs; its mismatch metrics come back with every such call.
    `state_dir`: where `save_state(name)` writes `checkpoints/<name>/`.
    """

    def __init__(self, model, tokenizer, *, temperature: float = 1.0, correction: CorrectionConfig | dict | None = None,
                 micro_batch_size: int | None = None, share_prompts: bool = False,
                 sampler_config: SamplerConfig | None = None, seed: int = 0, state_dir: str | Path = "runs/api",
                 truncation: str = "auto"):
        self.model = model
        self.tokenizer = tokenizer
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("model: no trainable parameters (requires_grad=False everywhere)")
        self.temperature = float(temperature)
        self.correction = _as_correction(correction)
        if micro_batch_size is not None and micro_batch_size < 1:
            raise ValueError(f"micro_batch_size: must be >= 1 or None, got {micro_batch_size}")
        self.micro_batch_size = micro_batch_size
        self.share_prompts = share_prompts
        # a truncating sampler's kept sets, replayed by the trainer's forward unless truncation="full" (§12)
        self.truncation, self.replay = truncation_replay(sampler_config or SamplerConfig(temperature=self.temperature),
                                                         truncation)
        self.sampler_config = sampler_config or SamplerConfig(temperature=self.temperature)
        self.generator = torch.Generator().manual_seed(int(seed))
        self.state_dir = Path(state_dir)
        self.optimizer: torch.optim.Optimizer | None = None
        self.version = 0           # optimizer steps applied = the policy version a sampling client holds
        self._sampler = None
        self._warned_rules: set = set()   # per-call truncation the trainer does not replay, warned once each
        self.config: TrainConfig | None = None
        self.task = None
        self.stream: DataStream | None = None
        self.sft_metrics: dict[str, float] = {}
        self.trainer: Trainer | None = None   # from_run: the run's Trainer, which train_step drives

    @classmethod
    def from_config(cls, config: TrainConfig | str | Path = "tiny", overrides=None, *, warmup: bool = True,
                    lora_after_warmup: bool = False, state_dir: str | Path | None = None) -> TrainingClient:
        """The model (`model` section, LoRA included), task and prompt stream of a covrl config, set up as
        `covrl train` sets them up (same seeding order, the SFT warm-up when `sft_warmup.steps` > 0), with the
        config's sampler, temperature, correction, micro-batch size and prompt sharing. `.config`, `.task` and
        `.stream` are there for the loop. `lora_after_warmup`: the warm-up trains the full model (the stand-in
        for a pretrained base model) and the LoRA adapters are added after it (`covrl train` warms up the
        adapters only); the Tinker facade uses this."""
        cfg = fixed_sizes(resolve_config(config, overrides))   # a client has no run to probe: auto -> fallback
        lora = cfg.model.lora if lora_after_warmup and warmup and cfg.sft_warmup.steps > 0 else None
        if lora is not None:
            cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"lora": None})})
        c = build_components(cfg)   # as `covrl train` builds them
        model, tokenizer = c.model, c.tokenizer
        client = cls(model, tokenizer, temperature=cfg.sampler.temperature, correction=cfg.correction,
                     micro_batch_size=cfg.optim.micro_batch_size, share_prompts=cfg.optim.share_prompts,
                     sampler_config=cfg.sampler, seed=cfg.run.seed,
                     state_dir=state_dir or Path(cfg.run.output_dir) / f"{cfg.run.name}-api",
                     truncation=cfg.trainer.truncation)
        if warmup:
            client.sft_metrics = c.warm_up()
        sft = client.sft_metrics
        if lora is not None:
            with torch.random.fork_rng():   # adapter init from the seed, as load_model draws it
                torch.manual_seed(cfg.run.seed)
                model = apply_lora(model, lora)
            cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"lora": lora})})
            client = cls(model, tokenizer, temperature=client.temperature, correction=client.correction,
                         micro_batch_size=client.micro_batch_size, share_prompts=client.share_prompts,
                         sampler_config=client.sampler_config, seed=cfg.run.seed, state_dir=client.state_dir,
                         truncation=cfg.trainer.truncation)
            client.sft_metrics = sft
        client.config, client.task, client.stream = cfg, c.task, c.stream
        return client

    @classmethod
    def from_run(cls, run: Run) -> TrainingClient:
        """A client over a prepared covrl run (covrl.train.run.folder.prepare_run): the run's model, sampler (whatever
        `build_sampler_fn` made), sampling generator, task, stream and config, and its Trainer, which
        `train_step` drives. Such a client trains through `train_step` only (the Trainer owns the optimizer);
        sampling, `forward` and snapshots work as on any client. covrl.experiment.harness drives its arms so."""
        cfg = run.cfg
        client = cls(run.model, run.tokenizer, temperature=cfg.sampler.temperature, correction=cfg.correction,
                     micro_batch_size=cfg.optim.micro_batch_size, share_prompts=cfg.optim.share_prompts,
                     sampler_config=cfg.sampler, seed=cfg.run.seed, state_dir=Path(run.run_dir) / "api",
                     truncation=cfg.trainer.truncation)
        client._sampler, client.generator = run.sampler, run.generator   # the run's, so its draws are the run's
        client.config, client.task, client.stream = cfg, run.task, run.stream
        client.sft_metrics, client.trainer, client.version = run.sft_metrics, run.trainer, run.trainer.version
        return client

    def train_step(self, batch: ScoredBatch) -> StepResult:
        """One step of the config's whole algorithm on a scored batch: covrl.train.step.trainer.Trainer.step (the
        config's advantages, correction, loss, KL, diagnostics, clipping, lr schedule, AdamW), as `covrl train`
        takes it; `version` follows the Trainer. Clients from `from_run` only. The batch's tensors must be
        normal tensors (a sampler's inference-mode tensors: clone them) for the Trainer's autograd."""
        if self.trainer is None:
            raise RuntimeError("train_step: this client has no Trainer (TrainingClient.from_run gives one); use "
                               "forward_backward + optim_step")
        result = self.trainer.step(batch)
        self.version = self.trainer.version
        return result

    def _no_trainer(self, call: str) -> None:
        if self.trainer is not None:   # its optimizer would not see these gradients; the Trainer's own would
            raise RuntimeError(f"{call}: this client trains through train_step (its run's Trainer owns the "
                               f"optimizer and the gradients)")

    # ---------------------------------------------------------------------------------------- forward
    @property
    def device(self) -> torch.device:
        return self.params[0].device

    def _plan(self, rows: int) -> list[torch.Tensor]:
        size = self.micro_batch_size or rows
        return [torch.arange(s, min(s + size, rows), device=self.device) for s in range(0, rows, size)]

    def _forward(self, mb: TrainBatch):
        return forward_batch(self.model, mb, self.temperature, share_prompts=self.share_prompts,
                             truncation=self.truncation if self.replay else None, replay=self.replay)

    @torch.no_grad()
    def forward(self, batch: TrainBatch) -> ForwardResult:
        """Log-probs (and entropy, Σπ²) of the response tokens, no gradient: e.g. the inputs of OTB advantages."""
        batch = _check_batch(batch, self.device)
        rows, width = batch.response_ids.shape
        out = ForwardResult(*(torch.zeros((rows, width), device=self.device) for _ in range(3)))
        for idx in self._plan(rows):
            fwd = self._forward(batch.select(idx))
            out.logprobs[idx] = pad_cols(fwd.logprobs.float(), width)
            out.entropy[idx] = pad_cols(fwd.entropy, width)
            out.sum_pi_sq[idx] = pad_cols(fwd.sum_pi_sq, width)
        return out

    def forward_backward(self, batch: TrainBatch, loss_fn: str = "covariance", *,
                         loss_options: Mapping[str, Any] | None = None, agg_mode: str = "token-mean",
                         correction: CorrectionConfig | dict | None = None) -> ForwardBackwardResult:
        """One forward and backward over `batch`; the gradient is ADDED to the parameters' .grad.

        `loss_fn`: a name of `covrl.api.losses.API_LOSSES` (every covrl.math loss and Tinker's built-ins),
        `loss_options` its options (covrl.math: the registry's option names plus `norm_constant`; Tinker's:
        clip_low_threshold / clip_high_threshold / beta). `agg_mode` (covrl.math losses only, see
        covrl.math.aggregate). `correction` overrides the client's default for this call.
        """
        self._no_trainer("forward_backward")
        spec = get_loss(loss_fn)
        options = spec.check_options(dict(loss_options or {}))
        batch = _check_batch(batch, self.device)
        _check_inputs(spec, batch)
        corr_cfg = self.correction if correction is None else _as_correction(correction)
        rows, width = batch.response_ids.shape
        sampled_full = batch.sampled_mask
        has_q = batch.sampler_logprobs is not None
        corrected = has_q and spec.family == "covrl.math"   # Tinker's losses take the ratio as it is
        # batch-normalised IS weights need the whole batch's log-probs before any micro-batch's loss
        pre = rollout_correction(self.forward(batch).logprobs, batch.sampler_logprobs, sampled_full, corr_cfg,
                                 with_metrics=False) if corrected and corr_cfg.is_batch_normalize else None

        def loss(mb: TrainBatch, idx: torch.Tensor, fwd, prep: Prepared) -> LossTerms:
            x = LossInputs(logprobs=fwd.logprobs, sampler_logprobs=mb.sampler_logprobs, advantages=prep.advantages,
                           sampled=mb.sampled_mask, weights=mb.loss_weights, keep=prep.keep, is_weights=prep.weights)
            out = spec.fn(x, options)
            value = self._reduce(spec, out.token_loss, idx, sampled_full, agg_mode, options)
            metrics = dict(out.metrics)
            if spec.family == "covrl.math":
                metrics["loss/policy"] = float(value.detach())
            return LossTerms(value, metrics, out.token_loss)

        records = []
        self.model.train()
        for idx in self._plan(rows):
            mb = batch.select(idx)
            t = mb.response_ids.shape[1]
            given = None if pre is None else (pre.keep[idx][:, :t], pre.weights[idx][:, :t])
            rec = micro_step(mb, idx, forward=self._forward, loss=loss, tokens=mb.sampled_mask, full_mask=sampled_full,
                             prepare=functools.partial(_prepare, correction=corr_cfg if corrected else None,
                                                       given=given))
            if rec.bad is not None:
                raise FloatingPointError(f"forward_backward: {rec.bad} with loss_fn {loss_fn!r}; the gradient of "
                                         f"this micro-batch was not added")
            records.append(rec)
        step = collect(records, rows, width, self.device, token_loss=True)   # as the trainer folds its micro-batches
        metrics = step.metrics
        metrics["loss"] = step.loss
        if spec.family == "tinker":
            metrics["loss:sum"] = step.loss
        metrics["entropy"] = mean_over(step.entropy, sampled_full)
        if has_q:
            metrics.update(rollout_correction(step.logprobs, batch.sampler_logprobs, sampled_full, corr_cfg).metrics)
        return ForwardBackwardResult(step.logprobs, step.entropy, step.sum_pi_sq, loss=step.loss,
                                     token_loss=step.token_loss, metrics=metrics)

    def _reduce(self, spec: ApiLoss, token_loss: torch.Tensor, idx: torch.Tensor, sampled_full: torch.Tensor,
                agg_mode: str, options: Mapping[str, Any]) -> torch.Tensor:
        if spec.family == "tinker":
            return token_loss.sum()
        # this micro-batch's share of the full-call aggregate, with the Trainer's normaliser
        return micro_batch_share(token_loss, idx, sampled_full, lambda full, mask: aggregate(
            full, mask, agg_mode, norm_constant=options.get("norm_constant")))

    def forward_backward_custom(self, batch: TrainBatch,
                                fn: Callable[[TrainBatch, torch.Tensor], tuple[torch.Tensor, dict[str, float]]]
                                ) -> ForwardBackwardResult:
        """`fn(batch, logprobs [B, T] with gradient) -> (scalar loss, metrics)` on the whole batch at once (a
        custom loss may couple rows); its gradient is added to .grad."""
        self._no_trainer("forward_backward_custom")
        batch = _check_batch(batch, self.device)
        self.model.train()
        fwd = self._forward(batch)
        lp = pad_cols(fwd.logprobs, batch.response_ids.shape[1])
        result = fn(batch, lp)
        if not (isinstance(result, tuple) and len(result) == 2):
            raise TypeError("forward_backward_custom: fn must return (loss, metrics)")
        loss, user_metrics = result
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise TypeError("forward_backward_custom: fn's loss must be a scalar tensor")
        loss.backward()
        metrics = {**{k: float(v) for k, v in dict(user_metrics or {}).items()}, "loss": float(loss.detach())}
        sampled = batch.sampled_mask
        metrics["entropy"] = mean_over(fwd.entropy, sampled)
        if batch.sampler_logprobs is not None:
            metrics.update(rollout_correction(lp.detach(), batch.sampler_logprobs, sampled, self.correction).metrics)
        return ForwardBackwardResult(lp.detach(), fwd.entropy, fwd.sum_pi_sq, loss=float(loss.detach()),
                                     metrics=metrics)

    # -------------------------------------------------------------------------------------- optimizer
    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def optim_step(self, adam_params: AdamParams | None = None) -> OptimStepResult:
        """One AdamW step on the accumulated gradients with this call's hyper-parameters, then zero them.
        Global-norm clipping at adam_params.grad_clip_norm (0: none; the norm is reported either way). A
        non-finite gradient norm skips the update (metrics: skipped=1) and drops the gradients."""
        self._no_trainer("optim_step")
        p = adam_params or AdamParams()
        if not isinstance(p, AdamParams):
            raise TypeError(f"adam_params: expected covrl.api.AdamParams, got {type(p).__name__}")
        hyper = {"lr": float(p.learning_rate), "betas": (float(p.beta1), float(p.beta2)), "eps": float(p.eps),
                 "weight_decay": float(p.weight_decay)}
        if self.optimizer is None:
            self.optimizer = build_adamw(self.params, **hyper)
        for group in self.optimizer.param_groups:
            group.update(hyper)
        max_norm = float(p.grad_clip_norm) if p.grad_clip_norm > 0 else math.inf
        grads = [q for q in self.params if q.grad is not None]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm)) if grads else 0.0
        metrics = {"grad_norm": grad_norm, "lr": hyper["lr"]}
        if not math.isfinite(grad_norm):
            self.zero_grad()
            return OptimStepResult(self.version, {**metrics, "skipped": 1.0})
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        return OptimStepResult(self.version, {**metrics, "skipped": 0.0, "version": float(self.version)})

    # ------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": None if self.optimizer is None else self.optimizer.state_dict(),
                "version": self.version, "generator": self.generator.get_state()}

    def save_state(self, name: str) -> Path:
        """Weights, optimizer state, version and the sampling generator as an atomic covrl checkpoint
        (covrl.train.run.checkpoint: COMPLETE marker last) at `<state_dir>/checkpoints/<name>/`; returns its path."""
        _check_name(name)
        return save_checkpoint(self.state_dir, name, model=self.model, tokenizer=self.tokenizer,
                                    state={"format": 1, STATE_KEY: self.state_dict()},
                                    info={"policy_version": self.version})

    def load_state(self, path: str | Path, *, optimizer: bool = True) -> None:
        """Restore a `save_state` checkpoint (a path, or a name under `<state_dir>/checkpoints/`): the weights
        always, the optimizer state, version and generator with `optimizer=True` (bit-exact round trip)."""
        path = Path(path)
        if not path.is_dir() and (self.state_dir / "checkpoints" / path).is_dir():
            path = self.state_dir / "checkpoints" / path
        state = load_checkpoint_state(path)
        if STATE_KEY not in state:
            raise CheckpointError(f"{path}: not a covrl.api checkpoint (no {STATE_KEY!r} state)")
        apply_model_weights(self.model, read_model_weights(self.model, path / MODEL_DIR))
        self.zero_grad()
        if optimizer:
            s = state[STATE_KEY]
            if s["optimizer"] is not None:
                if self.optimizer is None:
                    self.optimizer = build_adamw(self.params, lr=0.0)
                self.optimizer.load_state_dict(s["optimizer"])
            else:
                self.optimizer = None
            self.version = int(s["version"])
            self.generator.set_state(s["generator"])
        if self._sampler is not None:
            self._sampler.load_weights(self.model, self.version)

    # --------------------------------------------------------------------------------------- sampling
    @property
    def sampler(self):
        """The sampler backend of `sampler_config` (hf, or vllm when configured), built on first use."""
        if self._sampler is None:
            self._sampler = build_sampler(self.sampler_config, self.model, self.tokenizer)
        return self._sampler

    def save_weights_and_get_sampling_client(self, name: str | None = None) -> SamplingClient:
        """Push the current weights into the sampler (version = optimizer steps so far) and return a client
        bound to that version. `name` labels it (nothing is written: `save_weights_for_sampler` keeps a version
        to sample later, save_state writes checkpoints)."""
        self.sampler.load_weights(self.model, self.version)
        return SamplingClient(self, self.version, name)

    def save_weights_for_sampler(self, name: str) -> Path:
        """Keep the current weights (adapters for LoRA) as an atomic snapshot at
        `<state_dir>/sampler/checkpoints/<name>/` and push them into the sampler; returns its path.
        `create_sampling_client(name)` samples from it later, whatever version is current then."""
        _check_name(name)
        self.sampler.load_weights(self.model, self.version)
        return save_checkpoint(self.state_dir / SNAPSHOT_DIR, name, model=self.model,
                                    state={"format": 1, "version": self.version},
                                    info={"policy_version": self.version})

    def create_sampling_client(self, snapshot: str | Path) -> SamplingClient:
        """A client bound to a `save_weights_for_sampler` snapshot (its path, or its name): its samples come
        from that version's weights even after newer ones were pushed (see SamplingClient)."""
        path = Path(snapshot)
        if not path.is_dir() and (self.state_dir / SNAPSHOT_DIR / "checkpoints" / path).is_dir():
            path = self.state_dir / SNAPSHOT_DIR / "checkpoints" / path
        state = load_checkpoint_state(path)   # refuses an incomplete folder
        if "version" not in state:
            raise CheckpointError(f"{path}: not a save_weights_for_sampler snapshot (no version)")
        return SamplingClient(self, int(state["version"]), path.name, snapshot=path)

    def holding(self, weights: dict[str, torch.Tensor], version: int) -> contextlib.AbstractContextManager:
        """The model and the sampler hold `weights` (as read by covrl.train.run.checkpoint.read_model_weights) for
        the duration; then the trainable parameters (all that an optimizer step changes) are restored bit for
        bit and the sampler gets the current weights again (it holds version `self.version` after)."""
        return self.holding_while(lambda: apply_model_weights(self.model, weights), version)

    @contextlib.contextmanager
    def holding_while(self, load: Callable[[], None], version: int) -> Iterator[None]:
        """`load()` puts other weights of `version` into the model for the duration (see `holding`); the
        trainable parameters are restored bit for bit after and the sampler gets the current weights again."""
        current = [p.detach().clone() for p in self.params]
        try:
            with torch.no_grad():
                load()
            self.sampler.load_weights(self.model, version)
            yield
        finally:
            with torch.no_grad():
                for p, saved in zip(self.params, current):
                    p.copy_(saved)
            self.sampler.load_weights(self.model, self.version)

    def get_tokenizer(self):
        return self.tokenizer

    def check_sampling_rule(self, rule) -> None:
        """Warn once per rule when samples are drawn with a truncation this client's forward does not replay:
        their log q is that of the truncated q, so an IS ratio against the full softmax carries the kept mass
        S_t on every token (docs/theory.md §12)."""
        replayed = self.truncation if self.replay else None
        # truncation="full" with the client's own rule is the user's explicit choice, not a surprise
        if (rule if rule.active else None) in (replayed, self.truncation) or rule in self._warned_rules:
            return
        self._warned_rules.add(rule)
        have = f"replays {replayed}" if replayed is not None else "scores the full softmax"
        warnings.warn(f"sampling with {rule} while this training client {have}: importance ratios on these "
                      f"samples are biased by the kept mass (docs/theory.md §12); build the training client with "
                      f"the same sampler.top_k / top_p / min_p to replay the kept sets", stacklevel=3)


class SamplingClient:
    """Samples from the weights of one version. A client of the pushed weights
    (`save_weights_and_get_sampling_client`) used after newer weights were pushed (another push, or an
    optim_step while the sampler shares the trainer's module) raises StaleSamplingClientError rather than
    silently sampling from other weights. A client of a snapshot (`create_sampling_client`, `snapshot` set)
    never goes stale: each `sample` call swaps the snapshot's weights in (`TrainingClient.holding`), samples,
    and restores the current ones; the snapshot is read from disk once, on first use."""

    def __init__(self, owner: TrainingClient, version: int, name: str | None = None, *,
                 snapshot: Path | None = None):
        self.owner = owner
        self.version = int(version)
        self.name = name
        self.snapshot = snapshot
        self._weights: dict[str, torch.Tensor] | None = None

    def _check_fresh(self) -> None:
        if self.snapshot is not None:
            return
        sampler = self.owner.sampler
        live = sampler.version if not getattr(sampler, "shares_weights", False) else self.owner.version
        if sampler.version != self.version or live != self.version:
            raise StaleSamplingClientError(
                f"this sampling client holds weights version {self.version}, the sampler now holds "
                f"{live}: call save_weights_and_get_sampling_client() again")

    def sample(self, prompts: list[int] | list[list[int]], num_samples: int = 1,
               sampling_params: SamplingParams | None = None, *, greedy: bool = False) -> SampleResult:
        """`num_samples` completions of each prompt (one prompt as a list of ids, or a list of them), in one
        batched generate call. Returns the tokens, the sampler's log q of each drawn token and the batch."""
        self._check_fresh()
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompt: a non-empty list of token ids (or a list of such lists)")
        many = isinstance(prompts[0], (list, tuple))
        rows = [list(map(int, p)) for p in prompts] if many else [list(map(int, prompts))]
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"num_samples: must be an int >= 1, got {num_samples!r}")
        sampler = self.owner.sampler
        params = sampling_params or SamplingParams()
        update = _sampler_update(params, sampler)
        generator = torch.Generator().manual_seed(int(params.seed)) if params.seed is not None \
            else self.owner.generator
        old = sampler.cfg
        sampler.cfg = old.model_copy(update=update) if update else old
        if not greedy:
            self.owner.check_sampling_rule(truncation_rule(sampler.cfg))
        try:
            with self._weights_held():
                batch = sampler.generate(rows, num_samples, generator=generator, policy_version=self.version,
                                         greedy=greedy)
        finally:
            sampler.cfg = old
        stop_ids = set(getattr(sampler, "eos_ids", [])) | set(update.get("stop_token_ids", []))
        stop_strings = update.get("stop_strings", [])
        sequences = []
        for i in range(len(batch)):
            n = int(batch.response_mask[i].sum())
            tokens = batch.response_ids[i, :n].tolist()
            stopped = bool(tokens) and (tokens[-1] in stop_ids or (bool(stop_strings) and any(
                s in self.owner.tokenizer.decode(tokens, skip_special_tokens=True) for s in stop_strings)))
            sequences.append(SampledSequence(tokens=tokens, logprobs=batch.sampler_logprobs[i, :n].tolist(),
                                             stop_reason="stop" if stopped else "length",
                                             prompt_index=i // num_samples))
        return SampleResult(sequences=sequences, batch=batch, version=self.version)

    def _weights_held(self) -> contextlib.AbstractContextManager:
        if self.snapshot is None:
            return contextlib.nullcontext()
        if self._weights is None:
            self._weights = read_model_weights(self.owner.model, self.snapshot / MODEL_DIR)
        return self.owner.holding(self._weights, self.version)

    def get_tokenizer(self):
        return self.owner.tokenizer


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
        raise ValueError(f"name: a plain folder name is needed, got {name!r}")


def _sampler_update(params: SamplingParams, sampler) -> dict[str, Any]:
    update: dict[str, Any] = {}
    if params.max_tokens is not None:
        if params.max_tokens < 1:
            raise ValueError(f"sampling_params.max_tokens: must be >= 1, got {params.max_tokens}")
        update["max_new_tokens"] = int(params.max_tokens)
    if params.temperature is not None:
        if not params.temperature > 0:
            raise ValueError(f"sampling_params.temperature: must be > 0 (greedy=True for argmax), got "
                             f"{params.temperature}")
        update["temperature"] = float(params.temperature)
    if params.top_k is not None:
        update["top_k"] = 0 if params.top_k in (-1, 0) else int(params.top_k)
    if params.top_p is not None:
        update["top_p"] = float(params.top_p)
    if params.stop:
        stop = [params.stop] if isinstance(params.stop, (str, int)) else list(params.stop)
        if any(not isinstance(s, (str, int)) or isinstance(s, bool) for s in stop):
            raise ValueError(f"sampling_params.stop: strings or token ids, got {stop!r}")
        update["stop_strings"] = [s for s in stop if isinstance(s, str)]
        update["stop_token_ids"] = [int(s) for s in stop if isinstance(s, int)]
    return update


def _prepare(mb: TrainBatch, fwd, *, correction: CorrectionConfig | None,
             given: tuple[torch.Tensor, torch.Tensor] | None) -> Prepared:
    """The micro-step's prepared quantities of a call's rows: the advantages the batch carries and, for a
    covrl.math loss on sampled rows (`correction`), the rollout correction's keep-mask and IS weights (with
    correction.is_level): `given` by the call's pre-pass, or from this micro-batch's own log-probs."""
    sampled = mb.sampled_mask
    advantages = None if mb.advantages is None else mb.advantages.float()
    if correction is None:
        return Prepared(advantages, None, sampled)
    if given is None:
        corr = rollout_correction(fwd.logprobs.detach(), mb.sampler_logprobs.float(), sampled, correction,
                                  with_metrics=False)
        given = (corr.keep, corr.weights)
    keep, weights = given
    return Prepared(advantages, weights if correction.is_level is not None else None, keep)


def _as_correction(c: CorrectionConfig | dict | None) -> CorrectionConfig:
    if c is None:
        return CorrectionConfig()
    return CorrectionConfig(**c) if isinstance(c, dict) else c


def _check_batch(batch: TrainBatch, device: torch.device) -> TrainBatch:
    if not isinstance(batch, TrainBatch):
        raise TypeError(f"batch: expected covrl.api.TrainBatch, got {type(batch).__name__}")
    moved = {k: getattr(batch, k).to(device) for k in ("prompt_ids", "prompt_mask", "response_ids",
                                                       "response_mask", "sampler_logprobs", "advantages",
                                                       "weights", "sampled") if getattr(batch, k) is not None}
    return TrainBatch(**moved)


def _check_inputs(spec: ApiLoss, batch: TrainBatch) -> None:
    missing = [k for k in sorted(spec.requires) if getattr(batch, k) is None]
    if missing:
        raise ValueError(f"loss_fn {spec.name!r} needs the batch field(s) {missing} (TrainBatch."
                         f"{missing[0]} is None)")
