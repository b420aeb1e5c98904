"""Build a small correctness reward model for the arithmetic task from SmolLM2-135M-Instruct, for a `task.rewards`
term of kind model (examples/reward_model.yaml):

1. completions for every distinct training problem of the task (task.name=arithmetic, its default split): some
   sampled from SmolLM2 as the policy sees the prompt (chat template, T=1, 16 new tokens), some written from the
   reference answer (correct) or a corrupted one (answer +- 1..3), in a few formats;
2. each labelled correct / wrong by covrl's grader for the task (`Task.score(...).correct`);
3. a LlamaForSequenceClassification (one logit, label "correct") initialised from SmolLM2's weights, of which only
   the score head (576 -> 1, no bias) is trained: logistic regression on the frozen last-token hidden state of
   the exact text covrl's reward model term scores (the RM tokenizer's chat template around prompt + completion);
4. saved with its tokenizer to FOLDER; the held-out accuracy is measured by covrl's own kind-model term on the
   saved folder, on completions (made the same way) for the task's held-out problems, which no training text saw.

    python examples/train_reward_model.py runs/smollm2-rm
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from covrl.models.smollm2 import load_smollm2
from covrl.tasks import TaskConfig, build_task
from covrl.tasks.config import RewardTermConfig
from covrl.tasks.reward_models import RewardModelTerm

FORMATS = ["{a}", "{q} = {a}", "The answer is {a}."]


def distinct(examples):
    seen, out = set(), []
    for ex in examples:
        if ex.prompt not in seen:
            seen.add(ex.prompt)
            out.append(ex)
    return out


def sample(lm, tok, task, examples, n: int, seed: int) -> list[str]:
    """n completions per example from the LM, as the policy would draw them (left-padded prompts, T=1)."""
    rows = [task.encode(tok, ex) for ex in examples]
    width = max(map(len, rows))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(r)) + r for r in rows])
    mask = (torch.arange(width) >= torch.tensor([width - len(r) for r in rows])[:, None]).long()
    torch.manual_seed(seed)
    with torch.no_grad():
        out = lm.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                          max_new_tokens=16, num_return_sequences=n, pad_token_id=tok.pad_token_id)
    return tok.batch_decode(out[:, width:], skip_special_tokens=True)


def written(ex, rng: random.Random, n_right: int, n_wrong: int) -> list[str]:
    a, q = int(ex.answer), ex.plain_prompt.rstrip("=")
    wrong = [a + d for d in (-3, -2, -1, 1, 2, 3) if a + d >= 0]
    return ([rng.choice(FORMATS).format(a=a, q=q) for _ in range(n_right)]
            + [rng.choice(FORMATS).format(a=rng.choice(wrong), q=q) for _ in range(n_wrong)])


def dataset(lm, tok, task, examples, *, sampled: int, right: int, wrong: int, seed: int):
    """(completions, examples, sampled-or-written flags, labels)."""
    drawn = sample(lm, tok, task, examples, sampled, seed) if sampled else []
    rng = random.Random(seed)
    comps, exs, kinds = [], [], []
    for i, ex in enumerate(examples):
        for c in drawn[i * sampled:(i + 1) * sampled]:
            comps.append(c), exs.append(ex), kinds.append("sampled")
        for c in written(ex, rng, right, wrong):
            comps.append(c), exs.append(ex), kinds.append("written")
    labels = [float(c) for c in task.score(comps, exs).correct]   # covrl's grader: correct = grade >= 1
    return comps, exs, kinds, labels


def features(rm, tok, texts: list[tuple[str, bool]], batch_size: int) -> torch.Tensor:
    """The final (normed) hidden state at the last token of each text, right-padded as covrl's term pads."""
    out = []
    for start in range(0, len(texts), batch_size):
        rows = [tok(t, add_special_tokens=not templated)["input_ids"] for t, templated in texts[start:start + batch_size]]
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), tok.pad_token_id)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
        with torch.no_grad():
            hidden = rm.model(input_ids=ids, attention_mask=mask).last_hidden_state
        out.append(hidden[torch.arange(len(rows)), mask.sum(1) - 1])
    return torch.cat(out)


def fit_head(head: torch.nn.Linear, x: torch.Tensor, y: torch.Tensor, *, steps: int, weight_decay: float) -> None:
    """Class-balanced logistic regression of the head's weights (full batch, L-BFGS)."""
    pos = y.mean().clamp(1e-3, 1 - 1e-3)
    weights = torch.where(y > 0, 0.5 / pos, 0.5 / (1 - pos))
    opt = torch.optim.LBFGS(head.parameters(), lr=0.5, max_iter=steps, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        logits = head(x).squeeze(-1)
        loss = (torch.nn.functional.binary_cross_entropy_with_logits(logits, y, weight=weights)
                + weight_decay * head.weight.pow(2).sum())
        loss.backward()
        return loss
    opt.step(closure)


def report(name: str, scores: list[float], labels: list[float], kinds: list[str]) -> float:
    hits = [(s >= 0.5) == (y > 0) for s, y in zip(scores, labels)]
    parts = [f"{name}: accuracy {sum(hits) / len(hits):.1%} on {len(hits)} texts "
             f"({sum(labels) / len(labels):.0%} correct, so {max(sum(labels), len(labels) - sum(labels)) / len(labels):.0%} "
             "by always guessing the majority)"]
    for kind in ("sampled", "written"):
        ks = [h for h, k in zip(hits, kinds) if k == kind]
        ys = [y for y, k in zip(labels, kinds) if k == kind]
        if ks:
            parts.append(f"  {kind}: {sum(ks) / len(ks):.1%} of {len(ks)} ({sum(ys) / len(ys):.0%} correct)")
    pos = [s for s, y in zip(scores, labels) if y > 0]
    neg = [s for s, y in zip(scores, labels) if y == 0]
    if pos and neg:
        # AUC: the chance that a correct text outscores a wrong one (what ranking within a group needs)
        auc = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg) / (len(pos) * len(neg))
        parts.append(f"  mean score: {sum(pos) / len(pos):.3f} on correct, {sum(neg) / len(neg):.3f} on wrong; "
                     f"AUC {auc:.3f}")
    print("\n".join(parts))
    return sum(hits) / len(hits)


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="output folder of the reward model (created)")
    parser.add_argument("--sampled", type=int, default=2, help="completions sampled from SmolLM2 per problem")
    parser.add_argument("--right", type=int, default=2, help="written correct completions per training problem")
    parser.add_argument("--wrong", type=int, default=2, help="written wrong completions per training problem")
    parser.add_argument("--weight-decay", type=float, default=1e-3, help="L2 penalty on the head's weights")
    parser.add_argument("--steps", type=int, default=200, help="L-BFGS iterations")
    parser.add_argument("--batch-size", type=int, default=32, help="texts per forward pass")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()

    from transformers import LlamaForSequenceClassification

    lm, tok = load_smollm2("float32")
    lm.eval()
    tok.padding_side = "left"
    config = lm.config.to_dict() | {"num_labels": 1, "id2label": {0: "correct"}, "label2id": {"correct": 0},
                                     "pad_token_id": tok.pad_token_id, "architectures": None}
    rm = LlamaForSequenceClassification(type(lm.config).from_dict(config))
    rm.model.load_state_dict(lm.model.state_dict(), strict=True)   # SmolLM2's weights; only the head is new
    torch.nn.init.zeros_(rm.score.weight)
    rm.eval()

    task = build_task(TaskConfig(name="arithmetic", n_eval=50))   # the task of configs/default.yaml
    train_ex, eval_ex = distinct(task.train), distinct(task.eval)
    assert not {e.prompt for e in train_ex} & {e.prompt for e in eval_ex}
    comps, exs, kinds, labels = dataset(lm, tok, task, train_ex, sampled=args.sampled, right=args.right,
                                        wrong=args.wrong, seed=args.seed)
    h_comps, h_exs, h_kinds, h_labels = dataset(lm, tok, task, eval_ex, sampled=args.sampled, right=1, wrong=1,
                                                seed=args.seed + 1)
    print(f"data: {len(comps)} training texts on {len(train_ex)} problems, {len(h_comps)} held-out texts on "
          f"{len(eval_ex)} other problems ({time.perf_counter() - t0:.0f} s)")

    # train on the exact texts covrl's kind-model term scores (the RM tokenizer's chat template around prompt +
    # completion): the term's own `texts`, on the folder saved once with the untrained head
    args.folder.mkdir(parents=True, exist_ok=True)
    rm.save_pretrained(args.folder)
    tok.save_pretrained(args.folder)
    term = {"kind": "model", "name": "rm", "model": {"path": str(args.folder), "normalise": "sigmoid",
                                                    "label": "correct", "batch_size": args.batch_size}}
    texts = RewardModelTerm(task.cfg, 0, RewardTermConfig(**term)).texts(comps, exs, tok)
    x = features(rm, tok, texts, args.batch_size)
    y = torch.tensor(labels)
    fit_head(rm.score, x, y, steps=args.steps, weight_decay=args.weight_decay)
    with torch.no_grad():
        train_scores = torch.sigmoid(rm.score(x).squeeze(-1)).tolist()
    report("train", train_scores, labels, kinds)
    print(f"head fitted ({time.perf_counter() - t0:.0f} s)")

    rm.save_pretrained(args.folder)

    # held out: scored through covrl's task with the kind-model term on the saved folder, as a run scores
    scorer = build_task(TaskConfig(name="arithmetic", n_eval=50, rewards=[term], reward_errors="raise"))
    scores = scorer.score(h_comps, h_exs).rewards
    acc = report("held-out", scores, h_labels, h_kinds)
    print(f"saved to {args.folder} ({time.perf_counter() - t0:.0f} s in all)")
    return acc


if __name__ == "__main__":
    main()
