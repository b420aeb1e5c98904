"""Sizing a run from the sampler (docs/theory.md §15, docs/training.md "Sizing a run from the sampler").

`sampler.max_new_tokens`, `loop.group_size` and `loop.prompts_per_step` accept `auto`. Before step 1 of a fresh
run, a probe samples the model RL starts from (after the SFT warm-up) on `sizing.probe_prompts` training prompts x
`sizing.probe_samples` completions at a generous budget `sizing.probe_max_new_tokens`, with the run's sampler
settings, and a rule turns what it measured into numbers:

    max_new_tokens  the `length_quantile` of the response lengths (a cut sample counts as the cap) x
                    `length_headroom`, rounded up to a multiple of 8, within [8, cap]; the cap itself once more
                    than 1 - length_quantile of the samples are cut (a warning when `cut_warning` of them are)
    group_size      the smallest G of `group_sizes` (<= rollouts_per_step) whose predicted fraction of constant
                    groups is <= `constant_target`, else the G that minimises it (a warning); the smallest G
                    (a warning) when no probe sample was correct, or every one was
    prompts_per_step  max(1, rollouts_per_step // group_size)

The predicted fraction of constant groups of G is the posterior predictive probability that G new samples of a
prompt all get the same reward, averaged over the probed prompts: binary rewards under a Beta prior on the
prompt's pass rate with `prior`'s strength and the task's pooled probe pass rate as its mean (`pooled_prior`),
other rewards under a Dirichlet process with concentration sum(`prior`) over the rewards seen.

The run folder keeps the evidence and the choices (`sizing.json`) and the resolved config (config.yaml, numbers
only); `--resume` takes the numbers from sizing.json and never probes again. With `sizing.adapt`, an `auto`
max_new_tokens grows by `adapt_factor` (up to the probe's cap) after `adapt_steps` steps in a row that cut more
than `adapt_cut_rate` of their responses; the current value is checkpointed with the run (exact resume) and
logged as `sizing/max_new_tokens`. With auto loop.group_size and loop.prompts_per_step, every `adapt_group_steps`
steps the group-size rule is applied again to the rewards of those steps' groups, and a new G keeps the rollouts per
step (`sizing/group_size`, `sizing/prompts_per_step`). A value the user typed is never changed.

The rule is a set of pure functions of the evidence (`choose_max_new_tokens`, `choose_group_size`,
`predicted_constant_fraction`); `size_run` is the part that samples and writes."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from pydantic import Field, field_validator, model_validator

from covrl.settings import Section, dump_config
from covrl.train.run.sources import score_rollouts

if TYPE_CHECKING:   # the run's config composes this section: imported for types only
    from covrl.train.config import TrainConfig

__all__ = ["AUTO", "AUTO_FIELDS", "ProbeEvidence", "SizingAdapter", "SizingConfig", "SizingDecision",
           "auto_fields", "check_sizable", "choose_group_size", "choose_max_new_tokens", "decide",
           "pooled_prior", "predicted_constant_fraction", "probe_record", "prompt_constant_probability", "size_run"]

AUTO = "auto"
# the fields the probe can size: (section, field)
AUTO_FIELDS = (("sampler", "max_new_tokens"), ("loop", "group_size"), ("loop", "prompts_per_step"))
SIZING_FILE = "sizing.json"
PROBE_SEED_OFFSET = 7_919   # the probe's own generator: the run's generator and stream stay untouched
ROUND_TO = 8
MIN_TOKENS = 8


class SizingConfig(Section):
    """How a run sizes the fields set to `auto` (sampler.max_new_tokens, loop.group_size, loop.prompts_per_step)
    from a probe of its sampler before step 1 (docs/training.md, 'Sizing a run from the sampler')."""

    rollouts_per_step: int = Field(16, ge=1, le=1_000_000, description="rollouts per step when loop.group_size "
                                   "or loop.prompts_per_step is auto: group_size <= this, prompts_per_step = "
                                   "max(1, this // group_size)")
    probe_prompts: int = Field(16, ge=1, le=4096, description="training prompts the probe samples (the stream's "
                               "first ones; the stream does not advance)")
    probe_samples: int = Field(4, ge=2, le=256, description="completions per probed prompt")
    probe_max_new_tokens: int = Field(128, ge=MIN_TOKENS, le=65536, description="the probe's budget (the cap of "
                                      "an auto max_new_tokens; lowered to fit the model's context)")
    length_quantile: float = Field(0.95, gt=0.0, le=1.0, description="quantile of the probed response lengths "
                                   "that max_new_tokens covers (a cut sample counts as the cap)")
    length_headroom: float = Field(1.25, ge=1.0, le=10.0, description="max_new_tokens = quantile x this, rounded "
                                   "up to a multiple of 8")
    group_sizes: list[int] = Field(default_factory=lambda: [4, 8, 16], min_length=1, description="candidate "
                                   "group sizes, the smallest whose predicted constant fraction is <= "
                                   "constant_target wins")
    constant_target: float = Field(0.5, gt=0.0, lt=1.0, description="the predicted fraction of constant groups "
                                   "(equal rewards, no gradient) a group size must reach")
    prior: tuple[float, float] = Field((0.5, 0.5), description="Beta prior of a prompt's pass rate (binary "
                                       "rewards): strength a + b, mean (S + a) / (N + a + b) over the probe's N "
                                       "samples, S correct; other rewards: a Dirichlet process of concentration a + b")
    cut_warning: float = Field(0.5, gt=0.0, le=1.0, description="warn when this fraction of the probe's samples "
                               "reaches the probe's budget")
    adapt: bool = Field(True, description="while the run goes: raise an auto max_new_tokens when steps keep "
                        "cutting answers (up to the probe's budget), and re-choose an auto group_size from the "
                        "recent steps' groups; a typed value is never changed")
    adapt_cut_rate: float = Field(0.5, gt=0.0, le=1.0, description="a step whose response/at_max_frac exceeds "
                                  "this counts towards adapting")
    adapt_steps: int = Field(2, ge=1, le=1000, description="consecutive such steps before max_new_tokens grows")
    adapt_factor: float = Field(1.5, gt=1.0, le=16.0, description="max_new_tokens grows by this factor (rounded "
                                "up to a multiple of 8)")
    adapt_group_steps: int = Field(3, ge=1, le=1000, description="auto loop.group_size and prompts_per_step: "
                                   "every this many steps, group_sizes' rule applied to those steps' groups")

    @field_validator("group_sizes")
    @classmethod
    def _sizes(cls, v: list[int]) -> list[int]:
        if any(g < 2 for g in v) or len(set(v)) != len(v) or v != sorted(v):
            raise ValueError(f"sizing.group_sizes must be distinct, increasing and >= 2 (a group of 1 has no "
                             f"baseline), got {v}")
        return v

    @field_validator("prior")
    @classmethod
    def _prior(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(x > 0 and math.isfinite(x) for x in v):
            raise ValueError(f"sizing.prior must be two positive numbers, got {v}")
        return v

    @model_validator(mode="after")
    def _budget(self):
        if self.rollouts_per_step < self.group_sizes[0]:
            raise ValueError(f"sizing.rollouts_per_step={self.rollouts_per_step} is below the smallest of "
                             f"sizing.group_sizes={self.group_sizes}")
        return self


# ------------------------------------------------------------------------------------------- the rule


def prompt_constant_probability(rewards: Sequence[float], group_size: int, prior: tuple[float, float],
                                binary: bool) -> float:
    """P(group_size new samples of a prompt all get the same reward | the probe's `rewards` of that prompt), the
    posterior predictive. Binary rewards: p ~ Beta(a + s, b + m - s) and E[p^G + (1 - p)^G], a product of Pólya-urn
    ratios. Other rewards: a Dirichlet process of concentration a + b over the values seen (a value seen c times,
    of m, repeats G times with probability prod_t (c + t) / (m + α + t); one new value G times with
    α / (m + α) · prod_{t>=1} t / (m + α + t))."""
    m, G = len(rewards), int(group_size)
    if binary:
        a, b = prior
        s = sum(1 for r in rewards if r >= 1.0)
        both = (a + s, b + m - s)
        return sum(math.prod((c + t) / (a + b + m + t) for t in range(G)) for c in both)
    alpha = prior[0] + prior[1]
    seen = sum(math.prod((c + t) / (m + alpha + t) for t in range(G)) for c in Counter(rewards).values())
    new = alpha / (m + alpha) * math.prod(t / (m + alpha + t) for t in range(1, G))
    return seen + new


def rewards_are_binary(groups: Sequence[Sequence[float]]) -> bool:
    return all(r in (0.0, 1.0) for g in groups for r in g)


def pooled_prior(groups: Sequence[Sequence[float]], prior: tuple[float, float]) -> tuple[float, float]:
    """The Beta prior of one prompt's pass rate (binary rewards): the strength a + b of `prior`, its mean the
    task's pooled pass rate (S + a) / (N + a + b) over all N probe samples, S of them correct. The prompts are
    drawn from one task: a prompt never solved where no other prompt was solved either is unlikely to be solved
    (with `prior` itself, 16 prompts x 0 of 4 predict 46% constant groups of 16; pooled, 99%). At a pooled rate of
    one half it is `prior`."""
    n = sum(len(g) for g in groups)
    if not n:
        return prior
    a, b = prior
    mean = (sum(1 for g in groups for r in g if r >= 1.0) + a) / (n + a + b)
    return (a + b) * mean, (a + b) * (1.0 - mean)


def predicted_constant_fraction(groups: Sequence[Sequence[float]], group_size: int,
                                prior: tuple[float, float] = (0.5, 0.5)) -> float:
    """The expected fraction of constant groups of `group_size` over the probed prompts (`groups`: each prompt's
    probe rewards); binary rewards under the pooled prior (`pooled_prior`)."""
    binary = rewards_are_binary(groups)
    if binary:
        prior = pooled_prior(groups, prior)
    return sum(prompt_constant_probability(g, group_size, prior, binary) for g in groups) / max(len(groups), 1)


def choose_group_size(groups: Sequence[Sequence[float]], candidates: Sequence[int], budget: int, target: float,
                      prior: tuple[float, float] = (0.5, 0.5)) -> tuple[int, dict[int, float], str | None]:
    """(G, predicted constant fraction of each candidate <= budget, warning or None): the smallest candidate
    whose prediction is <= target, else the one that minimises it (the largest on ties) with a warning. Binary
    rewards all wrong (or all right) in the probe: the smallest candidate with a warning, since at a pass rate p
    near 0 a step of R rollouts has about R·p groups with contrast whatever G is, and a larger G only takes
    prompts from the step."""
    allowed = [g for g in candidates if g <= budget] or [min(candidates)]
    predicted = {g: predicted_constant_fraction(groups, g, prior) for g in allowed}
    binary = rewards_are_binary(groups)
    why = ""
    if binary and all(r < 1.0 for g in groups for r in g):
        why = "no probe sample was correct"
    elif binary and all(r >= 1.0 for g in groups for r in g):
        why = "every probe sample was correct"
    if why:
        best = allowed[0]
        return best, predicted, (f"{why}: no group size gives contrast (loop.group_size={best}, the smallest, keeps "
                                 f"the most prompts per step; an expected {predicted[best]:.1%} of the groups "
                                 "constant); an easier task, an SFT warm-up or a prompt that asks for the bare "
                                 "answer would help")
    for g in allowed:
        if predicted[g] <= target:
            return g, predicted, None
    best = min(allowed, key=lambda g: (predicted[g], -g))
    return best, predicted, (f"even loop.group_size={best} leaves an expected {predicted[best]:.0%} of the "
                             f"groups constant (target {target:.0%}): most steps will carry little gradient; an "
                             "easier task, an SFT warm-up or a larger sizing.rollouts_per_step would help")


def nearest_rank(values: Sequence[int], q: float) -> int:
    """The q-quantile by nearest rank: the smallest value with at least a fraction q of `values` at or below."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def round_up(n: float, multiple: int = ROUND_TO) -> int:
    return int(math.ceil(n / multiple) * multiple)


def choose_max_new_tokens(lengths: Sequence[int], cap: int, *, quantile: float = 0.95, headroom: float = 1.25,
                          floor: int = MIN_TOKENS, cut_warning: float = 0.5) -> tuple[int, float, str | None]:
    """(max_new_tokens, fraction of samples cut at `cap`, warning or None). A sample of length >= cap was cut:
    it counts as cap in the quantile (a censored length), so more cut samples never give a smaller budget."""
    if not lengths:
        raise ValueError("choose_max_new_tokens: no probe lengths")
    censored = [min(int(n), cap) for n in lengths]
    cut = sum(1 for n in censored if n >= cap) / len(censored)
    q = nearest_rank(censored, quantile)
    tokens = cap if q >= cap else min(cap, round_up(max(floor, MIN_TOKENS, q * headroom)))
    warning = None
    if cut >= cut_warning:
        warning = (f"{cut:.0%} of the probe's samples reached its budget of {cap} tokens: answers may be longer "
                   f"still; max_new_tokens = {cap} (raise sizing.probe_max_new_tokens, or set "
                   "sampler.max_new_tokens)")
    return max(min(tokens, cap), 1), cut, warning


# ---------------------------------------------------------------------------------------- evidence


@dataclass(frozen=True)
class ProbeEvidence:
    """What the probe measured: each sample's response length (tokens, `cap` = cut), each prompt's rewards and
    verdicts (correct = reward >= 1 or the task's grader)."""

    lengths: list[int]
    cap: int
    rewards: list[list[float]]
    correct: list[list[bool]]

    def summary(self, quantile: float) -> dict[str, Any]:
        finished = [n for n in self.lengths if n < self.cap]
        right = [n for n, ok in zip(self.lengths, (c for g in self.correct for c in g)) if ok and n < self.cap]
        pass_rates = [sum(c) / len(c) for c in self.correct]
        variances = [sum((r - sum(g) / len(g)) ** 2 for r in g) / len(g) for g in self.rewards]
        return {
            "prompts": len(self.rewards), "samples_per_prompt": len(self.rewards[0]) if self.rewards else 0,
            "cap": self.cap, "cut_frac": sum(1 for n in self.lengths if n >= self.cap) / max(len(self.lengths), 1),
            "length_to_eos": ({"mean": sum(finished) / len(finished), "p50": nearest_rank(finished, 0.5),
                               f"p{round(100 * quantile)}": nearest_rank(finished, quantile), "max": max(finished)}
                              if finished else None),
            # the lengths that earned a correct verdict: how much of the budget the answers that count need
            "length_correct": ({"p50": nearest_rank(right, 0.5), f"p{round(100 * quantile)}":
                                nearest_rank(right, quantile), "max": max(right), "samples": len(right)}
                               if right else None),
            "pass_rate_mean": sum(pass_rates) / max(len(pass_rates), 1),
            "prompts_all_wrong": sum(1 for p in pass_rates if p == 0.0),
            "prompts_all_right": sum(1 for p in pass_rates if p == 1.0),
            "reward_variance_within_mean": sum(variances) / max(len(variances), 1),
            "rewards_binary": rewards_are_binary(self.rewards),
        }


@dataclass(frozen=True)
class SizingDecision:
    resolved: dict[str, int]                     # "sampler.max_new_tokens" -> 24, ... (the auto fields only)
    predicted_constant: dict[int, float]
    cut_frac: float
    warnings: list[str]


def auto_fields(cfg: TrainConfig) -> list[str]:
    """The dotted names of the fields set to auto."""
    return [f"{s}.{f}" for s, f in AUTO_FIELDS if getattr(getattr(cfg, s), f) == AUTO]


def decide(evidence: ProbeEvidence, cfg: TrainConfig) -> SizingDecision:
    """The rule applied to the probe's evidence, for the fields of `cfg` that are auto."""
    scfg, auto = cfg.sizing, auto_fields(cfg)
    resolved: dict[str, int] = {}
    warnings: list[str] = []
    floor = _overlong_floor(cfg)
    tokens, cut, warning = choose_max_new_tokens(evidence.lengths, evidence.cap, quantile=scfg.length_quantile,
                                                 headroom=scfg.length_headroom, floor=floor,
                                                 cut_warning=scfg.cut_warning)
    if "sampler.max_new_tokens" in auto:
        resolved["sampler.max_new_tokens"] = tokens
        warnings += [warning] if warning else []
    group = cfg.loop.group_size
    predicted: dict[int, float] = {}
    if "loop.group_size" in auto:
        group, predicted, warning = choose_group_size(evidence.rewards, scfg.group_sizes, scfg.rollouts_per_step,
                                                      scfg.constant_target, scfg.prior)
        resolved["loop.group_size"] = group
        warnings += [warning] if warning else []
        if not rewards_are_binary(evidence.rewards) and not any(c for g in evidence.correct for c in g):
            # graded rewards vary between wrong answers of different forms: the prediction counts that contrast
            warnings.append("no probe sample was correct (the task's grader): the groups' contrast is between "
                            "partial-credit rewards of wrong answers, not between right and wrong; an SFT warm-up "
                            "or a prompt that asks for the bare answer would help")
    else:
        predicted = {group: predicted_constant_fraction(evidence.rewards, group, scfg.prior)}
    if "loop.prompts_per_step" in auto:
        resolved["loop.prompts_per_step"] = max(1, scfg.rollouts_per_step // group)
    return SizingDecision(resolved, predicted, cut, warnings)


def _overlong_floor(cfg: TrainConfig) -> int:
    """A budget below the overlong penalty's buffer (which counts towards max_new_tokens when its own
    max_tokens is unset) would be refused: the floor of an auto max_new_tokens."""
    overlong = cfg.task.overlong_reward
    return overlong.buffer + 1 if overlong.buffer > 0 and overlong.max_tokens is None else MIN_TOKENS


# ------------------------------------------------------------------------------------- the config side


def check_sizable(cfg: TrainConfig) -> None:
    """Raise a ValueError naming the field when `auto` is set where this release cannot size it (the probe
    runs in the sync loop's process, single-turn, on the hf sampler, one trainer)."""
    auto = auto_fields(cfg)
    if not auto:
        return
    first = auto[0]
    why = ("loop.mode=" + cfg.loop.mode if cfg.loop.mode != "sync" else
           "trainer.parallel=" + cfg.trainer.parallel if cfg.trainer.parallel != "none" else
           "sampler.backend=" + cfg.sampler.backend if cfg.sampler.backend != "hf" else
           "task.env.name=" + cfg.task.env.name if cfg.task.env.name else
           "task.name=verifiers" if cfg.task.name == "verifiers" else None)
    if why:
        raise ValueError(f"{first}=auto is sized by a probe of the sync loop's hf sampler on single-turn "
                         f"completions, with one trainer; this run has {why}: give {', '.join(auto)} a number")


def resolve_config(cfg: TrainConfig, resolved: dict[str, int]) -> TrainConfig:
    """`cfg` with the dotted fields of `resolved` set, validated whole again (the checks that skipped auto run)."""
    data = cfg.model_dump()
    for dotted, value in resolved.items():
        section, name = dotted.split(".")
        data[section][name] = int(value)
    return type(cfg).model_validate(data)


# ------------------------------------------------------------------------------------------- the probe


def _probe(cfg: TrainConfig, c, build_sampler_fn) -> ProbeEvidence:
    """Sample the model RL starts from on the stream's next `probe_prompts` prompts (the stream does not advance),
    `probe_samples` each, with the run's sampler settings at the probe's budget, and score them."""
    scfg, stream, task, tokenizer = cfg.sizing, c.stream, c.task, c.tokenizer
    k = min(scfg.probe_prompts, len(stream.items))
    examples = [stream.items[stream.index_at(p)] for p in range(stream.position, stream.position + k)]
    prompts = [task.encode(tokenizer, ex) for ex in examples]
    context = getattr(getattr(c.model, "config", None), "max_position_embeddings", None)
    cap = scfg.probe_max_new_tokens
    if context:   # the prompt and the response fit the model's positions
        cap = min(cap, int(context) - max(len(p) for p in prompts))
    if cap < MIN_TOKENS:
        raise ValueError(f"sizing: the model's context ({context} positions) leaves {cap} tokens after the longest "
                         f"probed prompt; set sampler.max_new_tokens to a number")
    sampler = build_sampler_fn(cfg.sampler.model_copy(update={"max_new_tokens": cap}), c.model, tokenizer)
    budget = task.response_budget
    task.response_budget = cap   # the overlong penalty (if any) counts towards the probe's budget meanwhile
    try:
        generator = torch.Generator().manual_seed(cfg.run.seed + PROBE_SEED_OFFSET)
        batch = sampler.generate(prompts, scfg.probe_samples, generator=generator, policy_version=0)
        scored = score_rollouts(task, tokenizer, batch, examples, scfg.probe_samples)
    finally:
        task.response_budget = budget
        del sampler
    m = scfg.probe_samples
    rewards = scored.sequence_rewards.tolist()
    correct = [bool(x) for x in (scored.correct if scored.correct is not None else [r >= 1.0 for r in rewards])]
    lengths = [int(n) for n in batch.response_mask.sum(1).tolist()]
    return ProbeEvidence(lengths=lengths, cap=cap, rewards=[rewards[i * m:(i + 1) * m] for i in range(k)],
                         correct=[correct[i * m:(i + 1) * m] for i in range(k)])


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def describe(record: dict[str, Any]) -> str:
    """The compact block printed at the start of a sized run."""
    ev, res, pred = record["evidence"], record["resolved"], record["predicted_constant"]
    lengths = ev["length_to_eos"]
    q = f"p{round(100 * record['rule']['length_quantile'])}"
    lines = [f"sizing: probe of {ev['prompts']} prompts x {ev['samples_per_prompt']} samples at up to {ev['cap']} "
             f"tokens ({record['time/probe_s']:.1f} s)"]
    length = (f"lengths to EOS p50 {lengths['p50']} / {q} {lengths[q]} / max {lengths['max']}" if lengths
              else "no sample ended before the budget")
    lines.append(f"  {length}, {ev['cut_frac']:.0%} cut -> sampler.max_new_tokens="
                 f"{res.get('sampler.max_new_tokens', 'as set')}")
    constant = ", ".join(f"G={g} {p:.0%}" for g, p in pred.items())
    lines.append(f"  pass rate {ev['pass_rate_mean']:.0%} ({ev['prompts_all_wrong']} prompts all wrong, "
                 f"{ev['prompts_all_right']} all right); constant groups predicted {constant}")
    lines.append(f"  -> loop.group_size={record['config']['loop.group_size']}, loop.prompts_per_step="
                 f"{record['config']['loop.prompts_per_step']}")
    return "\n".join(lines)


def probe_record(cfg: TrainConfig, c, build_sampler_fn) -> tuple[dict[str, Any], SizingDecision]:
    """The probe and the rule, nothing written and nothing trained: (the sizing record as sizing.json holds it,
    less the resolved config, and the decision). `c`: the run's components (build_components(cfg), after any SFT
    warm-up). Studies call it to see what `auto` would choose without a run."""
    t0, cpu0 = time.perf_counter(), time.process_time()
    evidence = _probe(cfg, c, build_sampler_fn)
    decision = decide(evidence, cfg)
    record = {"auto": auto_fields(cfg), "resolved": decision.resolved,
              "evidence": evidence.summary(cfg.sizing.length_quantile),
              "predicted_constant": {str(g): p for g, p in decision.predicted_constant.items()},
              "warnings": decision.warnings, "time/probe_s": time.perf_counter() - t0,
              "time/probe_cpu_s": time.process_time() - cpu0, "rule": cfg.sizing.model_dump(mode="json"),
              # what the rule saw, sample by sample (prompt-major), so that another rule can be applied to it
              "samples": {"lengths": evidence.lengths, "rewards": evidence.rewards, "correct": evidence.correct}}
    return record, decision


def size_run(cfg: TrainConfig, c, run_dir: Path, *, resumed: bool, build_sampler_fn,
             console: bool = True) -> tuple[TrainConfig, dict[str, Any] | None, float]:
    """(the resolved config, the sizing record or None, probe seconds). A config without `auto` comes back as it
    is. Resumed (a checkpoint loaded): the numbers of the run folder's sizing.json, no probe. Fresh: the probe,
    the rule, sizing.json and the block on the console. Either way config.yaml is rewritten with the numbers and
    the task's overlong budget follows the resolved max_new_tokens."""
    auto = auto_fields(cfg)
    if not auto:
        return cfg, None, 0.0
    path = Path(run_dir) / SIZING_FILE
    probe_s = 0.0
    if resumed:
        try:
            record = json.loads(path.read_text())
            recorded = record["resolved_all"]
        except (OSError, ValueError, KeyError) as err:
            raise FileNotFoundError(f"--resume: {', '.join(auto)} are auto and {path} does not hold the numbers "
                                    f"the run was sized with ({type(err).__name__}); set them to the run's "
                                    "values (its config.yaml)") from None
        resolved = {k: int(recorded[k]) for k in auto}
        record = {**record, "auto": auto}   # what this attempt resolved from the file (an adapter reads it)
    else:
        record, decision = probe_record(cfg, c, build_sampler_fn)
        resolved, probe_s = decision.resolved, record["time/probe_s"]
    out = resolve_config(cfg, resolved)
    if not resumed:
        record["config"] = {f"{s}.{f}": getattr(getattr(out, s), f) for s, f in AUTO_FIELDS}
        record["resolved_all"] = record["config"]
        _write_json(path, record)
        if console and cfg.logging.console:
            print(describe(record | {"predicted_constant": decision.predicted_constant}), flush=True)
        for warning in decision.warnings:
            print(f"warning: sizing: {warning}", file=sys.stderr, flush=True)
    (Path(run_dir) / "config.yaml").write_text(dump_config(out))
    if c.task.cfg.overlong_reward.max_tokens is None:
        c.task.response_budget = out.sampler.max_new_tokens
    return out, record, probe_s


# ------------------------------------------------------------------------------------ while it runs


class SizingAdapter:
    """`sizing.adapt` while the run goes, for the fields the probe sized (a typed value is never changed):

    budget  an auto max_new_tokens x `adapt_factor` (rounded up to a multiple of 8, at most `cap`, the probe's
            budget) after `adapt_steps` steps in a row whose response/at_max_frac exceeds `adapt_cut_rate`
    groups  with auto loop.group_size and loop.prompts_per_step: after every `adapt_group_steps` steps, the
            probe's group-size rule (`choose_group_size`) applied to the rewards of those steps' groups; a new G
            keeps sizing.rollouts_per_step (prompts_per_step = rollouts // G), and the window starts again

    Checkpointed with the run (`run.register("sizing", ...)`): a resumed run samples with the sizes the
    uninterrupted one had. Each step's record gets the sizes of the next step (`sizing/max_new_tokens`,
    `sizing/group_size`, `sizing/prompts_per_step`)."""

    def __init__(self, run, cap: int, *, tokens: bool = True, groups: bool = False):
        self.run = run
        self.cap = int(cap)
        self.tokens, self.groups = tokens, groups
        self.streak = 0
        self.changes: list[dict[str, int]] = []         # the budget's
        self.group_changes: list[dict[str, Any]] = []
        self.window: list[list[float]] = []              # rewards of each group of the current window's steps
        self.window_steps = 0
        self.warned = False
        self.warned_groups = False

    @property
    def max_new_tokens(self) -> int:
        return int(self.run.cfg.sampler.max_new_tokens)

    @property
    def group_size(self) -> int:
        return int(self.run.cfg.loop.group_size)

    def _set(self, tokens: int) -> None:
        run = self.run
        run.cfg.sampler.max_new_tokens = tokens   # validate_assignment checks it
        if getattr(run.sampler, "cfg", None) is not None and run.sampler.cfg is not run.cfg.sampler:
            run.sampler.cfg = run.sampler.cfg.model_copy(update={"max_new_tokens": tokens})
        if run.task.cfg.overlong_reward.max_tokens is None:
            run.task.response_budget = tokens

    def _set_group(self, group: int) -> None:
        loop = self.run.cfg.loop
        prompts = max(1, self.run.cfg.sizing.rollouts_per_step // group)
        # one validated copy: the two fields change together (each assignment alone would be checked alone)
        self.run.cfg.loop = type(loop).model_validate({**loop.model_dump(), "group_size": group,
                                                       "prompts_per_step": prompts})

    def observe(self, record: dict[str, Any], batch=None) -> None:
        """After a step's record is made (its cut rate at the budget it sampled with) and before it is logged:
        change the sizes when due. `batch`: the step's scored rollouts (rewards and group ids), for the groups."""
        if self.tokens:
            self._observe_cut(record)
            record["sizing/max_new_tokens"] = float(self.max_new_tokens)
        if self.groups:
            if batch is not None:
                self._observe_groups(batch)
            record["sizing/group_size"] = float(self.group_size)
            record["sizing/prompts_per_step"] = float(self.run.cfg.loop.prompts_per_step)

    def _observe_cut(self, record: dict[str, Any]) -> None:
        scfg = self.run.cfg.sizing
        frac = record.get("response/at_max_frac")
        self.streak = self.streak + 1 if isinstance(frac, float) and frac > scfg.adapt_cut_rate else 0
        if self.streak >= scfg.adapt_steps and self.max_new_tokens < self.cap:
            old, new = self.max_new_tokens, min(self.cap, round_up(self.max_new_tokens * scfg.adapt_factor))
            self._set(new)
            self.streak = 0
            self._record(self.changes, {"step": int(self.run.step), "from": old, "to": new}, "warned",
                         f"step {self.run.step}: {scfg.adapt_steps} steps in a row cut more than "
                         f"{scfg.adapt_cut_rate:.0%} of the responses: sampler.max_new_tokens {old} -> {new} "
                         f"(sizing.adapt; at most {self.cap}; each change: sizing/max_new_tokens in metrics.jsonl)")

    def _record(self, changes: list, change: dict[str, Any], announced: str, text: str) -> None:
        """Keep `change` in `changes`; say `text` on the run's console for the first change of its kind."""
        changes.append(change)
        if not getattr(self, announced):
            setattr(self, announced, True)
            self.run.message(text)

    def _observe_groups(self, batch) -> None:
        scfg = self.run.cfg.sizing
        rewards = batch.sequence_rewards.tolist()
        by_group: dict[int, list[float]] = {}
        for g, r in zip(batch.group_ids.tolist(), rewards):
            by_group.setdefault(int(g), []).append(float(r))
        self.window.extend(by_group[g] for g in sorted(by_group))
        self.window_steps += 1
        if self.window_steps < scfg.adapt_group_steps:
            return
        old = self.group_size
        new, predicted, _ = choose_group_size(self.window, scfg.group_sizes, scfg.rollouts_per_step,
                                              scfg.constant_target, scfg.prior)
        seen = sum(1 for g in self.window if len(set(g)) == 1) / max(len(self.window), 1)
        self.window, self.window_steps = [], 0
        if new == old:
            return
        self._set_group(new)
        self._record(self.group_changes, {"step": int(self.run.step), "from": old, "to": new, "constant_seen": seen,
                                          "predicted_constant": predicted.get(new)}, "warned_groups",
                     f"step {self.run.step}: {seen:.0%} of the last {scfg.adapt_group_steps} steps' groups were "
                     f"constant; by the probe's rule loop.group_size {old} -> {new}, loop.prompts_per_step "
                     f"{self.run.cfg.loop.prompts_per_step} (sizing.adapt; each change: sizing/group_size in "
                     "metrics.jsonl)")

    def state_dict(self) -> dict[str, Any]:
        return {"max_new_tokens": self.max_new_tokens, "streak": self.streak, "changes": list(self.changes),
                "warned": self.warned, "group_size": self.group_size, "group_changes": list(self.group_changes),
                "window": [list(g) for g in self.window], "window_steps": self.window_steps,
                "warned_groups": self.warned_groups}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.streak = int(state["streak"])
        self.changes = list(state.get("changes", []))
        self.warned = bool(state.get("warned", False))
        self.group_changes = list(state.get("group_changes", []))
        self.window = [list(map(float, g)) for g in state.get("window", [])]
        self.window_steps = int(state.get("window_steps", 0))
        self.warned_groups = bool(state.get("warned_groups", False))
        if int(state["max_new_tokens"]) != self.max_new_tokens:
            self._set(int(state["max_new_tokens"]))
        if "group_size" in state and int(state["group_size"]) != self.group_size:
            self._set_group(int(state["group_size"]))


def attach_adapter(run, record: dict[str, Any] | None) -> SizingAdapter | None:
    """The SizingAdapter of a sized run with `sizing.adapt` on and an auto max_new_tokens, or auto group_size and
    prompts_per_step (registered with the run's checkpointer), else None."""
    if record is None or not run.cfg.sizing.adapt:
        return None
    auto = record.get("auto", [])
    tokens = "sampler.max_new_tokens" in auto
    groups = "loop.group_size" in auto and "loop.prompts_per_step" in auto and len(run.cfg.sizing.group_sizes) > 1
    if not (tokens or groups):
        return None
    adapter = SizingAdapter(run, cap=int(record["evidence"]["cap"]), tokens=tokens, groups=groups)
    run.register("sizing", adapter)
    return adapter
