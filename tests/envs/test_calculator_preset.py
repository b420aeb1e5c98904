"""configs/calculator.yaml (SmolLM2 learns to rely on the calculator tool; docs/environments.md): the preset
validates, its demonstration reaches the prompt before the problem and never shows a held-out problem; one RL
step on SmolLM2 runs end to end (slow)."""

from __future__ import annotations

import pytest

from covrl.config import load_preset
from covrl.models.tiny import char_tokenizer
from covrl.tasks import build_task
from covrl.tasks.render import prompt_ids
from covrl.tasks.tools import parse_tool_calls

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_calculator_preset_demonstration():
    cfg = load_preset("calculator")
    assert cfg.model.source == "smollm2" and cfg.task.env.name == "calculator" and cfg.task.arithmetic.ops == ["*"]
    task = build_task(cfg.task)
    demo = cfg.task.env.demonstration
    shown = {m.content for m in demo if m.role == "user"}
    assert shown and not shown & {ex.prompt for ex in task.eval}   # held-out problems stay unseen
    # every demonstrated call is well formed and its tool message is the tool's true answer
    env = task.environment()
    for call_msg, result in [(m, demo[i + 1]) for i, m in enumerate(demo) if m.role == "assistant"
                             and "<tool_call>" in m.content]:
        (call,) = parse_tool_calls(call_msg.content)
        assert call.error is None and env.executor.execute(call) == result.content
    tok = char_tokenizer()
    tok.chat_template = CHATML
    ex = task.eval[0]
    text = tok.decode(prompt_ids(tok, env.reset(ex), env.tools, chat_template=True))
    assert text.count("<tool_call>") == 2 + 1 and text.rindex("<|im_start|>tool") < text.index(ex.prompt)


@pytest.mark.slow
def test_calculator_preset_one_step_on_smollm2(tmp_path):
    # about a minute on one core: SmolLM2 loads, one step of 2 prompts x 2 episodes, evaluations on 2 prompts
    from covrl.train.run.driver import run_loop
    from covrl.train.run.folder import prepare_run
    from covrl.train.run.sources import SyncSource, build_sync_source

    cfg = load_preset("calculator", {"run.output_dir": str(tmp_path), "loop.steps": 1, "loop.prompts_per_step": 2,
                                     "loop.group_size": 2, "eval.max_prompts": 2, "eval.sampled": False,
                                     "logging.console": False, "logging.curves": False})
    run = prepare_run(cfg, console=False)
    source = build_sync_source(run)
    assert type(source) is SyncSource   # episodes: generate_batch dispatches on the environment
    summary = run_loop(run, source)
    run.close()
    assert summary["status"] == "completed"
    greedy = run.evals[0]["greedy"]
    assert {"tool_call_rate", "tool_errors", "accuracy"} <= set(greedy)
