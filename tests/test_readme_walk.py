"""Every shell command of README.md, typed as written, on the tiny model.

The commands run in a copy of the checkout (its tracked files, committed into a fresh git repository), in README
order, with `.venv/bin` first on PATH as the README's install line puts it. Each must exit 0 and leave
`git status` clean: nothing a newcomer types may rewrite a tracked file. What changes is only the size of the
run: the SmolLM2 config becomes the tiny model, every run takes 2 steps, a benchmark its quick variant. A
command that needs what a 2-core CPU test box lacks (vLLM's own venv, a Ray cluster, a GPU) is not run, and must say so
in its comment on the README line."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

# what a README line needs that a test machine may lack -> the words its comment must use to say so
NEEDS = {
    "vllm": (lambda cmd: ".venv-vllm/" in cmd or "sampler.backend=vllm" in cmd, ("vllm",)),
    "ray cluster": (lambda cmd: "ray_address=" in cmd, ("cluster",)),
    "gpu": (lambda cmd: "device=cuda" in cmd, ("gpu", "cuda")),
}
# the size of every run: tiny model, 2 steps, 4 held-out prompts (a long reasoning-gym prompt fits its context)
TINY_MODEL = ["model.source=tiny", "task.chat_template=false", "model.tiny.max_positions=1024"]
SHORT_RUN = ["loop.steps=2", "eval.max_prompts=4"]


def readme_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def readme_commands() -> list[tuple[str, str]]:
    """(command, its comment) of every line of the README's bash blocks; backslash continuations joined."""
    out = []
    for block in readme_blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            command, _, comment = line.partition(" #")
            if command.strip():
                out.append((" ".join(command.split()), comment.strip()))
    return out


def needs_of(command: str) -> str | None:
    return next((name for name, (test, _) in NEEDS.items() if test(command)), None)


def sized(command: str) -> str:
    """The command at the tiny model's size (see the module docstring)."""
    words = shlex.split(command)
    if "train" in words and ("covrl" in words[0] or "-m" in words):
        extra = list(SHORT_RUN)
        if "configs/default.yaml" in words:
            extra = TINY_MODEL + extra
        if "configs/tiny.yaml" in words:
            extra.append("sft_warmup.steps=2")
        if "--resume" in words:   # the run's own config is the tiny one already
            extra = ["loop.steps=2"]
        words += extra
    if words[:3] == ["covrl", "bench", "trl"]:
        words = [w for w in words if w not in ("--model", "smollm2")] + ["--quick"]
    return shlex.join(words)


def expand_make(command: str, cwd: Path, env: dict) -> list[str]:
    """`make T`: the covrl commands its recipe runs (the rest is the venv set-up, run by `make setup`)."""
    target = shlex.split(command)[1]
    dry = subprocess.run(["make", "-n", target], cwd=cwd, env=env, capture_output=True, text=True)
    assert dry.returncode == 0, f"README: `{command}`: no such make target ({dry.stderr.strip()})"
    return [re.sub(r"^\S*\.venv/bin/covrl", "covrl", line) for line in dry.stdout.splitlines()
            if re.match(r"^\S*covrl ", line)]


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """The tracked files, as they are in the working tree, committed into a fresh repository."""
    dest = tmp_path_factory.mktemp("readme") / "covrl"
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True)
    if listed.returncode != 0:   # not a git checkout (an exported tree): all but the venvs, runs and caches
        shutil.copytree(ROOT, dest, symlinks=True, ignore=shutil.ignore_patterns(
            ".venv", ".venv-vllm", "runs", ".git", "__pycache__", ".pytest_cache", ".ruff_cache", ".hypothesis",
            "*.egg-info"))
    for name in filter(None, listed.stdout.decode().split("\0") if listed.returncode == 0 else []):
        src = ROOT / name
        if src.is_symlink() or src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            if src.is_symlink():
                os.symlink(os.readlink(src), dest / name)
            else:
                shutil.copy2(src, dest / name)
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "readme walk"]):
        subprocess.run(git + args, cwd=dest, check=True)
    return dest


def test_the_readme_says_how_covrl_gets_on_path():
    text = (ROOT / "README.md").read_text()
    assert "source .venv/bin/activate" in text or ".venv/bin:$PATH" in text


def test_the_reward_snippet_runs_as_printed():
    (snippet,) = [b for b in readme_blocks("python") if "def last_int" in b]
    scope: dict = {}
    exec(compile(snippet, "README.md", "exec"), scope)   # imports included: the snippet is complete
    assert scope["last_int"]("7 x 8 = 56", SimpleNamespace(answer=56)) == 1.0
    assert scope["last_int"]("no digits", SimpleNamespace(answer=56)) == 0.0


@pytest.mark.slow   # a long end-to-end run: make test-slow (the default suite stays near 10 minutes)
def test_every_readme_command_runs_on_the_tiny_model_and_leaves_the_checkout_clean(checkout):
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "COVRL_SKIP_VLLM": "1"}
    env.pop("COVRL_DEBUG", None)
    ran, documented = [], []
    for command, comment in readme_commands():
        need = needs_of(command)
        if need is not None:   # not run here: its comment must say what it needs
            words = NEEDS[need][1]
            assert any(w in comment.lower() for w in words), f"README: `{command}` needs {need}; say so in its comment"
            documented.append(command)
            continue
        if command.startswith(("source ", "export ")):
            continue   # PATH: this test puts the venv first already
        if command.startswith("make "):
            to_run = [sized(c) for c in expand_make(command, checkout, env)]
        else:
            to_run = [sized(command)]
        for line in to_run:
            proc = subprocess.run(line, shell=True, cwd=checkout, env=env, capture_output=True, text=True,
                                  timeout=600)
            assert proc.returncode == 0, f"README: `{command}` ran as `{line}`: exit {proc.returncode}\n" \
                                         f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
            assert "Traceback" not in proc.stderr, f"`{line}` printed a traceback:\n{proc.stderr[-3000:]}"
            status = subprocess.run(["git", "status", "--porcelain"], cwd=checkout, capture_output=True,
                                    text=True, check=True).stdout
            assert status == "", f"README: `{command}` changed tracked files:\n{status}"
            ran.append(line)
    assert len(ran) >= 8 and documented, (ran, documented)
