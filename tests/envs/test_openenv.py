"""task.env.name=openenv (covrl.tasks.openenv): toy environments written in OpenEnv's own format
(tests/envs/openenv_toy) served by uvicorn on 127.0.0.1. The messages the model sees, the token masks, rewards
equal to the environment's own, sessions (one per episode, capacity, closing), dead / silent / killed servers as
errors naming the URL within the timeout (counted by the run's FailureWatch on a step), and a tiny training
run end to end."""

from __future__ import annotations

import json
import os
import random
import signal
import string
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("openenv")

from covrl.models.tiny import char_tokenizer  # noqa: E402
from covrl.rollout.episodes import generate_episodes, score_episodes  # noqa: E402
from covrl.rollout.types import RolloutTiming  # noqa: E402
from covrl.tasks import TaskConfig, build_task  # noqa: E402
from covrl.tasks import openenv as oe  # noqa: E402
from covrl.tasks.environments import EnvStep  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from openenv_toy.models import TextAction  # noqa: E402
from openenv_toy.server import MAX_GUESSES, GuessEnvironment  # noqa: E402

sys.path.insert(0, str(HERE.parent / "train"))
from train_helpers import tiny_cfg  # noqa: E402

torch.set_num_threads(1)
GUESS_APP = str(HERE / "openenv_toy" / "server.py") + ":app"
SINGLE_APP = str(HERE / "openenv_toy" / "server.py") + ":single_app"


def _wait_health(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the toy server exited"
        try:
            with urllib.request.urlopen(url + "/health", timeout=1.0):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(url)


@pytest.fixture(scope="session")
def guess_url():
    """The guess-the-number app under uvicorn on a free port (stopped at the end of the session: a module fixture started again whenever another module's tests came in between)."""
    port = oe._free_port()
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "openenv_toy.server:app", "--app-dir", str(HERE),
                             "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
                            stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_health(url, proc)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(autouse=True)
def _fresh_warnings():
    oe._WARNED.clear()
    yield
    oe.stop_local_servers()


def _task(plain: bool = True, **openenv):
    env = {"name": "openenv", "max_turns": openenv.pop("max_turns", 4), "openenv": openenv}
    return build_task(TaskConfig(name="arithmetic", n_train=8, n_eval=2, chat_template=not plain, env=env))


class Scripted:
    """A sampler that writes the given text at each turn (then its end-of-turn token), log q = -0.5."""

    eos_ids = [2]
    pad_id = 0
    version = 0
    context = None

    def __init__(self, tok, turns: list[str], on_generate=None, eos: bool = True):
        self.tok, self.turns, self.calls, self.on_generate, self.eos = tok, turns, 0, on_generate, eos

    def generate(self, prompts, n, **kw):
        text = self.turns[self.calls]
        self.calls += 1
        ids = self.tok(text, add_special_tokens=False)["input_ids"] + (self.eos_ids if self.eos else [])
        B, L = len(prompts), len(ids)
        out = SimpleNamespace(response_ids=torch.tensor([ids] * B), response_mask=torch.ones(B, L),
                              sampler_logprobs=torch.full((B, L), -0.5), sampler_topk_ids=None,
                              timing=RolloutTiming())
        if self.on_generate is not None:
            self.on_generate(self.calls)
        return out


def _simulate(example, guesses: list[str]) -> tuple[list[str], float]:
    """The toy environment itself, in process, with covrl's seed: the feedback per guess and the reward."""
    env = GuessEnvironment()
    env.reset(seed=oe._seed(example))
    feedback, total = [], 0.0
    for g in guesses:
        obs = env.step(TextAction(message=g))
        feedback.append(obs.feedback)
        total += obs.reward
        if obs.done:
            break
    return feedback, total


def test_messages_masks_and_rewards_are_the_environments(guess_url, capsys):
    task = _task(base_url=guess_url, observation_field="feedback")
    tok = char_tokenizer()
    turns = ["4", "2", "7", "1"]
    examples = task.train[:3]
    sampler = Scripted(tok, turns)
    eb = generate_episodes(sampler, tok, task.environment, examples, 2, generator=torch.Generator(),
                           chat_template=False, max_turns=4, failures=task.env_failures)
    b = eb.batch
    scored = score_episodes(task, tok, eb, examples, 2)
    for i, (ep, ex) in enumerate(zip(eb.episodes, [e for e in examples for _ in range(2)])):
        feedback, reward = _simulate(ex, turns)
        # what the model saw: the reset observation, then per wrong guess the environment's feedback
        assert tok.decode(ep.prompt) == "Guess my number (1-8)."
        assert ep.turns == len(feedback) and ep.end == "done"
        row = b.response_ids[i][b.response_mask[i] > 0]
        env_tok = (b.loss_mask[i] == 0) & (b.response_mask[i] > 0)
        model_tok = b.loss_mask[i] > 0
        expected_env = "".join(feedback[:-1])   # the last feedback ends the episode: not shown
        assert tok.decode(b.response_ids[i][env_tok].tolist()) == expected_env
        assert tok.decode(b.response_ids[i][model_tok].tolist(), skip_special_tokens=True) == "".join(turns[:ep.turns])
        assert tok.decode(row.tolist(), skip_special_tokens=True) == "".join(
            t + f for t, f in zip(turns[:ep.turns], feedback[:-1] + [""]))
        # environment tokens: context of the forward, out of the loss, no sampler log-prob
        assert torch.all(b.sampler_logprobs[i][env_tok] == 0) and torch.all(b.sampler_logprobs[i][model_tok] == -0.5)
        assert float(scored.rewards[i]) == reward and ep.reward == reward
    assert all(e.turns <= MAX_GUESSES for e in eb.episodes)
    # the n episodes of a prompt play the same number (the seed is the example's)
    assert [e.turns for e in eb.episodes[0::2]] == [e.turns for e in eb.episodes[1::2]]
    assert sum(task.environment().pool.open.values()) == 0   # every session closed at the end of the batch
    err = capsys.readouterr().err
    assert err.count("observation fields ['guesses', 'reset_kwargs'] are not shown") == 1   # by name, once
    # a turn cut at max_new_tokens ends the episode: still the environment's action, graded by it
    ex = examples[0]
    target = random.Random(oe._seed(ex)).randint(1, 8)
    for text, reward in [(f"it is {target}", 1.0), (f"it is {target % 8 + 1}", 0.0)]:
        (ep,) = generate_episodes(Scripted(tok, [text], eos=False), tok, task.environment, [ex], 1,
                                  generator=torch.Generator(), chat_template=False, max_turns=4).episodes
        assert ep.end == "length" and ep.reward == reward


def test_opening_reset_fields_and_reward_modes(guess_url, capsys):
    ex = _task(base_url=guess_url).train[0]
    target = random.Random(oe._seed(ex)).randint(1, 8)   # as the toy environment draws it
    wrong = str(target % 8 + 1)

    def episode(**kw):
        env = _task(base_url=guess_url, **kw).environment()
        return env, env.reset(ex)

    env, msgs = episode(opening="task+observation", observation_field="feedback")
    assert msgs == [{"role": "user", "content": ex.plain_prompt + "\n\nGuess my number (1-8)."}]
    out = env.step(wrong)
    assert not out.done and out.messages == [{"role": "user", "content": "too high" if int(wrong) > target
                                              else "too low"}]
    assert env.step(str(target)) == EnvStep(done=True, reward=1.0)
    assert env.client is None   # the session is closed at done
    # the environment's own Action class (and a client class spec) instead of a dict
    env, _ = episode(client="openenv.core.generic_client:GenericEnvClient", action="openenv_toy.models:TextAction",
                     observation_field="feedback")
    assert isinstance(env.pool.action("3"), TextAction) and env.step(str(target)) == EnvStep(done=True, reward=1.0)
    env, msgs = episode(opening="task", reset_fields=["seed"], reward_mode="last")
    assert msgs[-1]["content"] == ex.plain_prompt
    env.step(wrong)
    assert env.step(str(target)).reward == 1.0
    # reward_mode=task: the task's reward scores the final message, the environment's is warned about
    env, _ = episode(reward_mode="task", observation_field="feedback")
    assert env.step(str(target)) == EnvStep(done=True, reward=None)
    assert "step rewards are ignored" in capsys.readouterr().err
    # covrl's max_turns cuts the episode: the step rewards so far are its reward
    env, _ = episode(max_turns=2, observation_field="feedback")
    assert not env.step(wrong).done and env.step(wrong) == EnvStep(done=True, reward=0.0)
    # no observation_field: the observation's only text field is shown, the other one named in a warning
    oe._WARNED.clear()
    env, msgs = episode()
    assert msgs[-1]["content"] == "Guess my number (1-8)." and "['guesses', 'reset_kwargs']" in capsys.readouterr().err
    env.close()
    # the example's fields reach reset (as keywords; this reset takes **kwargs), here shown to the model as JSON
    env, msgs = episode(observation_field="reset_kwargs")
    sent = json.loads(msgs[-1]["content"])
    assert sent.pop("seed") == oe._seed(ex) and len(sent.pop("episode_id")) == 32
    assert sent == {"prompt": ex.prompt, "answer": ex.answer, **ex.meta}
    assert "'reset_kwargs' is a dict, shown as JSON" in capsys.readouterr().err
    env.close()
    env, msgs = episode(observation_field="reset_kwargs", reset_fields=["seed", "prompt"])
    assert json.loads(msgs[-1]["content"]) == {"seed": oe._seed(ex), "episode_id": None, "prompt": ex.prompt}
    env.close()
    with pytest.raises(oe.OpenEnvError, match="reset_fields names \\['nope'\\]"):
        episode(reset_fields=["nope"])
    with pytest.raises(oe.OpenEnvError, match="observation_field='missing'.*feedback"):
        episode(observation_field="missing")


def test_config_errors():
    with pytest.raises(ValueError, match="base_url .* or task.env.openenv.server"):
        _task()
    with pytest.raises(ValueError, match="not both"):
        _task(base_url="http://x", server="a:b")
    with pytest.raises(FileNotFoundError):
        _task(server="no/such/file.py:app")


@pytest.mark.timeout(120)
def test_dead_silent_and_killed_servers_are_errors_naming_the_url(capsys):
    # nobody listens: an error at once, naming the URL
    dead = f"http://127.0.0.1:{oe._free_port()}"
    t0 = time.monotonic()
    with pytest.raises(oe.OpenEnvError, match=f"{dead}.*reset"):
        _task(base_url=dead, timeout_s=2).environment().reset(_task(base_url=dead).train[0])
    assert time.monotonic() - t0 < 5
    # a server started by covrl (server:), then stopped (SIGSTOP): the reset fails after timeout_s, not a hang
    task = _task(server=GUESS_APP, observation_field="feedback", timeout_s=2)
    env = task.environment()
    env.reset(task.train[0])   # starts the server
    (server,) = env.pool._local
    env.close()
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(oe.OpenEnvError, match=f"{server.url} did not answer reset within 2 s"):
            task.environment().reset(task.train[0])
        assert time.monotonic() - t0 < 10
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    # killed between the resets and the first steps: every step fails at once, counted by the FailureWatch
    tok = char_tokenizer()
    reports = []
    task.env_failures.report = reports.append

    def kill(calls):
        if calls == 1:
            server.proc.kill()
            server.proc.wait()

    t0 = time.monotonic()
    eb = generate_episodes(Scripted(tok, ["9"], on_generate=kill), tok, task.environment, task.train[:2], 2,
                           generator=torch.Generator(), chat_template=False, max_turns=4, failures=task.env_failures)
    assert time.monotonic() - t0 < 10
    assert [e.end for e in eb.episodes] == ["error"] * 4 and all(e.reward == 0.0 for e in eb.episodes)
    assert task.env_failures.failures == 4 and len(reports) == 1
    assert f"{server.url} failed on step 1" in reports[0] and "exited with code -9" in reports[0]
    # the next batch cannot open sessions: the run stops (OpenEnvError is a UserCodeError: exit code 2)
    with pytest.raises(oe.OpenEnvError, match=server.url):
        generate_episodes(Scripted(tok, ["9"]), tok, task.environment, task.train[:2], 2,
                          generator=torch.Generator(), chat_template=False, max_turns=4)


# slow (~15-30 s): a server per session; the other OpenEnv tests keep the client in the default suite
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_single_session_servers_hold_one_episode_each():
    # OpenEnv's default app holds one session: two local servers hold two episodes, a third is refused clearly
    task = _task(server=SINGLE_APP, servers=2, observation_field="feedback", timeout_s=5)
    envs = [task.environment() for _ in range(3)]
    ex = task.train[0]
    envs[0].reset(ex)
    envs[1].reset(ex)
    assert envs[0].url != envs[1].url and sorted(envs[0].pool.open.values()) == [1, 1]
    with pytest.raises(oe.OpenEnvError, match="CAPACITY_REACHED.*max_concurrent_envs"):
        envs[2].reset(ex)
    envs[0].close()
    envs[2].reset(ex)   # the freed session is reused
    assert envs[2].url == envs[0].url
    for e in envs:
        e.close()
    servers = envs[0].pool._local
    oe.stop_local_servers()
    assert all(s.proc.poll() is not None for s in servers)   # covrl stops what it started


@pytest.mark.timeout(120)
def test_tiny_training_run_end_to_end(tmp_path, guess_url):
    from covrl.train.run.driver import run_loop
    from covrl.train.run.folder import prepare_run
    from covrl.train.run.sinks import read_jsonl
    from covrl.train.run.sources import build_sync_source

    cfg = tiny_cfg(tmp_path, **{"run.name": "openenv", "task.env.name": "openenv",
                                "task.env.openenv.base_url": guess_url, "task.env.openenv.observation_field":
                                "feedback", "task.env.max_turns": 3, "model.tiny.max_positions": 96,
                                "sampler.max_new_tokens": 4, "sft_warmup.steps": 0, "loop.steps": 3,
                                "algorithm.advantage": "otb_tir", "eval.max_prompts": 2})
    run = prepare_run(cfg, console=False)
    # end a turn on any digit or letter (a guess, or none), so that the environment, not the token budget, ends
    # the untrained model's episodes
    stops = run.tokenizer(string.digits + string.ascii_letters)["input_ids"]
    run.sampler.eos_ids = sorted(set(run.sampler.eos_ids) | set(stops))
    summary = run_loop(run, build_sync_source(run))
    run.close()
    assert summary["status"] == "completed"
    records = read_jsonl(tmp_path / "openenv" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    # multi-turn episodes ended by the environment, rewarded by it (a correct guess: 1), model tokens only trained
    assert all(r["task/turns"] > 2.0 and r["task/end_length"] < 0.5 for r in records)
    assert max(r["reward/mean"] for r in records) > 0.0 and all(0.0 <= r["reward/mean"] <= 1.0 for r in records)
    assert all(r["response_tokens"] < r["batch_rows"] * 4 * r["task/turns"] + 1 for r in records)
    assert len(run.evals) == 2 and "turns" in run.evals[0]["greedy"]
