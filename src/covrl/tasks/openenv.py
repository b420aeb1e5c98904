"""OpenEnv environments as covrl episodes (`task.env.name=openenv`, config `task.env.openenv`; the section
"OpenEnv environments" of docs/environments.md).

An OpenEnv environment is a server (FastAPI from `openenv.core.env_server.create_app`): its HTTP /reset and
/step build a fresh environment per request, so state across turns lives only in a WebSocket session (/ws, one
environment instance per connection, at most the app's `max_concurrent_envs` at once). Each covrl episode
therefore opens its own session, through OpenEnv's client (`GenericEnvClient`, or the environment's EnvClient
subclass), and closes it when the episode ends:

    reset(example)  -> client.reset(seed, episode_id, prompt, <answer field>, <example fields>)
                       (the server passes on only the keywords its reset accepts; the seed is a hash of the
                       example, so a prompt's n episodes face the same problem)
                       opening messages: [system prompt], [demonstration], user = the observation's text
                       (or the task's prompt, or both: `opening`)
    step(text)      -> client.step({action_field: text, **action_extra})  (or the Action class)
                       not done: the observation's text is the next user message
                       done: the episode's reward = sum / last of the step rewards (`reward_mode`); None from
                       every step = the task's reward scores the final message
    step_cut(text)  -> a turn cut at sampler.max_new_tokens: still the last action, graded by the environment

Sessions are opened on the least busy of the servers (`base_url` list, or `servers` local ones); a server that
refuses a session for capacity is skipped, and when all do the error says how many sessions covrl needs. Every
call has `timeout_s`; a dead, refusing or silent server is an `OpenEnvError` naming its URL (a reset's stops the
run: the episode has no opening; a step's is counted by the run's FailureWatch like any environment failure).
OpenEnv's client is async: every episode's calls run on one background event loop per process.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import hashlib
import importlib
import importlib.util
import inspect
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from covrl._lazy import MissingExtraError
from covrl.tasks.base import Example
from covrl.tasks.config import EnvironmentConfig, OpenEnvConfig
from covrl.tasks.environments import ENVIRONMENTS, EnvStep, _user_messages
from covrl.tasks.failures import UserCodeError, print_warning
from covrl.tasks.rewards import load_user_reward
from covrl.tasks.task import Task

__all__ = ["OpenEnvEnvironment", "OpenEnvError", "build_openenv", "stop_local_servers"]

# observation fields that are the step result's, not text for the model (serialize_observation drops them too)
_RESULT_FIELDS = ("done", "reward", "metadata")


class OpenEnvError(UserCodeError):
    """An OpenEnv server that cannot be reached, does not answer within task.env.openenv.timeout_s, refuses a
    session or answers with an error (a bad input of the run: exit code 2)."""


_WARNED: set[str] = set()


def _warn_once(key: str, text: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        print_warning(f"openenv: {text}")


# ------------------------------------------------------------------------------------------------ event loop

class _Loop:
    """A background asyncio loop (one per process, started on first use) for OpenEnv's async clients: a
    connection stays on the loop it was opened on, and `run` bounds every call by a timeout."""

    def __init__(self):
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pid: int | None = None
        self._lock = threading.Lock()

    def _get(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._pid != os.getpid():   # a forked worker has no loop thread
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="covrl-openenv", daemon=True).start()
                self._loop, self._pid = loop, os.getpid()
            return self._loop

    def run(self, coro, timeout: float):
        fut = asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, timeout), self._get())
        try:
            return fut.result(timeout + 5.0)   # wait_for cancels the call at `timeout`; this is the backstop
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"no answer within {timeout:g} s") from None


_LOOP = _Loop()


async def _close_client(client) -> None:
    ws = getattr(client, "_ws", None)
    try:
        if ws is not None:
            # ask the server to end the session and let it close the connection: when the client closes first,
            # OpenEnv's server logs a traceback for every session
            await ws.send(json.dumps({"type": "close"}))
            await asyncio.wait_for(ws.wait_closed(), 2.0)
            client._ws = None
        await asyncio.wait_for(client.close(), 2.0)
    except BaseException:  # noqa: BLE001 - a dead or silent server: drop the connection
        transport = getattr(ws, "transport", None)
        if transport is not None:
            transport.abort()


async def _last_word(client) -> str:
    """A message the server sent before it closed the connection (OpenEnv refuses a session that way: the error,
    then the close, so the client's next send fails before it reads the error)."""
    ws = getattr(client, "_ws", None)
    if ws is None:
        return ""
    try:
        return str(await asyncio.wait_for(ws.recv(), 0.5))
    except BaseException:  # noqa: BLE001 - nothing buffered
        return ""


def _server_said(client) -> str:
    try:
        return _LOOP.run(_last_word(client), 2.0)
    except Exception:  # noqa: BLE001 - best effort
        return ""


def _close_quietly(client) -> None:
    try:
        _LOOP.run(_close_client(client), 5.0)
    except Exception:  # noqa: BLE001 - closing is best effort (the server may be gone)
        pass


# ------------------------------------------------------------------------------------------------ local servers

# started by covrl with `python -c`: uvicorn on 127.0.0.1, exiting by itself when its parent dies (even killed)
_BOOT = """
import os, sys, threading, time
app_dir, app, port, parent = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
def _watch():
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)
threading.Thread(target=_watch, daemon=True).start()
sys.path.insert(0, app_dir)
import uvicorn
uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
"""


def _app_location(spec: str) -> tuple[str, str]:
    """(folder for sys.path, 'module:attr') of 'module:app' (imported from the working directory) or
    'path/to/file.py:app' (its package, when the folder has __init__.py files, is kept)."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise ValueError(f"task.env.openenv.server={spec!r}: expected 'module:app' or 'path/to/file.py:app'")
    if not (target.endswith(".py") or "/" in target or "\\" in target):
        return os.getcwd(), spec
    path = Path(target).expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"task.env.openenv.server={spec!r}: file {path} does not exist")
    parts, folder = [path.stem], path.parent
    while (folder / "__init__.py").is_file():
        parts.insert(0, folder.name)
        folder = folder.parent
    return str(folder), ".".join(parts) + ":" + attr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _LocalServer:
    """One uvicorn process serving `spec` on a free port of 127.0.0.1; its output goes to a log file."""

    def __init__(self, spec: str):
        self.spec, self.owner = spec, os.getpid()   # a forked worker inherits this object, never stops it
        app_dir, app = _app_location(spec)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        fd, self.log = tempfile.mkstemp(prefix="covrl-openenv-", suffix=".log")
        with os.fdopen(fd, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-c", _BOOT, app_dir, app, str(self.port), str(os.getpid())],
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)   # a Ctrl-C of the run reaches covrl only

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return Path(self.log).read_text(errors="replace")[-chars:].strip()
        except OSError:
            return ""

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            code = self.proc.poll()
            if code is not None:
                raise OpenEnvError(f"the OpenEnv server covrl started for {self.spec!r} exited with code {code} "
                                   f"before answering {self.url}/health; its output ({self.log}):\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=1.0) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                tail = self.log_tail()
                self.stop()
                raise OpenEnvError(f"the OpenEnv server covrl started for {self.spec!r} did not answer "
                                   f"{self.url}/health within {timeout:g} s (task.env.openenv.startup_timeout_s); "
                                   f"its output:\n{tail}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.owner == os.getpid() and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.owner == os.getpid():
            Path(self.log).unlink(missing_ok=True)


_SERVERS: dict[tuple, list[_LocalServer]] = {}
_SERVERS_LOCK = threading.Lock()


def _local_servers(spec: str, n: int, startup_timeout: float) -> list[_LocalServer]:
    """The process's `n` servers of `spec`, started (all at once) on first use and stopped at exit."""
    key = (spec, n, os.getcwd(), os.getpid())
    with _SERVERS_LOCK:
        if key not in _SERVERS:
            if not _SERVERS:
                atexit.register(stop_local_servers)
            servers = [_LocalServer(spec) for _ in range(n)]
            try:
                for s in servers:
                    s.wait_ready(startup_timeout)
            except BaseException:
                for s in servers:
                    s.stop()
                raise
            _SERVERS[key] = servers
        return _SERVERS[key]


def stop_local_servers() -> None:
    """Stop every OpenEnv server this process started (also run at exit)."""
    with _SERVERS_LOCK:
        servers = [s for group in _SERVERS.values() for s in group if s.owner == os.getpid()]
        _SERVERS.clear()
    for s in servers:
        s.stop()


# ------------------------------------------------------------------------------------------------ sessions

def _describe(url: str, what: str, err: BaseException, timeout: float, server: _LocalServer | None,
              said: str = "") -> str:
    if isinstance(err, (TimeoutError, asyncio.TimeoutError)):
        text = f"the OpenEnv server at {url} did not answer {what} within {timeout:g} s (task.env.openenv.timeout_s)"
    else:
        text = f"the OpenEnv server at {url} failed on {what}: {type(err).__name__}: {err}"
    if said:
        text += f"\n(its last message: {said[:1000]})"
    if server is not None and server.proc.poll() is not None:
        text += (f"\n(covrl's local server for {server.spec!r} exited with code {server.proc.returncode}; its "
                 f"output, {server.log}:\n{server.log_tail()})")
    return text


def _capacity(err: BaseException) -> bool:
    return "CAPACITY_REACHED" in str(err)


class _Pool:
    """The servers of a run (in this process) and the sessions open on each; builds OpenEnv clients."""

    def __init__(self, cfg: OpenEnvConfig):
        self.cfg = cfg
        self._local: list[_LocalServer] | None = None
        self._urls: list[str] | None = None
        if cfg.base_url is not None:
            self._urls = [cfg.base_url] if isinstance(cfg.base_url, str) else list(cfg.base_url)
        self.open: dict[str, int] = {}
        self._lock = threading.RLock()
        self._client_cls = None
        self._action_cls = None

    def urls(self) -> list[str]:
        with self._lock:
            if self._urls is None:
                self._local = _local_servers(self.cfg.server, self.cfg.servers, self.cfg.startup_timeout_s)
                self._urls = [s.url for s in self._local]
            return self._urls

    def local(self, url: str) -> _LocalServer | None:
        return next((s for s in self._local or [] if s.url == url), None)

    def _classes(self):
        if self._client_cls is None:
            if self.cfg.client:
                self._client_cls = _load(self.cfg.client, "client")
            else:
                self._client_cls = importlib.import_module("openenv.core.generic_client").GenericEnvClient
            self._action_cls = _load(self.cfg.action, "action") if self.cfg.action else dict
        return self._client_cls, self._action_cls

    def action(self, text: str):
        fields = {**self.cfg.action_extra, self.cfg.action_field: text}
        cls = self._classes()[1]
        if cls is dict:
            return fields
        try:
            return cls(**fields)
        except Exception as err:  # noqa: BLE001 - pydantic's validation error, with the config that caused it
            raise OpenEnvError(f"task.env.openenv.action={self.cfg.action!r} cannot be built from "
                               f"{sorted(fields)} (action_field={self.cfg.action_field!r}, action_extra): "
                               f"{err}") from err

    def _client(self, url: str):
        cls, t = self._classes()[0], self.cfg.timeout_s
        params = inspect.signature(cls).parameters
        kwargs = {k: t for k in ("connect_timeout_s", "message_timeout_s") if k in params}
        return cls(base_url=url, **kwargs)

    def connect(self, kwargs: dict) -> tuple[Any, str, Any]:
        """A new session, reset with `kwargs`, on the least busy server that accepts one: (client, url, result).
        Servers at capacity are retried for a moment (a session just closed may still be held)."""
        t = self.cfg.timeout_s
        deadline = time.monotonic() + min(2.0, t)
        while True:
            with self._lock:
                order = sorted(self.urls(), key=lambda u: self.open.get(u, 0))
            for url in order:
                client = self._client(url)
                try:
                    result = _LOOP.run(client.reset(**kwargs), t)
                except Exception as err:  # noqa: BLE001 - every failure becomes an error naming the server
                    said = _server_said(client)
                    _close_quietly(client)
                    if _capacity(err) or "CAPACITY_REACHED" in said:
                        continue
                    raise OpenEnvError(_describe(url, "reset", err, t, self.local(url), said)) from err
                with self._lock:
                    self.open[url] = self.open.get(url, 0) + 1
                return client, url, result
            if time.monotonic() > deadline:
                raise OpenEnvError(
                    f"every OpenEnv server ({', '.join(order)}) refused a new session (CAPACITY_REACHED) with "
                    f"{sum(self.open.values())} sessions open from this process. covrl holds one session per "
                    "episode running: loop.prompts_per_step x loop.group_size at once when training, "
                    "eval.max_prompts when evaluating. Serve the environment with create_app(..., "
                    "max_concurrent_envs=N) for N at least that (its class needs SUPPORTS_CONCURRENT_SESSIONS "
                    "= True), or give more servers (task.env.openenv.servers, or a list in "
                    "task.env.openenv.base_url).")
            time.sleep(0.05)

    def release(self, url: str, client) -> None:
        with self._lock:
            self.open[url] = max(0, self.open.get(url, 0) - 1)
        _close_quietly(client)


def _load(spec: str, field: str):
    try:
        return load_user_reward(spec)
    except Exception as err:  # noqa: BLE001 - name the config field, not task.reward
        raise ValueError(f"task.env.openenv.{field}={spec!r}: {err}") from err


# ------------------------------------------------------------------------------------------------ episodes

def _seed(example: Example) -> int:
    """A seed from the example's text: the same for a prompt's n episodes and across runs and processes."""
    digest = hashlib.sha256(f"{example.prompt}\0{example.answer}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


def _observation_fields(obs) -> dict[str, Any]:
    if isinstance(obs, dict):
        return {k: v for k, v in obs.items() if k not in _RESULT_FIELDS}
    if hasattr(obs, "model_dump"):
        return obs.model_dump(exclude=set(_RESULT_FIELDS))
    return {"observation": obs}


def _number(value, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, (bool, int, float)):
        return float(value)
    _warn_once(f"reward-type-{what}", f"a {what} reward of type {type(value).__name__} ({value!r}) is not a number; "
               "covrl ignores it")
    return None


class OpenEnvEnvironment:
    """One episode on an OpenEnv server: its own session from reset to the end (see the module docstring)."""

    tools: list = []

    def __init__(self, task: Task, cfg: EnvironmentConfig, pool: _Pool):
        self.task, self.cfg, self.pool = task, cfg.openenv, pool
        self.max_turns = cfg.max_turns
        self.client = None
        self.url: str | None = None
        self.rewards: list[float | None] = []
        self.steps = 0
        self.done_at_reset = False
        self.reset_reward: float | None = None

    # ---- the example -> reset's keywords, the observation -> text
    def _reset_kwargs(self, example: Example) -> dict[str, Any]:
        answer_field = self.task.cfg.answer_field
        every = {"seed": _seed(example), "episode_id": uuid.uuid4().hex, "prompt": example.prompt,
                 answer_field: example.answer, **example.meta}
        names = self.cfg.reset_fields
        if names is not None:
            missing = [k for k in names if k not in every]
            if missing:
                raise OpenEnvError(f"task.env.openenv.reset_fields names {missing}, which the example lacks; it has "
                                   f"{sorted(every)}")
            every = {k: every[k] for k in names}
        kwargs = {}
        for k, v in every.items():
            try:
                json.dumps(v)
            except (TypeError, ValueError):
                _warn_once(f"reset-json-{k}", f"the example's field {k!r} ({type(v).__name__}) is not JSON and is not "
                           "sent to reset")
                continue
            kwargs[k] = v
        return kwargs

    def _text(self, obs) -> str:
        fields = _observation_fields(obs)
        name = self.cfg.observation_field
        if name is not None and name not in fields:
            raise OpenEnvError(f"task.env.openenv.observation_field={name!r}: the observation from {self.url} has "
                               f"the fields {sorted(fields)}")
        if name is None:
            texts = [k for k, v in fields.items() if isinstance(v, str)]
            if len(texts) != 1:
                _warn_once("obs-json", f"the observation has {len(texts)} text fields ({sorted(fields)}): the model "
                           "sees them all as JSON; set task.env.openenv.observation_field to show one")
                return json.dumps(fields, default=str)
            name = texts[0]
        rest = sorted(k for k in fields if k != name)
        if rest:
            _warn_once("obs-rest", f"observation fields {rest} are not shown to the model (it sees {name!r}; "
                       "task.env.openenv.observation_field)")
        value = fields[name]
        if not isinstance(value, str):
            _warn_once("obs-type", f"observation field {name!r} is a {type(value).__name__}, shown as JSON")
            return json.dumps(value, default=str)
        return value

    # ---- the protocol
    def reset(self, example: Example) -> list[dict]:
        self.close()
        self.rewards, self.steps = [], 0
        messages = _user_messages(self.task, example)
        self.client, self.url, result = self.pool.connect(self._reset_kwargs(example))
        self.reset_reward = _number(result.reward, "reset")
        if self.reset_reward:
            _warn_once("reset-reward", f"reset returned a reward ({self.reset_reward:g}): covrl scores actions only "
                       "and ignores it")
        self.done_at_reset = bool(result.done)
        if self.done_at_reset:
            _warn_once("reset-done", "reset returned done=true: the model still writes one message, which ends the "
                       "episode without a step")
        if self.cfg.opening != "task":
            text = self._text(result.observation)
            if not text.strip():
                _warn_once("reset-empty", "the reset observation's text is empty: the first user message is the "
                           "task's prompt")
            elif self.cfg.opening == "observation":
                messages[-1] = {**messages[-1], "content": text}
            else:
                messages[-1] = {**messages[-1], "content": messages[-1]["content"] + "\n\n" + text}
        return messages

    def step(self, assistant_message: str) -> EnvStep:
        if self.done_at_reset:
            self.close()
            return EnvStep(done=True, reward=self._episode_reward())
        if self.client is None:
            raise RuntimeError("OpenEnvEnvironment.step before reset or after the episode ended")
        action = self.pool.action(assistant_message)
        t = self.cfg.timeout_s
        try:
            result = _LOOP.run(self.client.step(action), t)
        except Exception as err:  # noqa: BLE001 - the session is gone: close it, the error names the server
            url, said = self.url, _server_said(self.client)
            self.close()
            raise OpenEnvError(_describe(url, f"step {self.steps + 1}", err, t, self.pool.local(url), said)) from err
        self.steps += 1
        self.rewards.append(_number(result.reward, "step"))
        if result.done:
            self.close()
            return EnvStep(done=True, reward=self._episode_reward())
        text = self._text(result.observation)
        if self.steps >= self.max_turns:
            # covrl cuts the episode here: with rewards so far they are its reward, else covrl's rule (reward 0)
            reward = self._episode_reward()
            if reward is not None:
                self.close()
                return EnvStep(done=True, reward=reward)
        return EnvStep([{"role": "user", "content": text}])

    def step_cut(self, assistant_message: str) -> EnvStep:
        """A turn cut at sampler.max_new_tokens ends the episode in covrl: the cut message is still the action
        of a last step, and the episode's reward is the environment's (with numeric rewards; else the task's)."""
        out = self.step(assistant_message)
        if not out.done:
            self.close()
            out = EnvStep(done=True, reward=self._episode_reward())
        return out

    def _episode_reward(self) -> float | None:
        given = [r for r in self.rewards if r is not None]
        mode = self.cfg.reward_mode
        if mode == "task":
            if any(given):
                _warn_once("reward-task", "the environment's step rewards are ignored (task.env.openenv.reward_mode="
                           "task): the task's reward scores the final message")
            return None
        if mode == "last":
            return self.rewards[-1] if self.rewards else None
        return sum(given) if given else None

    def metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        """End the session (at done, on a failed step, and by covrl at the end of every batch)."""
        client, url = self.client, self.url
        self.client = None
        if client is not None:
            self.pool.release(url, client)


def build_openenv(task: Task, cfg: EnvironmentConfig) -> Callable[[], OpenEnvEnvironment]:
    """The factory of `task.env.name=openenv` episodes: a fresh OpenEnvEnvironment per episode, all sharing the
    servers (started at the first episode for `task.env.openenv.server`)."""
    oe = cfg.openenv
    if oe.base_url is None and oe.server is None:
        raise ValueError("task.env.name=openenv needs task.env.openenv.base_url (a running OpenEnv server, e.g. "
                         "http://127.0.0.1:8000) or task.env.openenv.server (an app 'module:app' covrl starts)")
    if importlib.util.find_spec("openenv") is None:
        raise MissingExtraError("task.env.name=openenv: 'openenv' (openenv-core) is not installed; install the extra "
                                "with: pip install 'covrl[envs]'")
    if oe.server is not None:
        _app_location(oe.server)   # a wrong spec fails at start-up, not at the first episode
    pool = _Pool(oe)
    return lambda: OpenEnvEnvironment(task, cfg, pool)


ENVIRONMENTS["openenv"] = build_openenv
