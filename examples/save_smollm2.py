"""Save covrl's shipped SmolLM2-135M-Instruct (the dequantised GGUF) as a plain transformers folder, e.g. to use it
as a local LLM judge (`task.rewards: [{kind: judge, judge: {path: FOLDER}}]`, examples/judge_reward.yaml) or as
`model.source: hf` / `model.path: FOLDER`.

    python examples/save_smollm2.py runs/smollm2-hf
"""

from __future__ import annotations

import argparse
from pathlib import Path

from covrl.models.smollm2 import load_smollm2


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="output folder (created)")
    parser.add_argument("--dtype", default="float32", help="parameter dtype (default float32)")
    args = parser.parse_args(argv)
    model, tokenizer = load_smollm2(args.dtype)
    args.folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.folder)
    tokenizer.save_pretrained(args.folder)
    n = sum(p.numel() for p in model.parameters())
    print(f"saved {type(model).__name__} ({n / 1e6:.1f}M parameters, {args.dtype}) and its tokenizer "
          f"(chat template: {'yes' if getattr(tokenizer, 'chat_template', None) else 'no'}) to {args.folder}")
    return args.folder


if __name__ == "__main__":
    main()
