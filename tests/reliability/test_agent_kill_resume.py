"""kill -9 of a tiny `covrl train` run whose rollouts are an agent program's episodes (task.agent.fn), after a
checkpoint, then `--resume`: every step's prompts are trained exactly once (the killed step's episodes were
played, not trained, and the resumed run plays the same prompts again), and with one episode at a time (the
endpoint's draws in a fixed order) the final weights and every logged step equal an uninterrupted run's."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from _reliability_tiny import metrics
from test_kill_resume import PROMPTS, ROWS, assert_equal_to_reference, finish, start

from covrl.train.run import checkpoint as ckpt

pytest.importorskip("openai")
pytestmark = [pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX signals"), pytest.mark.slow]

AGENT = '''
import os

import openai

LOG = {log!r}


async def run(base_url, api_key, example):
    with open(LOG, "a") as f:     # which process played which prompt
        f.write(f"{{os.getpid()}}\\t{{example.prompt}}\\n")
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    await client.chat.completions.create(model="covrl", messages=[{{"role": "user", "content": example.prompt}}])
    return None   # the task's reward (the tests' dense digit_fraction)
'''


def played(log: Path) -> list[tuple[str, list[str]]]:
    """(pid, the prompts of each step it played) per process, in order: a step is ROWS episodes (sync loop)."""
    out: list[tuple[str, list[str]]] = []
    for line in log.read_text().splitlines():
        pid, prompt = line.split("\t")
        if not out or out[-1][0] != pid:
            out.append((pid, []))
        out[-1][1].append(prompt)
    return out


def steps_of(prompts: list[str]) -> list[list[str]]:
    return [sorted(prompts[i:i + ROWS]) for i in range(0, len(prompts), ROWS)]


def test_an_agent_run_killed_after_a_checkpoint_resumes_and_trains_every_prompt_once(tmp_path):
    def agent(name: str) -> list[str]:
        log = tmp_path / f"{name}.log"
        path = tmp_path / f"{name}_agent.py"
        path.write_text(AGENT.format(log=str(log)))
        return [f"task.agent.fn={path}:run", "task.agent.concurrency=1"]

    ref = start(tmp_path, "ref", *agent("ref"))
    # killed after step 3's episodes were played (checkpoints after steps 1 and 2), before it trained on them
    victim = start(tmp_path, "victim", *agent("victim"), fault="generate:3")
    rc, _, err = finish(victim)
    assert rc == -signal.SIGKILL, err
    run_dir = tmp_path / "victim"
    assert [p.name for p in ckpt.list_checkpoints(run_dir)] == [ckpt.checkpoint_name(ROWS), ckpt.checkpoint_name(2 * ROWS)]
    assert [r["step"] for r in metrics(run_dir)] == [1, 2]
    rc, out, err = finish(start(tmp_path, "victim", *agent("victim"), resume=True))
    assert rc == 0, err
    assert f"resumed from {run_dir / 'checkpoints' / ckpt.checkpoint_name(2 * ROWS)}" in out
    rc, _, err = finish(ref)
    assert rc == 0, err
    (_, reference), = played(tmp_path / "ref.log")
    (_, killed), (_, resumed) = played(tmp_path / "victim.log")
    want = steps_of(reference)
    assert len(want) == 4 and all(len(set(s)) == PROMPTS for s in want)
    # the killed process played steps 1-3; steps 1-2 were checkpointed, so the resumed one starts at step 3
    assert steps_of(killed) == want[:3] and steps_of(resumed) == want[2:]
    assert_equal_to_reference(run_dir, tmp_path / "ref")
