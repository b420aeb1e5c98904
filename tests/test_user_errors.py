"""A catalogue of user mistakes, each run as the real `covrl` command in a fresh folder: every one ends with exit
code 2 and one message on stderr that names what to fix, without a traceback (before any training starts); with
COVRL_DEBUG=1 or `covrl --debug` the traceback comes back."""

from __future__ import annotations

import importlib.util
import os
import re
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")
TIMES_REWARD = str(REPO / "examples" / "times_reward.py")
# tiny.yaml for another task.name: without its arithmetic options, which another task would refuse
TINY_OTHER_TASK = re.sub(r"(?m)^  arithmetic:.*\n", "", Path(TINY).read_text())
# short runs: no warm-up, a few examples, no evaluation or checkpoint (an error must come before any of them)
FAST = ["sft_warmup.steps=0", "loop.steps=2", "task.n_train=16", "task.n_eval=2", "eval.before=false",
        "eval.after=false", "checkpoint.at_end=false", "loop.prompts_per_step=2", "loop.group_size=2"]


def covrl(args: list[str], cwd: Path, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k not in ("COVRL_DEBUG", "RAY_ADDRESS")}
    environment.update(env or {})
    return subprocess.run([sys.executable, "-m", "covrl", *args], cwd=cwd, env=environment, capture_output=True,
                          text=True, timeout=timeout)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write(path: Path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


@dataclass
class Case:
    args: list[str]                       # the command line after `covrl`; {tmp} is the case's folder
    words: list[str]                      # what the message must name
    files: dict[str, str] = field(default_factory=dict)   # files to write under {tmp} first
    absent: list[str] = field(default_factory=list)       # what the message must not say
    slow: bool = False                    # kept out of the quick suite (the quick one holds a case of each kind)

    def command(self, tmp: Path) -> list[str]:
        for name, text in self.files.items():
            write(tmp / name, text)
        return [a.replace("{tmp}", str(tmp)) for a in self.args]


OLD_VERIFIERS_ENV = '''import verifiers as vf
from datasets import Dataset


def load_environment(**kwargs):
    dataset = Dataset.from_list([{"question": "1+1", "answer": "2"}])

    def correct(completion, answer, **kwargs):
        return float(answer in str(completion))

    return vf.SingleTurnEnv(dataset=dataset, rubric=vf.Rubric(funcs=[correct]))
'''

CASES = {
    # -- config ------------------------------------------------------------------------------------------------
    "yaml_unknown_field": Case(["train", "--config", "{tmp}/c.yaml"], ["c.yaml:2", "optim.lrr", "unknown key",
                                                                      "did you mean 'lr'"],
                               files={"c.yaml": "optim:\n  lrr: 1.0e-5\n"}),
    "yaml_misspelt_section": Case(["train", "--config", "{tmp}/c.yaml"], ["c.yaml:1", "optm", "did you mean 'optim'"],
                                  files={"c.yaml": "optm:\n  lr: 1.0e-5\n"}, slow=True),
    "override_misspelt_section": Case(["train", "--config", TINY, "optm.lr=1e-5"],
                                      ["override 'optm.lr=1e-5'", "did you mean 'optim'"], absent=["tiny.yaml"]),
    "override_unknown_field": Case(["train", "--config", TINY, "optim.lrr=1e-5"],
                                   ["override 'optim.lrr=1e-5'", "unknown key in optim", "did you mean 'lr'"], slow=True),
    "override_without_value": Case(["train", "--config", TINY, "optim.lr"], ["'optim.lr'", "section.key=value"], slow=True),
    "bad_value_type": Case(["train", "--config", TINY, "optim.lr=fast"], ["optim.lr", "valid number", "'fast'"]),
    "out_of_range_value": Case(["train", "--config", TINY, "optim.lr=-1"], ["optim.lr", "greater than 0"]),
    "missing_config_file": Case(["train", "--config", "{tmp}/nope.yaml"], ["config file not found", "nope.yaml"]),
    "yaml_syntax_error": Case(["train", "--config", "{tmp}/c.yaml"], ["c.yaml:3", "invalid YAML"],
                              files={"c.yaml": "run:\n  name: [x\n"}),
    "no_config": Case(["train", "optim.lr=1e-5"], ["--config FILE is required"], slow=True),
    # -- data --------------------------------------------------------------------------------------------------
    "jsonl_missing_file": Case(["train", "--config", "{tmp}/t.yaml", "task.name=jsonl", "task.path={tmp}/none.jsonl",
                                *FAST], ["none.jsonl", "does not exist"], files={"t.yaml": TINY_OTHER_TASK}, slow=True),
    "jsonl_bad_row": Case(["train", "--config", "{tmp}/t.yaml", "task.name=jsonl", "task.path={tmp}/d.jsonl", *FAST],
                          ["d.jsonl:3", "invalid JSON"],
                          files={"t.yaml": TINY_OTHER_TASK, "d.jsonl": '{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4"}\n'
                                            '{"prompt": oops}\n'}),
    "jsonl_missing_answer": Case(["train", "--config", "{tmp}/t.yaml", "task.name=jsonl", "task.path={tmp}/d.jsonl", *FAST],
                                 ["d.jsonl:2", "missing field 'answer'", "solution"],
                                 files={"t.yaml": TINY_OTHER_TASK, "d.jsonl": '{"prompt": "1+1=", "answer": "2"}\n'
                                                   '{"prompt": "2+2=", "solution": "4"}\n'}),
    "output_dir_is_a_file": Case(["train", "--config", TINY, "run.output_dir={tmp}/afile", *FAST],
                                 ["run.output_dir", "afile", "Not a directory"], files={"afile": ""}, slow=True),
    # -- rewards -----------------------------------------------------------------------------------------------
    "reward_file_missing": Case(["train", "--config", TINY, "task.reward={tmp}/nofile.py:f", *FAST],
                                ["task.reward", "nofile.py", "does not exist"]),
    "reward_function_missing": Case(["train", "--config", TINY, f"task.reward={TIMES_REWARD}:last_integer", *FAST],
                                    ["task.reward", "times_reward.py", "'last_integer'", "it defines: last_int"]),
    "reward_module_missing": Case(["train", "--config", TINY, "task.reward=no_such_rewards_mod:f", *FAST],
                                  ["task.reward", "no module named 'no_such_rewards_mod'"], slow=True),
    "reward_file_fails_to_import": Case(["train", "--config", TINY, "task.reward={tmp}/r.py:f", *FAST],
                                        ["task.reward", "r.py:4", "ZeroDivisionError"],
                                        files={"r.py": "def f(completion, example):\n    return 1.0\n\nx = 1 / 0\n"}, slow=True),
    "reward_not_registered": Case(["train", "--config", TINY, "task.reward=nearly_right", *FAST],
                                  ["reward 'nearly_right' is not registered", "last_number"], slow=True),
    # -- tasks -------------------------------------------------------------------------------------------------
    "unknown_task": Case(["train", "--config", TINY, "task.name=arithmatic", *FAST],
                         ["task.name", "'arithmatic'", "'arithmetic'"]),
    # -- environments ------------------------------------------------------------------------------------------
    "unknown_env": Case(["train", "--config", TINY, "task.env.name=abacus", *FAST],
                        ["task.env.name='abacus'", "calculator"]),
    "env_class_missing": Case(["train", "--config", TINY, "task.env.name={tmp}/envs.py:Bar", *FAST],
                              ["task.env.name", "envs.py", "no class 'Bar'", "it defines: Foo"],
                              files={"envs.py": "class Foo:\n    def step(self, message):\n        pass\n"}, slow=True),
    # -- engines -----------------------------------------------------------------------------------------------
    "ray_address_without_cluster": Case(["train", "--config", TINY, "loop.mode=ray",
                                         "async_loop.ray_address=127.0.0.1:{port}", *FAST],
                                        ["async_loop.ray_address", "no Ray cluster", "ray start --head"]),
    # -- servers and other commands ----------------------------------------------------------------------------
    "serve_bad_host": Case(["serve", "--host", "no-such-host.invalid", "--port", "0", "--dir", "{tmp}/s"],
                           ["--host 'no-such-host.invalid'", "127.0.0.1"]),
    "serve_bad_port": Case(["serve", "--port", "70000", "--dir", "{tmp}/s"], ["--port 70000", "0 to 65535"], slow=True),
    "eval_missing_run": Case(["eval", "--run", "{tmp}/runs/nope"], ["--run", "no such folder"]),
    "diagnose_not_model_folders": Case(["diagnose", "--before", "{tmp}", "--after", "{tmp}"],
                                       ["not a transformers model folder", "config.json"], slow=True),
    "bench_unknown": Case(["bench", "rollot"], ["unknown benchmark 'rollot'", "did you mean 'rollout'"], slow=True),
    # (they import verifiers, ray or reasoning_gym)
    "old_verifiers_api": Case(["train", "--config", "{tmp}/t.yaml", "task.name=verifiers", "task.verifiers.taskset={tmp}/old_env",
                               *FAST],
                              ["task.verifiers.taskset", "verifiers API before 0.4", "load_environment",
                               "verifiers.v1", "vf.Taskset", "__all__"],
                              files={"t.yaml": TINY_OTHER_TASK, "old_env/__init__.py": OLD_VERIFIERS_ENV}, absent=["defines no `__all__`"],
                              slow=True),   # ~12 s: it imports verifiers
    "unknown_reasoning_gym_dataset": Case(["train", "--config", "{tmp}/t.yaml", "task.name=reasoning_gym",
                                           "task.reasoning_gym.dataset=no_such_puzzles", *FAST],
                                          ["task.reasoning_gym", "no_such_puzzles"], files={"t.yaml": TINY_OTHER_TASK},
                                          slow=True),
}


def check_one_message(result: subprocess.CompletedProcess, command: str, words: list[str],
                      absent: list[str] = ()) -> None:
    err = result.stderr
    assert result.returncode == 2, f"exit code {result.returncode}\n{err}"
    assert "Traceback" not in err, err
    prefix = f"covrl {command}: "
    assert err.startswith(prefix) and err.count(prefix) == 1, err   # one message
    assert len(err.strip().splitlines()) <= 2, err   # "invalid config:" and the problem's line at most
    for word in words:
        assert word in err, f"{word!r} not in: {err}"
    for word in absent:
        assert word not in err, f"{word!r} in: {err}"
    assert "step 1/" not in result.stdout   # it stopped before training


def run_case(case: Case, tmp_path: Path) -> None:
    args = [a.replace("{port}", str(free_port())) for a in case.command(tmp_path)]
    result = covrl(args, cwd=tmp_path)
    check_one_message(result, args[0], case.words, case.absent)


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] if c.slow else []) for n, c in CASES.items()])
def test_user_error_is_one_message_and_exit_2(name, tmp_path):
    if name == "unknown_reasoning_gym_dataset" and importlib.util.find_spec("reasoning_gym") is None:
        pytest.skip("reasoning_gym is not installed (extra covrl[reasoning])")
    run_case(CASES[name], tmp_path)


def test_vllm_backend_without_vllm(tmp_path):
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    result = covrl(["train", "--config", TINY, "sampler.backend=vllm", *FAST], cwd=tmp_path)
    check_one_message(result, "train", ["sampler.backend", "covrl[vllm]"])


def test_ray_auto_without_cluster(monkeypatch, capsys):
    """async_loop.ray_address=auto where Ray finds no cluster (Ray's own error, raised here: `auto` joins any Ray
    instance running on the machine, so the real lookup depends on what else runs)."""
    from covrl.config import load_preset
    from covrl.train.launch import ray as ray_launch

    def no_cluster(acfg, *args):
        raise ConnectionError("Could not find any running Ray instance. Please specify the one to connect to by "
                              "setting `--address` flag or `RAY_ADDRESS` environment variable.")

    monkeypatch.delenv("COVRL_DEBUG", raising=False)
    monkeypatch.setattr(ray_launch, "ensure_ray", no_cluster)
    cfg = load_preset("tiny", ["loop.mode=ray", "async_loop.ray_address=auto"])
    assert ray_launch.train_from_config_ray(cfg) == 2
    err = capsys.readouterr().err
    assert err.count("covrl train: ") == 1 and len(err.strip().splitlines()) == 1, err
    for word in ("async_loop.ray_address='auto'", "no Ray cluster", "ray start --head", "remove async_loop.ray_address"):
        assert word in err, err


def test_serve_on_a_busy_port(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = covrl(["serve", "--port", str(port), "--dir", str(tmp_path / "s")], cwd=tmp_path)
    check_one_message(result, "serve", [f"--port {port}", "already in use", "--port 0"])


@pytest.mark.slow
def test_reward_function_failing_on_every_call_stops_before_training(tmp_path):
    """The function's own traceback is shown (the user's code, to fix), then one stop message; no update runs."""
    reward = write(tmp_path / "raiser.py", "def bad(completion, example):\n    raise RuntimeError('boom')\n")
    result = covrl(["train", "--config", TINY, f"task.reward={reward}:bad", "task.max_consecutive_reward_errors=1",
                    *FAST], cwd=tmp_path)
    err = result.stderr
    assert result.returncode == 2, err
    assert err.count("covrl train: ") == 1 and "reward function" in err and "max_consecutive_reward_errors" in err
    assert f'File "{reward}", line 2, in bad' in err and "RuntimeError: boom" in err   # where to fix it
    assert err.rstrip().splitlines()[-1].startswith("stopped; fix the cause")
    assert "step 1/" not in result.stdout


@pytest.mark.parametrize("how", ["env", pytest.param("flag", marks=pytest.mark.slow)])
def test_debug_mode_shows_the_traceback(how, tmp_path):
    args = ["train", "--config", TINY, f"task.reward={TIMES_REWARD}:last_integer", *FAST]
    if how == "flag":
        result = covrl(["--debug", *args], cwd=tmp_path)
    else:
        result = covrl(args, cwd=tmp_path, env={"COVRL_DEBUG": "1"})
    assert result.returncode == 1, result.stderr
    assert "Traceback (most recent call last)" in result.stderr
    assert "ConfigError" in result.stderr and "'last_integer'" in result.stderr


def test_debug_flag_is_listed_in_help(tmp_path):
    result = covrl(["--help"], cwd=tmp_path)
    assert result.returncode == 0 and "--debug" in result.stdout
