"""Load test of `covrl serve` on loopback through Tinker's own SDK, and the two measurements behind docs/api.md
"Serving a team". Results go to runs/bench/ (never into tracked files).

    python scripts/tinker_load_test.py load [--clients 8] [--steps 6]    # one server vs sequential vs separate
    python scripts/tinker_load_test.py memory [--model tiny|smollm2] [-k 4]   # K LoRA clients on one base vs own
    python scripts/tinker_load_test.py exactness                         # are a matmul's rows independent of M?

`load`: half the clients run an RL-like loop (sample 4 x 4 tokens at a seed, importance_sampling
forward_backward, optim_step, a new sampling client), half an SL loop (cross_entropy forward_backward on 4
sequences, optim_step), every client a LoRA rank-8 client of the tiny model (its LoRA clients share one base).
Three arrangements: all clients at once on one server ("concurrent"), the same runs one after another on one
server ("sequential"), and one server process per client, all at once ("separate"). Reported: steps per second,
p50 / p99 latency per request type, the servers' peak resident memory (VmHWM), and whether every client's
results equal its run in the sequential arrangement (bit for bit).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["sft_warmup.steps=0", "task.n_train=40", "task.n_eval=8", "run.num_threads=1"]
PROMPT = [11, 12, 13, 14]


def _cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return re.search(r"Model name:\s*(.+)", out).group(1).strip()
    except (OSError, AttributeError):
        return platform.processor()


def _peak_mb(pid: int) -> float:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s*(\d+)", text).group(1)) / 1024


def _rss_mb() -> float:
    text = Path("/proc/self/status").read_text()
    return int(re.search(r"VmRSS:\s*(\d+)", text).group(1)) / 1024


# ------------------------------------------------------------------------------------------------ servers

class Server:
    """`covrl serve --config tiny` as a process of its own on a free loopback port."""

    def __init__(self, folder: Path):
        folder.mkdir(parents=True, exist_ok=True)
        self.log = folder / "serve.log"
        out = open(self.log, "w")   # noqa: SIM115 - the process writes to it until it ends
        self.proc = subprocess.Popen([sys.executable, "-m", "covrl", "serve", "--config", "tiny", "--port", "0",
                                      "--dir", str(folder / "serve"), "--no-warmup", *SMALL], cwd=ROOT,
                                     stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.url = None

    def wait(self) -> Server:
        deadline = time.monotonic() + 300
        while self.url is None:
            match = re.search(r"Tinker API at (\S+)", self.log.read_text())
            if match:
                self.url = match.group(1)
            elif self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"covrl serve did not start: {self.log.read_text()}")
            else:
                time.sleep(0.2)
        return self

    def peak_mb(self) -> float:
        return _peak_mb(self.proc.pid)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


# ------------------------------------------------------------------------------------------------ clients

def run_client(url: str, k: int, steps: int, kind: str, latencies: dict[str, list[float]], lock,
               ready: threading.Barrier | None = None, spans: list | None = None) -> list:
    """One client's loop; returns what it got back (samples, losses, log-probs, grad norms). `ready`: waited
    on once the client is created (the loops of concurrent clients start together); `spans` gets the loop's
    (start, end) (throughput counts the loops, not the model builds)."""
    import tinker
    import torch
    from tinker import types

    def timed(name, fn):
        t0 = time.perf_counter()
        out = fn()
        with lock:
            latencies.setdefault(name, []).append(time.perf_counter() - t0)
        return out

    service = tinker.ServiceClient(base_url=url, api_key="tml-load")
    client = timed("create_lora_training_client", lambda: service.create_lora_training_client(
        base_model="tiny", rank=8, seed=3).result())
    got = []
    if ready is not None:
        ready.wait()
    start = time.perf_counter()
    for i in range(steps):
        if kind == "rl":
            sampling = timed("save_weights_and_get_sampling_client",
                             lambda: client.save_weights_and_get_sampling_client().result())
            params = types.SamplingParams(max_tokens=4, seed=1000 * k + i)
            res = timed("sample", lambda s=sampling, p=params: s.sample(
                prompt=types.ModelInput.from_ints(PROMPT), num_samples=4, sampling_params=p).result())
            data = []
            for j, s in enumerate(res.sequences):
                tokens = PROMPT + list(s.tokens)
                n = len(tokens) - 1
                data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
                    "target_tokens": types.TensorData.from_torch(torch.tensor(tokens[1:])),
                    "logprobs": types.TensorData.from_torch(torch.tensor([0.0] * 3 + list(s.logprobs))[:n]),
                    "advantages": types.TensorData.from_torch(torch.tensor([0.0] * 3 + [j - 1.5] * (n - 3)))}))
            fb = timed("forward_backward", lambda d=data: client.forward_backward(d, "importance_sampling").result())
            got.append([[list(s.tokens) for s in res.sequences], [list(s.logprobs) for s in res.sequences]])
        else:
            data = []
            for j in range(4):
                tokens = PROMPT + [20 + (k + i + j) % 8, 21, 22, 23]
                data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
                    "target_tokens": types.TensorData.from_torch(torch.tensor(tokens[1:])),
                    "weights": types.TensorData.from_torch(torch.ones(len(tokens) - 1))}))
            fb = timed("forward_backward", lambda d=data: client.forward_backward(d, "cross_entropy").result())
        opt = timed("optim_step", lambda: client.optim_step(types.AdamParams(learning_rate=1e-2)).result())
        got.append([fb.metrics.get("loss:sum"), [o["logprobs"].tolist() for o in fb.loss_fn_outputs],
                    opt.metrics.get("grad_norm")])
    if spans is not None:
        spans.append((start, time.perf_counter()))
    return got


def _kinds(n: int) -> list[str]:
    return ["rl" if k % 2 == 0 else "sl" for k in range(n)]


def _concurrently(urls: list[str], steps: int, latencies, lock, spans: list) -> list:
    results: list = [None] * len(urls)
    errors: list = []
    ready = threading.Barrier(len(urls))

    def one(k):
        try:
            results[k] = run_client(urls[k], k, steps, _kinds(len(urls))[k], latencies, lock, ready, spans)
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(repr(err))
            ready.abort()
    threads = [threading.Thread(target=one, args=(k,)) for k in range(len(urls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(errors)
    return results


def _summary(latencies: dict[str, list[float]]) -> dict:
    import numpy as np

    return {name: {"n": len(v), "p50_ms": round(1000 * float(np.percentile(v, 50)), 1),
                   "p99_ms": round(1000 * float(np.percentile(v, 99)), 1)} for name, v in sorted(latencies.items())}


def load(args) -> dict:
    out = Path(args.out) / "load"
    n, steps = args.clients, args.steps
    report: dict = {"clients": n, "steps": steps, "kinds": _kinds(n)}
    # 1. sequential: one server, the runs one after another (the reference results)
    lock, lat = threading.Lock(), {}
    server = Server(out / "sequential").wait()
    spans: list = []
    reference = [run_client(server.url, k, steps, kind, lat, lock, None, spans) for k, kind in enumerate(_kinds(n))]
    report["sequential"] = {"loops_s": round(sum(b - a for a, b in spans), 2), "peak_mb": round(server.peak_mb(), 1),
                            "latency": _summary(lat)}
    server.close()
    # 2. concurrent: one server, every client at once
    lock, lat = threading.Lock(), {}
    server = Server(out / "concurrent").wait()
    spans = []
    together = _concurrently([server.url] * n, steps, lat, lock, spans)
    report["concurrent"] = {"loops_s": round(max(b for _, b in spans) - min(a for a, _ in spans), 2), "peak_mb": round(server.peak_mb(), 1),
                            "latency": _summary(lat), "equal_to_sequential": together == reference}
    server.close()
    # 3. separate: one server process per client, all at once
    lock, lat = threading.Lock(), {}
    servers = [Server(out / f"separate-{k}") for k in range(n)]
    for s in servers:
        s.wait()
    spans = []
    apart = _concurrently([s.url for s in servers], steps, lat, lock, spans)
    report["separate"] = {"loops_s": round(max(b for _, b in spans) - min(a for a, _ in spans), 2),
                          "peak_mb": round(sum(s.peak_mb() for s in servers), 1),
                          "peak_mb_each": [round(s.peak_mb(), 1) for s in servers],
                          "latency": _summary(lat), "equal_to_sequential": apart == reference}
    for s in servers:
        s.close()
    total = n * steps
    for name in ("sequential", "concurrent", "separate"):
        report[name]["steps_per_s"] = round(total / report[name]["loops_s"], 3)
    return report


# ------------------------------------------------------------------------------------------------ memory

def memory(args) -> dict:
    """Resident memory of K LoRA clients on one base vs K clients with a model each, in this process."""
    import gc

    import covrl.api.tinker as facade

    config = "tiny" if args.model == "tiny" else "default"
    overrides = {"sft_warmup.steps": 0, "run.num_threads": 1}
    report: dict = {"model": args.model, "k": args.k}
    for share in (True, False):
        gc.collect()
        before = _rss_mb()
        service = facade.ServiceClient(config=config, overrides=overrides, share_base=share,
                                       state_dir=str(Path(args.out) / f"memory-{share}"))
        clients, rss = [], []
        for _ in range(args.k):
            clients.append(service.create_lora_training_client(args.model, rank=32, seed=0))
            gc.collect()
            rss.append(round(_rss_mb() - before, 1))
        api = clients[0].api
        base = sum(p.numel() * p.element_size() for p in api.model.parameters() if not p.requires_grad)
        adapters = sum(p.numel() * p.element_size() for p in api.params)
        report["shared" if share else "own"] = {"rss_growth_mb_after_each_client": rss}
        report.update(base_weights_mb=round(base / 2**20, 2), adapter_mb_per_client=round(adapters / 2**20, 2))
        for c in clients:
            service.forget(c)
        del clients, api, service
        gc.collect()
    return report


# ------------------------------------------------------------------------------------------------ exactness

def exactness(args) -> dict:
    """Whether y = x W^T over the rows of two clients concatenated gives each client's rows bit for bit as its
    own matmul does (what fusing the base matmul across adapters needs), by thread count and rows per client."""
    import torch

    torch.manual_seed(0)
    rows = [1, 2, 3, 4, 5, 8, 16, 17, 64, 200]
    report: dict = {"torch": torch.__version__, "shapes": [[64, 64], [64, 256], [256, 64], [576, 576], [576, 1536]]}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        exact, cases = 0, 0
        for d_in, d_out in report["shapes"]:
            w = torch.randn(d_out, d_in)
            for m1 in rows:
                for m2 in rows:
                    x1, x2 = torch.randn(m1, d_in), torch.randn(m2, d_in)
                    y = torch.nn.functional.linear(torch.cat([x1, x2]), w)
                    ok = torch.equal(y[:m1], torch.nn.functional.linear(x1, w)) and \
                        torch.equal(y[m1:], torch.nn.functional.linear(x2, w))
                    exact += ok
                    cases += 1
        report[f"threads_{threads}"] = {"exact": exact, "cases": cases}
        both4 = [(m1, m2) for m1 in rows for m2 in rows if m1 >= 4 and m2 >= 4]
        ok4 = 0
        w = torch.randn(64, 64)
        for m1, m2 in both4:
            x1, x2 = torch.randn(m1, 64), torch.randn(m2, 64)
            y = torch.nn.functional.linear(torch.cat([x1, x2]), w)
            ok4 += torch.equal(y[:m1], torch.nn.functional.linear(x1, w)) and \
                torch.equal(y[m1:], torch.nn.functional.linear(x2, w))
        report[f"threads_{threads}"]["both_at_least_4_rows_64x64"] = f"{ok4}/{len(both4)}"
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["load", "memory", "exactness"])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    parser.add_argument("-k", type=int, default=4, help="memory: LoRA clients")
    parser.add_argument("--out", default=str(ROOT / "runs" / "bench" / "tinker_load_test"))
    args = parser.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    started = datetime.datetime.now().isoformat(timespec="seconds")
    report = {"load": load, "memory": memory, "exactness": exactness}[args.what](args)
    report.update(command=" ".join(["python", "scripts/tinker_load_test.py", *(argv or sys.argv[1:])]),
                  cpu=_cpu(), cores=os.cpu_count(), started=started,
                  load_average_after=os.getloadavg())
    path = Path(args.out) / f"{args.what}-{args.model if args.what == 'memory' else 'tiny'}.json"
    path.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
