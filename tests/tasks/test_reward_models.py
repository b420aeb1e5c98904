"""Reward terms scored by models: a sequence-classification reward model (kind model) scores as a direct forward
does, whatever the batching; an LLM judge (kind judge) behind a local OpenAI-compatible endpoint gets the filled
template, its grades parse, retries, timeouts, unparseable replies and a dead endpoint are counted and stop the run
by the user-reward rule without hanging; a local causal-LM judge; a few training steps with each kind."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from covrl.config import dump_config, load_preset
from covrl.models import char_tokenizer, tiny_llama
from covrl.tasks import RewardFunctionError, TaskConfig, build_task
from covrl.tasks.config import JudgeConfig
from covrl.tasks.reward_models import JudgeParseError, fill_template, parse_grade

torch.set_num_threads(1)

COMPLETIONS = ["12", "1", "the answer is 7", "", "99 bottles of beer on the wall, 99 bottles", "3"]
TEMPLATE = "Q:{prompt}|A:{answer}|R:{completion}|"


def arithmetic_task(**options):
    return build_task(TaskConfig(name="arithmetic", chat_template=False, n_train=16, n_eval=2, **options))


def examples_for(task, n=len(COMPLETIONS)):
    return [task.train[i % len(task.train)] for i in range(n)]


# --- reward model -----------------------------------------------------------------------------------------------


def save_reward_model(folder, *, chat_template: str | None = None, num_labels: int = 2):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    tok = char_tokenizer()
    if chat_template:
        tok.chat_template = chat_template
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
                         bos_token_id=1, eos_token_id=2, num_labels=num_labels,
                         id2label={i: f"l{i}" for i in range(num_labels)},
                         label2id={f"l{i}": i for i in range(num_labels)})
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def rm_path(tmp_path_factory):
    return save_reward_model(tmp_path_factory.mktemp("rm"))


def direct_scores(path, texts, *, label=0, special=True):
    """One unpadded forward per text of the saved model, the score read at the last token."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    model.config.pad_token_id = None   # batch of one: the last token, whatever its id
    with torch.no_grad():
        return [float(model(torch.tensor([tok(t, add_special_tokens=special)["input_ids"]])).logits[0, label])
                for t in texts]


@pytest.mark.parametrize("batch_size", [1, 4, 64])
def test_reward_model_scores_equal_a_direct_forward_whatever_the_batching(rm_path, batch_size):
    task = arithmetic_task(rewards=[{"kind": "model", "model": {"path": rm_path, "batch_size": batch_size},
                                     "weight": 0.5, "name": "rm"}])
    examples = examples_for(task)
    out = task.score(COMPLETIONS, examples)
    expected = direct_scores(rm_path, [ex.plain_prompt + c for c, ex in zip(COMPLETIONS, examples)])
    assert out.errors == 0
    assert out.rewards == pytest.approx([0.5 * e for e in expected], abs=1e-5)
    m = out.metrics
    assert m["reward/model/rm/mean"] == pytest.approx(sum(expected) / len(expected), abs=1e-5)
    assert m["reward/model/rm/min"] == pytest.approx(min(expected), abs=1e-5)
    assert m["reward/model/rm/max"] == pytest.approx(max(expected), abs=1e-5)
    assert m["reward/model/rm/std"] == pytest.approx(float(torch.tensor(expected).std(unbiased=False)), abs=1e-5)
    assert m["reward/reward/rm"] == pytest.approx(m["reward/model/rm/mean"], abs=1e-6)


def test_reward_model_label_by_name_normalise_and_a_text_ending_in_the_pad_token(rm_path):
    completions = ["7<pad>", "8", "<pad>"]   # the char tokenizer's pad token is text it reads as pad id 0
    task = arithmetic_task(rewards=[{"kind": "model", "name": "rm",
                                     "model": {"path": rm_path, "label": "l1", "normalise": "sigmoid"}}])
    examples = examples_for(task, 3)
    out = task.score(completions, examples)
    raw = direct_scores(rm_path, [ex.plain_prompt + c for c, ex in zip(completions, examples)], label=1)
    assert out.rewards == pytest.approx([float(torch.sigmoid(torch.tensor(r))) for r in raw], abs=1e-5)
    softmax = arithmetic_task(rewards=[{"kind": "model", "model": {"path": rm_path, "normalise": "softmax"}}])
    assert all(0.0 < r < 1.0 for r in softmax.score(completions, examples).rewards)
    bad = arithmetic_task(rewards=[{"kind": "model", "model": {"path": rm_path, "label": "l7"}}])
    with pytest.raises(RewardFunctionError, match=r"task.rewards\[0\].model.label='l7'.*'l0', 'l1'"):
        bad.score(completions, examples)


def test_reward_model_uses_its_own_chat_template(tmp_path):
    template = "{% for m in messages %}[{{ m.role }}]{{ m.content }}\n{% endfor %}"
    path = save_reward_model(tmp_path / "rm_chat", chat_template=template)
    task = build_task(TaskConfig(name="arithmetic", n_train=8, n_eval=2, system_prompt="be brief",
                                 rewards=[{"kind": "model", "model": {"path": path, "batch_size": 2}}]))
    examples = examples_for(task, 3)
    term = task._terms[0][2]
    texts = [t for t, _ in term.texts(COMPLETIONS[:3], examples)]
    assert texts[0] == f"[system]be brief\n[user]{examples[0].prompt}\n[assistant]{COMPLETIONS[0]}\n"
    out = task.score(COMPLETIONS[:3], examples)
    assert out.rewards == pytest.approx(direct_scores(path, texts, special=False), abs=1e-5)


def test_a_missing_reward_model_folder_is_an_error_naming_the_field(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"task.rewards\[1\].model.path='.*nowhere': no such local folder"):
        arithmetic_task(rewards=[{"fn": "last_number"}, {"kind": "model", "model": {"path": str(tmp_path / "nowhere")}}])
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"task.rewards\[0\].model.path=.*no config.json"):
        arithmetic_task(rewards=[{"kind": "model", "model": {"path": str(tmp_path / "empty")}}])


@pytest.mark.parametrize("fields, pattern", [
    ({"kind": "model"}, "needs `model`"),
    ({"model": {"path": "x"}}, "set kind accordingly"),
    ({"kind": "model", "fn": "last_number", "model": {"path": "x"}}, "remove fn"),
    ({"kind": "model", "model": {"path": "x", "batch": 2}}, "batch"),
    ({"kind": "judge", "judge": {}}, "exactly one of base_url"),
    ({"kind": "judge", "judge": {"base_url": "http://x", "template": "no placeholder"}}, "{completion}"),
    ({"kind": "judge", "judge": {"base_url": "http://x", "pattern": r"\d+"}}, "no group"),
    ({"kind": "judge", "judge": {"base_url": "http://x", "parse": "label", "labels": {"yes": 2}}}, r"\[0, 1\]"),
])
def test_model_and_judge_term_config_errors(fields, pattern):
    with pytest.raises(ValueError, match=pattern):
        TaskConfig(rewards=[fields])


def test_a_failing_forward_is_counted_and_stops_by_the_rate_rule(rm_path, monkeypatch):
    task = arithmetic_task(reward_error_window=8, max_reward_error_rate=0.5,
                           rewards=[{"fn": "last_number"}, {"kind": "model", "model": {"path": rm_path}}])
    examples = examples_for(task, 4)
    runner = task._terms[1][2]
    shown = []
    runner.watch.report = shown.append
    model = runner._load()[0]

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setattr(model, "forward", broken)
    out = task.score(COMPLETIONS[:4], examples)
    assert out.errors == 4 and out.metrics["reward/errors/model"] == 4.0
    assert out.rewards == [task._terms[0][2](COMPLETIONS[:4], examples)[0][i] for i in range(4)]   # term 1 gives 0
    assert len(shown) == 1 and "reward model model failed on completion 0" in shown[0]
    assert "CUDA out of memory (simulated)" in shown[0] and "Traceback" in shown[0]
    with pytest.raises(RewardFunctionError, match="100% of its last 8 completions"):
        task.score(COMPLETIONS[:4], examples)


# --- judge: an OpenAI-compatible endpoint ------------------------------------------------------------------------


class JudgeServer:
    """A local OpenAI-compatible /v1/chat/completions: `rule(body, n)` -> (status, reply text, delay seconds),
    n = requests so far; by default grade 1 when the completion holds the reference answer."""

    def __init__(self):
        self.received: list[dict] = []
        self.rule = self.grade_by_answer
        self.lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with owner.lock:
                    owner.received.append({"path": self.path, **body})
                    n = len(owner.received)
                status, text, delay = owner.rule(body, n)
                time.sleep(delay)
                payload = (json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}]})
                           if status == 200 else text).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except OSError:   # the client gave up (a timeout test)
                    pass

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    @staticmethod
    def grade_by_answer(body, n):
        m = re.search(r"\|A:(.*)\|R:(.*)\|", body["messages"][-1]["content"], re.S)
        return 200, f"Reasoning... Grade: {int(m.group(1) in m.group(2))}", 0.0

    def close(self):
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
            self.httpd = None


@pytest.fixture()
def server():
    s = JudgeServer()
    yield s
    s.close()


def judge_task(url, *, task_options=None, **judge):
    options = {"base_url": url, "model": "judge-m", "template": TEMPLATE, "max_grade": 1, "concurrency": 2,
               "backoff_s": 0.01, **judge}
    task = arithmetic_task(rewards=[{"kind": "judge", "name": "j", "judge": options}], **(task_options or {}))
    shown = []
    task._terms[0][2].watch.report = shown.append
    return task, shown


@pytest.mark.timeout(60)
def test_judge_grades_from_the_filled_template(server):
    task, shown = judge_task(server.url, system_prompt="You grade.")
    examples = examples_for(task, 4)
    completions = [examples[0].answer, "wrong", f"it is {examples[2].answer}!", "{answer}"]
    out = task.score(completions, examples)
    assert out.rewards == [1.0, 0.0, 1.0, 0.0] and out.errors == 0 and not shown
    got = sorted(server.received, key=lambda b: b["messages"][-1]["content"])
    sent = sorted((fill_template(TEMPLATE, ex.prompt, c, ex.answer) for c, ex in zip(completions, examples)))
    assert [b["messages"][-1]["content"] for b in got] == sent
    assert any(text.endswith("R:{answer}|") for text in sent)   # a placeholder inside a completion stays
    body = server.received[0]
    assert body["path"] == "/v1/chat/completions" and body["model"] == "judge-m" and body["temperature"] == 0.0
    assert body["messages"][0] == {"role": "system", "content": "You grade."} and body["max_tokens"] == 64
    m = out.metrics
    assert m["reward/judge/j/mean"] == sum(out.rewards) / 4 and m["reward/judge/j/parse_failures"] == 0.0
    assert m["reward/judge/j/retries"] == 0.0 and 0.0 < m["reward/judge/j/latency_s"] <= m["reward/judge/j/latency_max_s"]
    assert m["reward/reward/j"] == sum(out.rewards) / 4


@pytest.mark.timeout(60)
def test_judge_retries_after_a_500_and_not_after_a_400(server):
    server.rule = lambda body, n: (500, "overloaded", 0.0) if n <= 2 else JudgeServer.grade_by_answer(body, n)
    task, shown = judge_task(server.url, concurrency=1, retries=2)
    examples = examples_for(task, 2)
    out = task.score([examples[0].answer, examples[1].answer], examples)
    assert out.rewards == [1.0, 1.0] and out.errors == 0 and out.metrics["reward/judge/j/retries"] == 2.0
    assert len(server.received) == 4
    server.rule = lambda body, n: (400, "bad request: unknown model", 0.0)
    before = len(server.received)
    out = task.score(["1"], examples[:1])
    assert len(server.received) == before + 1   # a 400 is not retried
    assert out.errors == 1 and out.metrics["reward/judge/j/request_errors"] == 1.0
    assert "answered HTTP 400: bad request: unknown model" in shown[0] and server.url in shown[0]


@pytest.mark.timeout(60)
def test_judge_timeout_is_counted(server):
    server.rule = lambda body, n: (200, "Grade: 1", 3.0 if "R:slow|" in body["messages"][-1]["content"] else 0.0)
    task, shown = judge_task(server.url, timeout_s=0.3, retries=1)
    examples = examples_for(task, 2)
    t0 = time.perf_counter()
    out = task.score(["slow", "fast"], examples)
    assert time.perf_counter() - t0 < 3.0   # two attempts of 0.3 s, not the server's 3 s
    assert out.rewards == [0.0, 1.0] and out.errors == 1 and out.metrics["reward/timeouts"] == 1.0
    assert "did not answer within 0.3 s (after 2 attempts)" in shown[0] and "JudgeTimeout" in shown[0]
    assert out.metrics["reward/judge/j/retries"] == 1.0


@pytest.mark.timeout(60)
def test_an_unparseable_reply_is_counted_with_the_reply_shown(server):
    server.rule = lambda body, n: (200, "I would rather not say." if n % 2 else "Grade: 1", 0.0)
    task, shown = judge_task(server.url, concurrency=1)
    examples = examples_for(task, 4)
    out = task.score(["a", "b", "c", "d"], examples)
    assert out.rewards == [0.0, 1.0, 0.0, 1.0] and out.errors == 2
    assert out.metrics["reward/judge/j/parse_failures"] == 2.0 and out.metrics["reward/judge/j/mean"] == 1.0
    assert len(shown) == 1 and "JudgeParseError" in shown[0] and "'I would rather not say.'" in shown[0]


@pytest.mark.timeout(60)
def test_a_dead_endpoint_names_its_url_and_stops_by_the_rate_rule(server):
    with socket.socket() as s:   # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    task, shown = judge_task(url, retries=1, task_options={"reward_error_window": 8, "max_reward_error_rate": 0.5})
    examples = examples_for(task, 4)
    t0 = time.perf_counter()
    out = task.score(["1", "2", "3", "4"], examples)
    assert out.errors == 4 and out.metrics["reward/judge/j/request_errors"] == 4.0
    assert f"judge endpoint {url}/chat/completions (task.rewards[0].judge.base_url) is unreachable" in shown[0]
    assert "(after 2 attempts)" in shown[0]
    with pytest.raises(RewardFunctionError) as info:
        task.score(["1", "2", "3", "4"], examples)
    assert "judge j failed on 100% of its last 8 completions" in str(info.value) and url in str(info.value)
    assert time.perf_counter() - t0 < 10.0


def test_grade_parsing_and_normalisation():
    cfg = JudgeConfig(base_url="http://x")
    assert parse_grade("It is fine. Grade: 7", cfg) == 0.7
    assert parse_grade("grade 2 at first... **Grade:** 10", cfg) == 1.0   # the last grade counts
    for reply, pattern in [("no grade here", "no grade matching"), ("Grade: 11", r"outside \[judge.min_grade=0")]:
        with pytest.raises(JudgeParseError, match=pattern):
            parse_grade(reply, cfg)
    five = JudgeConfig(base_url="http://x", min_grade=1, max_grade=5, pattern=r"\[\[(\d)\]\]")
    assert parse_grade("[[3]]", five) == 0.5
    labels = JudgeConfig(base_url="http://x", parse="label", labels={"yes": 1.0, "no": 0.0, "partly": 0.5})
    assert parse_grade("Yes.", labels) == 1.0 and parse_grade("No, not yes... partly", labels) == 0.5
    assert parse_grade("yesterday: NO", labels) == 0.0   # whole words only
    with pytest.raises(JudgeParseError, match="none of the labels"):
        parse_grade("maybe", labels)
    assert fill_template("{prompt}/{completion}/{answer}/{other}", "p {answer}", "c", "a") == "p {answer}/c/a/{other}"


# --- judge: a local causal LM ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def judge_path(tmp_path_factory):
    """A tiny causal LM that only writes '0' and '1': its final norm keeps one hidden unit and the head maps that
    unit's sign to one of the two digits, so every reply parses and depends on the prompt."""
    tok = char_tokenizer()
    model = tiny_llama(len(tok), hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_positions=256)
    with torch.no_grad():
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[tok.convert_tokens_to_ids("1"), 0] = 10.0
        model.lm_head.weight[tok.convert_tokens_to_ids("0"), 0] = -10.0
    folder = tmp_path_factory.mktemp("judge")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def test_local_judge_grades_by_greedy_generation(judge_path):
    from covrl.models import load_pretrained

    task = arithmetic_task(rewards=[{"kind": "judge", "name": "lj", "judge": {
        "path": judge_path, "template": TEMPLATE, "pattern": r"(\d)", "max_grade": 1, "max_new_tokens": 3,
        "batch_size": 2}}])
    examples = examples_for(task, 5)
    completions = ["1", "22", "the sum", "", "7+5"]
    out = task.score(completions, examples)
    model, tok = load_pretrained(judge_path, "float32")
    expected = []
    for c, ex in zip(completions, examples):   # one unpadded greedy generate per prompt
        ids = torch.tensor([tok(fill_template(TEMPLATE, ex.prompt, c, ex.answer))["input_ids"]])
        with torch.no_grad():
            reply = tok.decode(model.generate(ids, do_sample=False, max_new_tokens=3)[0, ids.shape[1]:])
        assert re.fullmatch(r"[01]{3}", reply)
        expected.append(float(reply[-1]))
    assert out.errors == 0 and out.rewards == expected
    assert out.metrics["reward/judge/lj/parse_failures"] == 0.0 and out.metrics["reward/judge/lj/retries"] == 0.0


# --- a few training steps with each kind -------------------------------------------------------------------------


def tiny_run_config(tmp_path, **over):
    """configs/tiny.yaml made smaller and shorter (as tests/train/train_helpers.tiny_cfg), no evaluations."""
    overrides = {
        "run.name": None, "run.output_dir": str(tmp_path), "model.tiny.hidden_size": 32, "model.tiny.num_layers": 1,
        "model.tiny.num_heads": 2, "model.tiny.intermediate_size": 64, "model.tiny.max_positions": 48,
        "task.arithmetic.num_terms": 2, "task.n_train": 64, "task.n_eval": 8, "sampler.max_batch": 64,
        "sft_warmup.steps": 3, "sft_warmup.lr": 1e-3, "sft_warmup.batch_size": 16, "optim.lr": 3e-3,
        "optim.micro_batch_size": 32, "loop.steps": 3, "loop.prompts_per_step": 4, "loop.group_size": 4,
        "eval.before": False, "eval.after": False, "logging.console": False, "logging.curves": False, **over}
    return load_preset("tiny", overrides)


def train(tmp_path, name, rewards, **over):
    from covrl.cli import main

    path = tmp_path / f"{name}.yaml"
    path.write_text(dump_config(tiny_run_config(tmp_path, **{"task.rewards": rewards, **over})))
    rc = main(["train", "--config", str(path), "--no-progress", "--name", name])
    records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return rc, records, json.loads((tmp_path / name / "summary.json").read_text())


@pytest.mark.timeout(120)
def test_training_with_a_reward_model(tmp_path, rm_path):
    rc, records, summary = train(tmp_path, "rm", [{"fn": "last_number"},
                                                  {"kind": "model", "name": "rm", "weight": 0.1,
                                                   "model": {"path": rm_path, "batch_size": 8}}])
    assert rc == 0 and summary["status"] == "completed" and [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["task/model/rm/min"] <= r["task/model/rm/mean"] <= r["task/model/rm/max"]
        assert r["task/reward/rm"] == pytest.approx(r["task/model/rm/mean"], abs=1e-6)
        assert r["task/errors/rm"] == 0.0


@pytest.mark.timeout(120)
def test_training_with_a_judge_endpoint_and_a_dead_one_exits_2(tmp_path, server, capsys):
    judge = {"base_url": server.url, "template": TEMPLATE, "max_grade": 1}
    rc, records, summary = train(tmp_path, "judge", [{"kind": "judge", "name": "j", "judge": judge}])
    assert rc == 0 and summary["status"] == "completed" and len(records) == 3
    assert len(server.received) == 3 * 16
    for r in records:
        assert r["task/judge/j/parse_failures"] == 0.0 and r["task/reward/j"] == r["task/judge/j/mean"]
    server.close()
    rc, records, summary = train(tmp_path, "dead", [{"kind": "judge", "name": "j",
                                                     "judge": {**judge, "retries": 0}}],
                                 **{"task.reward_error_window": 16})
    assert rc == 2 and summary["status"] == "failed" and len(records) <= 1
    err = capsys.readouterr().err
    assert f"judge endpoint {server.url}/chat/completions" in err and "unreachable" in err
    assert "the run stops instead of training on zeros" in err
