"""`task.name: verifiers`: a verifiers environment (PyPI `verifiers` >= 0.4, its `verifiers.v1` stack; extra
`covrl[envs]`) trained with covrl, unchanged (docs/environments.md).

Design. verifiers runs an episode its own way: the taskset's task, the agent's harness program (the `null`
harness: a chat loop; `bash` and others: coding agents) in a local runtime, every model call through its
interception server to a client, then the task's `@vf.reward` functions over the trace. Its training client
(`TrainClientConfig`, prime-rl's set-up) renders each chat to token ids on the client side and calls a vLLM-
style `/inference/v1/generate` endpoint, so the trace comes back with the exact token ids, which of them the
model sampled, and their log-probs. covrl serves that endpoint from its own sampler (covrl.rollout.serve: hf or
vLLM, the policy version being trained) and reads the trace's branch as the episode's row:

    prompt_ids       the branch's tokens before the first sampled one (system + user turn, rendered)
    response tokens  the rest: model turns (loss_mask 1, log q from covrl's sampler) and everything the
                     environment added between them (tool results, user replies: loss_mask 0)
    reward           the trace's reward, Σ weight·score of the task's rewards (each term logged unweighted
                     as task/reward/<name>)

So the environment runs exactly as under prime-rl, and covrl trains on the tokens it drew itself. A trace with
more than one trainable branch (the history was rewritten between calls) trains on its last branch and is
counted (`task/verifiers_multi_branch`). An episode that fails (the harness, a reward, a timeout) counts 0 and
goes to the run's environment FailureWatch (first traceback shown, too many stop the run).

Examples: the taskset's tasks, in its order: the first `task.n_eval` are held out, the next ones (up to
`task.verifiers.pool_size`, default n_train) are the training pool, cycled in seeded epochs to `task.n_train`.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import os
import random
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

from covrl._lazy import require
from covrl.tasks.base import Example, cycle_epochs
from covrl.tasks.config import TaskConfig
from covrl.tasks.failures import FailureWatch
from covrl.tasks.task import Task, held_out_count

__all__ = ["VerifiersEnvironment", "build_verifiers"]


def _import_path(taskset: str) -> str:
    """The taskset id verifiers imports: a folder holding a package is put on sys.path and named by its folder."""
    path = Path(taskset).expanduser()
    if path.exists():
        if not (path / "__init__.py").is_file():
            raise ValueError(f"task.verifiers.taskset={taskset!r}: a folder must be a Python package (an __init__.py "
                             "exporting its Taskset subclass in __all__)")
        parent = str(path.resolve().parent)
        if parent not in sys.path:
            sys.path.insert(0, parent)
        # the environment's own processes (tool servers) import the taskset too
        paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if parent not in paths:
            os.environ["PYTHONPATH"] = os.pathsep.join([parent, *[q for q in paths if q]])
        return path.resolve().name
    return taskset


# what an environment written for verifiers before 0.4 looks like, and what covrl loads instead (0.4's verifiers.v1)
OLD_API = "load_environment(), vf.SingleTurnEnv / vf.MultiTurnEnv / vf.ToolEnv, vf.Rubric"
NEW_API = ("`import verifiers.v1 as vf`; a vf.Taskset subclass whose load() yields vf.Task objects (the prompt and "
           "answer in a vf.TaskData), the rubric's functions as @vf.reward methods of the Task, the Taskset (and a "
           "vf.Env subclass for multi-turn play) exported in the package's __all__")


def _old_api_error(taskset: str) -> ValueError:
    return ValueError(f"task.verifiers.taskset={taskset!r}: this environment uses the verifiers API before 0.4 "
                      f"({OLD_API}), which covrl does not load. Port it to verifiers 0.4: {NEW_API} "
                      "(docs/environments.md, 'Porting an environment from verifiers before 0.4')")


def _about_old_verifiers(err: BaseException) -> bool:
    """Whether an import of the taskset failed on a name of verifiers before 0.4: 0.4's top-level `verifiers`
    package holds nothing but its version (the API is `verifiers.v1`)."""
    if isinstance(err, AttributeError):
        return getattr(getattr(err, "obj", None), "__name__", None) == "verifiers"
    name = (getattr(err, "name", None) or "") if isinstance(err, ImportError) else ""
    return name == "verifiers" or (name.startswith("verifiers.") and not name.startswith("verifiers.v1"))


def _check_taskset(taskset_id: str, taskset: str, vf) -> None:
    """Import the taskset as verifiers will; an environment written for verifiers before 0.4, or one that fails
    to import, is a ValueError naming task.verifiers.taskset (verifiers' loader would report 'defines no
    __all__' for the first, and raise the second bare)."""
    from verifiers.v1.utils.loaders import import_taskset

    try:
        module = import_taskset(taskset_id)
    except Exception as err:
        chain = [err, *([err.__cause__] if err.__cause__ is not None else [])]   # verifiers' "not found" wraps it
        if any(_about_old_verifiers(e) for e in chain):
            raise _old_api_error(taskset) from err
        inner = chain[-1]
        module = taskset_id.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()   # as verifiers names it
        if isinstance(inner, ImportError) and inner.name not in (None, module, f"verifiers.v1.tasksets.{module}"):
            err = inner   # the taskset was found; a module it imports was not
        raise ValueError(f"task.verifiers.taskset={taskset!r}: {type(err).__name__}: {err}") from err
    exported = [getattr(module, name, None) for name in getattr(module, "__all__", None) or ()]
    if hasattr(module, "load_environment") and not any(
            isinstance(obj, type) and issubclass(obj, vf.Taskset) for obj in exported):
        raise _old_api_error(taskset)


def _prompt_text(data) -> str:
    prompt = data.prompt
    if prompt is None or isinstance(prompt, str):
        return prompt or ""
    return "\n".join(str(getattr(m, "content", "") or "") for m in prompt)   # a Messages prompt: its text


class VerifiersEnvironment:
    """The loaded verifiers Env and the event loop it runs on (a daemon thread): `run_episodes` plays n
    episodes per example against a generate endpoint and returns each one's tokens and outcome. `endpoint` is
    the covrl.rollout side's server for it (closed with the environment)."""

    tools: list = []

    def __init__(self, task_cfg: TaskConfig):
        vf = require("verifiers.v1", extra="envs")
        from verifiers.v1.utils.loaders import environment_class

        cfg = task_cfg.verifiers
        if not cfg.taskset:
            raise ValueError("task.verifiers.taskset is required for task.name='verifiers' (an installed taskset "
                             "module, e.g. my_taskset, or a folder holding one)")
        self.cfg = cfg
        self.vf = vf
        bindir = str(Path(sys.executable).parent)   # the harness runtime looks for `uv` on PATH
        if bindir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
        taskset_id = _import_path(cfg.taskset)
        _check_taskset(taskset_id, cfg.taskset, vf)
        env_cls = environment_class(taskset_id, cfg.env_options.get("id", ""))
        agent = {"harness": {"id": cfg.harness, **cfg.harness_options}, "runtime": dict(cfg.runtime)}
        data = {"taskset": {"id": taskset_id, **cfg.options}, **cfg.env_options,
                "timeout": {"episode": cfg.episode_timeout_s}}
        from verifiers.v1.utils.generic import concrete_type

        config_cls = concrete_type(env_cls, vf.EnvConfig, origin=vf.Env) or vf.EnvConfig
        seats = [name for name, f in config_cls.model_fields.items() if f.annotation is vf.AgentConfig]
        for seat in seats:   # every seat plays covrl's policy, with the harness and runtime chosen here
            data.setdefault(seat, agent)
        try:
            self.env = env_cls(config_cls.model_validate(data))
        except Exception as err:
            raise ValueError(f"task.verifiers: cannot build the environment of taskset {cfg.taskset!r}: "
                             f"{type(err).__name__}: {err}") from err
        self._tasks: dict[str, Any] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="covrl-verifiers", daemon=True)
        self._thread.start()
        self._serving = None
        self.endpoint = None        # covrl.rollout's GenerateServer for this environment
        self._closed = False
        atexit.register(self.close)

    # -- data -------------------------------------------------------------------------------------------------
    def examples(self, limit: int) -> list[Example]:
        """The first `limit` tasks of the taskset as covrl examples (prompt text, answer if the task has one)."""
        out = []
        for task in itertools.islice(iter(self.env.taskset), limit):
            key = task.key
            self._tasks[key] = task
            answer = getattr(task.data, "answer", None)
            out.append(Example(prompt=_prompt_text(task.data), answer="" if answer is None else str(answer),
                               meta={"verifiers_key": key, "verifiers_idx": task.data.idx}))
        return out

    # -- episodes ---------------------------------------------------------------------------------------------
    def _run(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _enter(self) -> None:
        self._serving = self.env.serving()
        await self._serving.__aenter__()

    async def _exit(self) -> None:
        if self._serving is not None:
            serving, self._serving = self._serving, None
            await serving.__aexit__(None, None, None)

    def run_episodes(self, base_url: str, tokenizer_dir: str, examples: list[Example], n: int,
                     temperature: float, max_tokens: int) -> list[dict]:
        """n episodes per example (example-major), each {tokens, sampled, logprobs, reward, terms, final_text,
        turns, error, branches}; the model is reached at `base_url` (covrl's generate endpoint) and the chats are
        rendered with the tokenizer saved in `tokenizer_dir`."""
        vf = self.vf
        if self._serving is None:
            self._run(self._enter())
        renderer = None
        if self.cfg.renderer:
            from pydantic import TypeAdapter
            from renderers import RendererConfig

            renderer = TypeAdapter(RendererConfig).validate_python(dict(self.cfg.renderer))
        else:
            from renderers import DefaultRendererConfig

            renderer = DefaultRendererConfig()
        ctx = vf.ModelContext(model="covrl", client=vf.TrainClientConfig(
            base_url=base_url, renderer_model_name=tokenizer_dir, renderer=renderer),
            sampling=vf.Sampling(temperature=temperature, max_tokens=max_tokens))
        slots = []
        for ex in examples:
            task = self._tasks.get(ex.meta.get("verifiers_key"))
            if task is None:
                raise ValueError(f"example {ex.prompt[:60]!r} is not a task of taskset {self.cfg.taskset!r}")
            slots += self.env.slots(task, n)

        async def play():
            gate = asyncio.Semaphore(self.cfg.max_concurrent)
            return await asyncio.gather(*(self.env.run_slot(s, ctx, gate) for s in slots))

        episodes = self._run(play())
        return [self._outcome(ep) for ep in episodes]

    def _outcome(self, episode) -> dict:
        traces = [t for t in episode.traces if any(b.trainable for b in t.branches)]
        error = "; ".join(e.message for e in episode.errors) or None
        tb = "\n".join(e.traceback or "" for e in episode.errors) or None
        if not error and not episode.ok:
            failed = [t.last_error for t in episode.traces if t.last_error is not None]
            error = "; ".join(e.message for e in failed) or "the episode did not finish"
            tb = "\n".join(e.traceback or "" for e in failed) or None
        if not traces:
            return {"tokens": [], "sampled": [], "logprobs": [], "reward": 0.0, "terms": {}, "final_text": "",
                    "turns": 0, "error": error or "the episode has no trainable trace", "traceback": tb,
                    "branches": 0}
        if len(traces) > 1:
            raise ValueError(f"task.verifiers: an episode of {self.cfg.taskset!r} has {len(traces)} trainable "
                             "traces (several agents); covrl trains one policy seat per episode")
        trace = traces[0]
        branches = [b for b in trace.branches if b.trainable]
        branch = branches[-1]
        terms = {name: float(r.score) for name, r in trace.rewards.items() if r is not None}
        return {"tokens": list(branch.token_ids), "sampled": [bool(m) for m in branch.sampled_mask],
                "logprobs": list(branch.logprobs), "reward": float(trace.reward) if error is None else 0.0,
                "terms": terms, "final_text": trace.last_reply, "turns": len(trace.assistant_messages),
                "error": error, "traceback": tb, "branches": len(branches)}

    def close(self) -> None:
        """Stop verifiers' servers and the endpoint; safe to call twice (also run at exit)."""
        if self._closed:
            return
        self._closed = True
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None
        try:
            self._run(self._exit(), timeout=30)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)


def build_verifiers(cfg: TaskConfig) -> Task:
    ignored = [name for name, set_ in (("task.reward", cfg.reward != "auto"), ("task.rewards", cfg.rewards)) if set_]
    if ignored:
        warnings.warn(f"{', '.join(ignored)}: not used with task.name=verifiers (the environment's rewards score "
                      "each episode)", stacklevel=2)
    env = VerifiersEnvironment(cfg)
    size = cfg.verifiers.pool_size or cfg.n_train
    n_eval = held_out_count(cfg, None)   # task.n_eval, else the default count
    found = env.examples(n_eval + size)
    eval_set, pool = found[:n_eval], found[n_eval:]
    if not pool:
        raise ValueError(f"task.verifiers: taskset {cfg.verifiers.taskset!r} has {len(found)} tasks, none left "
                         f"for training after task.n_eval={n_eval}")
    train = cycle_epochs(pool, cfg.n_train, random.Random(cfg.seed))
    task = Task(cfg, train, eval_set, default_reward="exact_match", default_grader="exact_match")
    task.environment = env
    task.env_failures = FailureWatch(
        f"verifiers environment {cfg.verifiers.taskset}", unit="episodes", window=cfg.reward_error_window,
        max_rate=cfg.max_reward_error_rate, limits=f"task.max_reward_error_rate={cfg.max_reward_error_rate} over "
                                                   f"task.reward_error_window={cfg.reward_error_window}")
    return task
