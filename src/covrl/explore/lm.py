"""Language-model features for bandits: the shipped publish/block text set, pooled hidden states of a causal LM
(cached once per run folder), and `LMFeatures`, a module that turns any causal LM into a feature extractor
for `NeuralEnsemblePP`."""

from __future__ import annotations

import hashlib
import json
from importlib import resources
from pathlib import Path

import torch
from torch import nn

from covrl.models import load_smollm2

LM_BANDIT_FILE = "lm_bandit.jsonl"
LABELS = {"block": 0, "publish": 1}


def load_lm_bandit_texts() -> tuple[list[str], torch.Tensor]:
    """The shipped text set `covrl/data/lm_bandit.jsonl`: short forum posts, label 1 = publish (on-topic
    gardening/cooking), 0 = block (spam, scams). Returns (texts, labels[n])."""
    raw = resources.files("covrl").joinpath("data", LM_BANDIT_FILE).read_text()
    texts, labels = [], []
    for i, line in enumerate(raw.splitlines()):
        if not line.strip():
            continue
        row = json.loads(line)
        if row.get("label") not in LABELS:
            raise ValueError(f"{LM_BANDIT_FILE} row {i}: label {row.get('label')!r} not in {list(LABELS)}")
        texts.append(row["text"])
        labels.append(LABELS[row["label"]])
    return texts, torch.tensor(labels, dtype=torch.long)


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Σ_t mask_t h_t / Σ_t mask_t over the sequence: hidden [B, L, H], mask [B, L] -> [B, H]."""
    mask = mask.to(hidden.dtype).unsqueeze(-1)
    return (hidden * mask).sum(1) / mask.sum(1).clamp_min(1.0)


class LMFeatures(nn.Module):
    """Feature extractor h(x) = mean over tokens of a causal LM's last hidden state (after the final norm).

    Input: token ids [B, L] (padding marked by `pad_token_id`, or an explicit attention mask via
    `forward(ids, mask)`); output [B, hidden_size]. With `trainable=False` the LM is frozen and run without
    gradients (the usual choice: Ensemble++'s heads then learn on fixed LM features)."""

    def __init__(self, model: nn.Module, pad_token_id: int = 0, trainable: bool = False):
        super().__init__()
        self.model = model
        self.pad_token_id = int(pad_token_id)
        self.trainable = bool(trainable)
        self.out_features = int(model.config.hidden_size)
        if not trainable:
            for p in self.model.parameters():
                p.requires_grad_(False)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        ids = ids.long()
        if mask is None:
            mask = (ids != self.pad_token_id).long()
        with torch.set_grad_enabled(self.trainable and torch.is_grad_enabled()):
            out = self.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        return mean_pool(out.hidden_states[-1].float(), mask)


@torch.no_grad()
def compute_lm_features(texts: list[str], model: nn.Module, tokenizer, batch_size: int = 16) -> torch.Tensor:
    """Mean-pooled last hidden state of `model` for each text, [n, hidden] float32."""
    model.eval()
    feats = []
    side = getattr(tokenizer, "padding_side", "right")
    tokenizer.padding_side = "right"
    try:
        for i in range(0, len(texts), batch_size):
            enc = tokenizer(texts[i: i + batch_size], return_tensors="pt", padding=True)
            out = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], output_hidden_states=True)
            feats.append(mean_pool(out.hidden_states[-1].float(), enc["attention_mask"]))
    finally:
        tokenizer.padding_side = side
    return torch.cat(feats)


def load_lm_bandit_features(cache_dir: Path, model_loader=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(features [n, 576], labels [n]) of the shipped text set under SmolLM2-135M-Instruct, computed once and
    cached in `cache_dir/lm_bandit_features.pt` (keyed by a hash of the texts; recomputed if they change).
    `model_loader` () -> (model, tokenizer) replaces `covrl.models.load_smollm2` (tests use a tiny model)."""
    texts, labels = load_lm_bandit_texts()
    key = hashlib.sha256("\n".join(texts).encode()).hexdigest()[:16]
    cache_dir = Path(cache_dir)
    name = "lm_bandit_features.pt" if model_loader is None else "lm_bandit_features_custom.pt"
    path = cache_dir / name
    if path.exists():
        payload = torch.load(path, weights_only=True)
        if payload.get("key") == key:
            return payload["features"], payload["labels"]
    model, tokenizer = (model_loader or load_smollm2)()
    features = compute_lm_features(texts, model, tokenizer)
    cache_dir.mkdir(parents=True, exist_ok=True)
    torch.save({"key": key, "features": features, "labels": labels}, path)
    return features, labels


def pca_reduce(X: torch.Tensor, k: int) -> torch.Tensor:
    """Project centred X [n, p] on its top-k principal directions and standardise each component, [n, k]."""
    if not 1 <= k <= min(X.shape):
        raise ValueError(f"feature_dim must be in [1, {min(X.shape)}], got {k}")
    centred = X - X.mean(0)
    _, _, vh = torch.linalg.svd(centred, full_matrices=False)
    Z = centred @ vh[:k].T
    return Z / Z.std(0).clamp_min(1e-8)
