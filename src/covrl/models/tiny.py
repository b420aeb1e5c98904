"""A small Llama-style model built from a config (no download) and a character-level tokenizer, for tests
and fast experiments (~100x faster than SmolLM2 on CPU)."""

from __future__ import annotations

import string

# Printable ASCII covers arithmetic prompts, chat-ish text and answers; ids 0..3 are special.
SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
DEFAULT_CHARS = string.digits + string.ascii_letters + string.punctuation + " \n"


def char_tokenizer(chars: str = DEFAULT_CHARS):
    """A `PreTrainedTokenizerFast` that maps each character to one token (pad=0, bos=1, eos=2, unk=3)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in dict.fromkeys(chars):
        vocab.setdefault(ch, len(vocab))
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>",
                                  eos_token="<eos>", unk_token="<unk>")
    tok.padding_side = "left"
    return tok


def tiny_llama(vocab_size: int, *, hidden_size: int = 128, num_layers: int = 4, num_heads: int = 4,
               intermediate_size: int = 256, max_positions: int = 256, tie_embeddings: bool = False, seed: int = 0):
    """A randomly initialised LlamaForCausalLM (fp32). Untied embeddings by default so the lm_head is its own
    matrix (the output-layer diagnostics measure it)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_heads,
        max_position_embeddings=max_positions, tie_word_embeddings=tie_embeddings,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model
