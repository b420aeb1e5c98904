"""`covrl selfcheck`: import the core and run one tiny forward pass."""

from __future__ import annotations

import argparse


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--smollm2", action="store_true", help="also load the SmolLM2 GGUF")


def run(args: argparse.Namespace) -> int:
    import torch

    from covrl.models import char_tokenizer, tiny_llama

    tok = char_tokenizer()
    model = tiny_llama(len(tok))
    ids = torch.tensor([tok("1+2=")["input_ids"]])
    logits = model(ids).logits
    print(f"torch {torch.__version__}, tiny model logits {tuple(logits.shape)}, finite={bool(torch.isfinite(logits).all())}")
    if args.smollm2:
        from covrl.models import load_smollm2

        m, _ = load_smollm2()
        print(f"SmolLM2 loaded: {sum(p.numel() for p in m.parameters()) / 1e6:.1f}M parameters")
    return 0
