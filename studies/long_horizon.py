"""The long-response regime of the results docs/theory.md ¶9 (length-surge lr decay) and ¶10 (OTB): what
`python -m studies lr-surge-long` and `python -m studies otb-long` share.

Regime: the tiny 2-layer Llama + char tokenizer on `fib_chain` (configs/tiny_chain.yaml): a Fibonacci-style
recurrence mod 100 from two seeds, 24 written steps ("03,05:" -> "a:03+05=08;b:05+08=13;...;#NN"), 268 response
tokens with EOS; the reward checks only the result after '#'. A supervised warm-up on the worked solutions gives
long outputs and partial accuracy at temperature 1 (one wrong step spoils the result). The sampler runs in
bfloat16 with its own weight copy and the trainer in fp32 (the hybrid-engine mismatch; vLLM on SmolLM2 is the
follow-up). `max_new_tokens` (384) leaves room for the length to grow.

The warm-up is computed once per study (seed `SFT_SEED`) and every arm of every seed starts from it: the seeds
vary the RL randomness (prompt stream, sampler generator), not the start. Collapse is judged against the start
score, the sampled accuracy (temperature 1) on distinct RL prompts with the warm-up weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from covrl.config import load_preset
from covrl.experiment import DRIVEN
from covrl.train import prepare_run

PRESET = "tiny_chain"
SFT_SEED = 0
COLLAPSE_FRACTION = 0.5   # collapse: end score < this × start score (as in the short-response designs)


def long_config(name: str, *, seed: int, lr: float, steps: int, prompts_per_step: int, group_size: int,
                max_new_tokens: int, chain_steps: int, sft_steps: int = 0, advantage: str = "grpo",
                extra: dict[str, Any] | None = None):
    """TrainConfig of one run on the long task: configs/tiny_chain.yaml, a driven run (no own evals/checkpoints),
    bf16 sampler with its own weights vs fp32 trainer, `chain_steps` steps per problem."""
    return load_preset(PRESET, {
        **DRIVEN, "run.name": name, "run.seed": seed,
        "task.fib_chain.min_steps": chain_steps, "task.fib_chain.max_steps": chain_steps,
        "sampler.max_new_tokens": max_new_tokens, "sampler.dtype": "bfloat16", "sampler.share_weights": "never",
        "sampler.max_batch": 512, "optim.micro_batch_size": 64,
        "sft_warmup.steps": sft_steps, "algorithm.advantage": advantage, "optim.lr": lr,
        "loop.steps": max(1, steps), "loop.prompts_per_step": prompts_per_step, "loop.group_size": group_size,
        **(extra or {}),
    })


def warmup_start(*, sft_steps: int, chain_steps: int, max_new_tokens: int, run_root: Path) -> dict:
    """The warm-up weights every arm starts from: `sft_steps` steps of NLL on the worked solutions
    (covrl.train.step.sft via prepare_run), seed SFT_SEED."""
    cfg = long_config("warmup", seed=SFT_SEED, lr=1e-4, steps=1, prompts_per_step=1, group_size=1,
                      max_new_tokens=max_new_tokens, chain_steps=chain_steps, sft_steps=sft_steps)
    run = prepare_run(cfg, run_dir=run_root / "warmup", console=False)
    try:
        return {k: v.detach().clone() for k, v in run.model.state_dict().items()}
    finally:
        run.close()
