"""`covrl bandit --env ENV --agent A[,B,...] --steps T --seeds S [options]`: play Ensemble++ and baselines on a
bandit environment; writes `results.json`, `regret.png` and `config.json` under --out (with a progress bar).

Examples:
  covrl bandit --env linear --agent ensemble++,lints --M 16 --steps 1000 --seeds 20
  covrl bandit --env quadratic --agent neural-ensemble++,greedy --agent-arg lr=3e-3 --steps 500 --seeds 2
  covrl bandit --env classification --env-arg dataset=digits --agent neural-ensemble++ --steps 2000
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from covrl.explore.names import AGENT_NAMES, ENV_NAMES


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Play Ensemble++ and baselines on a bandit environment; writes results.json, "
                          "regret.png and config.json under --out.")
    parser.epilog = "\n".join(__doc__.splitlines()[3:])
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--env", default="linear", help="environment: " + ", ".join(ENV_NAMES))
    parser.add_argument("--agent", default="ensemble++,lints",
                        help="comma-separated agents: " + ", ".join(AGENT_NAMES))
    parser.add_argument("--steps", type=int, default=1000, help="rounds T per seed")
    parser.add_argument("--seeds", type=int, default=5, help="number of seeds (instances)")
    parser.add_argument("--seed", type=int, default=0, help="first seed")
    parser.add_argument("--M", type=int, default=None, help="particles / heads / index dimension")
    parser.add_argument("--reference", default=None, help="reference ζ: gaussian, sphere, cube, coordinate, sparse")
    parser.add_argument("--perturbation", default=None, help="perturbation z: sphere, cube, coordinate, gaussian")
    parser.add_argument("--env-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="environment option (repeatable), e.g. d=20 or dataset=digits")
    parser.add_argument("--agent-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="agent option given to every agent that accepts it (repeatable), e.g. lr=3e-3")
    parser.add_argument("--track-band", type=int, default=0, metavar="N",
                        help="record the covariance band of the particles every N rounds (linear agents)")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default runs/bandit/<env>)")
    parser.add_argument("--save-agents", action="store_true", help="save each agent's final state under --out")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _parse_pairs(pairs: list[str], what: str) -> dict:
    import yaml

    out = {}
    for pair in pairs:
        if "=" not in pair:
            raise ValueError(f"--{what} expects KEY=VALUE, got {pair!r}")
        key, value = pair.split("=", 1)
        parsed = yaml.safe_load(value)
        out[key.strip()] = tuple(parsed) if isinstance(parsed, list) else parsed
    return out


def run(args: argparse.Namespace) -> int:
    import json

    from pydantic import ValidationError

    from covrl.explore.config import BanditConfig

    try:
        agent_opts = _parse_pairs(args.agent_arg, "agent-arg")
        for key in ("M", "reference", "perturbation"):
            if getattr(args, key) is not None:
                agent_opts[key] = getattr(args, key)
        env_opts = _parse_pairs(args.env_arg, "env-arg")
        if args.env == "lm":
            env_opts.setdefault("cache_dir", str((args.out or Path("runs/bandit/lm")) / "cache"))
        cfg = BanditConfig(env=args.env, agents=[a.strip() for a in args.agent.split(",") if a.strip()],
                           steps=args.steps, seeds=args.seeds, seed=args.seed, env_options=env_opts,
                           agent_options=agent_opts, track_band_every=args.track_band,
                           out=args.out or Path("runs/bandit") / args.env, save_agents=args.save_agents)
    except (ValidationError, ValueError) as err:
        print(f"covrl bandit: {err}", file=sys.stderr)
        return 2

    import torch
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from covrl.explore.base import save_agent
    from covrl.explore.loop import BATCHED_AGENTS, agent_options_accepted, run_bandit, write_results

    torch.set_num_threads(1)  # the loops are many small ops: one thread is fastest and shares the machine
    results = []
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        disable=args.no_progress)
    with progress:
        for name in cfg.agents:
            accepted = agent_options_accepted(name)
            opts = {k: v for k, v in cfg.agent_options.items() if k in accepted}
            total = cfg.steps * (1 if name in BATCHED_AGENTS else cfg.seeds)
            task = progress.add_task(f"{name} on {cfg.env}", total=total)
            try:
                res = run_bandit(cfg.env, name, steps=cfg.steps, seeds=cfg.seeds, seed=cfg.seed,
                                 env_options=cfg.env_options, agent_options=opts,
                                 track_band_every=cfg.track_band_every if name in ("ensemble++",
                                                                                   "ensemble-sampling") else 0,
                                 on_step=lambda task=task: progress.advance(task))
            except (ValueError, TypeError) as err:
                progress.stop()
                print(f"covrl bandit: {name}: {err}", file=sys.stderr)
                return 2
            results.append(res)
            if cfg.save_agents:
                save_agent(res.agent_object, cfg.out / f"agent-{name}.pt")
    json_path, png_path = write_results(results, cfg.out, title=f"{cfg.env}: {cfg.seeds} seeds")
    (cfg.out / "config.json").write_text(json.dumps(cfg.model_dump(mode="json"), indent=2))
    for r in results:
        m = r.metrics
        print(f"{r.agent:>18}: regret {m['final_regret_mean']:.2f} ± {m['final_regret_stderr']:.2f}   "
              f"{1e3 * r.seconds_per_step:.3f} ms/step   {r.num_parameters} params")
    print(f"wrote {json_path} and {png_path}")
    return 0
