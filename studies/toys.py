"""Small shared pieces of the geometry reproductions (output-rank, reach, sparsity, covariance): a tiny
transformer briefly trained on fixed-width addition, and a fixed-length sampler for it."""

from __future__ import annotations

import functools

from covrl.models import char_tokenizer, tiny_llama

PROMPT_LEN = 6  # "ab+cd=" after BOS
ANSWER_LEN = 4  # "xyz\n": three zero-padded digits and a newline
# SFT steps of the shared tiny model; the fast variants share one (cached) model per process
PRETRAIN_STEPS = {True: 90, False: 400}


def addition_text(a: int, b: int) -> tuple[str, str]:
    return f"{a:02d}+{b:02d}=", f"{a + b:03d}\n"


@functools.lru_cache(maxsize=4)
def _pretrained_state(steps: int, hidden: int, layers: int, seed: int, batch: int = 48):
    import torch


    tok = char_tokenizer()
    model = tiny_llama(len(tok), hidden_size=hidden, num_layers=layers, num_heads=4, intermediate_size=2 * hidden,
                       max_positions=32, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        pairs = torch.randint(0, 100, (batch, 2), generator=gen).tolist()
        ids = torch.tensor([[tok.bos_token_id] + tok.encode("".join(addition_text(a, b)), add_special_tokens=False)
                            for a, b in pairs])
        logits = model(input_ids=ids).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, float(loss.detach())


def pretrained_tiny(steps: int = 300, hidden: int = 64, layers: int = 2, seed: int = 0, dtype=None):
    """(model, tokenizer, final SFT loss): a tiny Llama trained by SFT on 'ab+cd=xyz\\n' so that its policy
    is confident on format tokens and spread over digits it cannot yet add. Cached per process."""


    state, loss = _pretrained_state(steps, hidden, layers, seed)
    tok = char_tokenizer()
    model = tiny_llama(len(tok), hidden_size=hidden, num_layers=layers, num_heads=4, intermediate_size=2 * hidden,
                       max_positions=32, seed=seed)
    model.load_state_dict(state)
    model.eval()
    if dtype is not None:
        model = model.to(dtype)
    return model, tok, loss


def addition_prompts(tok, n: int, gen) -> tuple[list[tuple[int, int]], object]:
    """n random problems and their prompt ids [n, 1 + PROMPT_LEN] (BOS + 'ab+cd=')."""
    import torch

    pairs = torch.randint(0, 100, (n, 2), generator=gen).tolist()
    ids = torch.tensor([[tok.bos_token_id] + tok.encode(addition_text(a, b)[0], add_special_tokens=False)
                        for a, b in pairs])
    return [tuple(p) for p in pairs], ids


def sample_fixed(model, prompt_ids, n_new: int, gen, *, temperature: float = 1.0, top_k: int = 0):
    """Sample n_new tokens per row (no EOS handling; every row has the same length). Returns the full ids
    [B, P + n_new] and the sampler's log-probs of the drawn tokens [B, n_new] (fp64)."""
    import torch

    ids = prompt_ids.clone()
    logps = []
    with torch.no_grad():
        for _ in range(n_new):
            z = model(input_ids=ids).logits[:, -1].double() / temperature
            if top_k:
                kth = z.topk(top_k, dim=-1).values[:, -1:]
                z = z.masked_fill(z < kth, float("-inf"))
            logp = torch.log_softmax(z, -1)
            nxt = torch.multinomial(logp.exp(), 1, generator=gen)
            logps.append(logp.gather(-1, nxt))
            ids = torch.cat([ids, nxt], dim=1)
    return ids, torch.cat(logps, dim=1)


def addition_reward(tok, ids, pairs) -> object:
    """Fraction of the three answer digits that are right, per row, [B] fp64."""
    import torch

    out = []
    for row, (a, b) in zip(ids.tolist(), pairs):
        text = tok.decode(row[1 + PROMPT_LEN:1 + PROMPT_LEN + 3])
        want = f"{a + b:03d}"
        out.append(sum(x == y for x, y in zip(text, want)) / 3.0)
    return torch.tensor(out, dtype=torch.float64)


def score_mask(B: int, total: int, prompt: int):
    import torch

    m = torch.zeros(B, total, dtype=torch.bool)
    m[:, prompt:] = True
    return m


def full_precision_norms(model):
    """Make every RMSNorm of a (fp64) HF Llama compute in the model's dtype. The stock LlamaRMSNorm upcasts to
    fp32 and back, which limits per-sample gradients of an fp64 model to ~1e-7 relative accuracy; exact
    identities need fp64 throughout. Same formula: w · x / sqrt(mean(x²) + eps)."""
    import torch

    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm") and hasattr(module, "weight"):
            eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))

            def forward(hidden_states, module=module, eps=eps):
                variance = hidden_states.pow(2).mean(-1, keepdim=True)
                return module.weight * (hidden_states * torch.rsqrt(variance + eps))

            module.forward = forward
    return model
