"""load_model for every source, LoRA, dtype, frozen copies; one real SmolLM2 load + generate."""

import pytest
import torch
from pydantic import ValidationError

from covrl.models import ModelConfig, ModelNotFoundError, char_tokenizer, frozen_copy, load_model

torch.set_num_threads(1)

SMALL = {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64}


def test_char_tokenizer_roundtrip():
    tok = char_tokenizer()
    ids = tok("7+5=12", add_special_tokens=False)["input_ids"]
    assert len(ids) == 6 and tok.decode(ids) == "7+5=12"
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2) and len(tok) == 100


def test_tiny_model_is_seeded_and_typed():
    a, tok = load_model(ModelConfig(source="tiny", tiny=SMALL), seed=0)
    b, _ = load_model(ModelConfig(source="tiny", tiny=SMALL), seed=0)
    c, _ = load_model(ModelConfig(source="tiny", tiny=SMALL), seed=1)
    assert tok.padding_side == "left"
    assert a.config.vocab_size == len(tok) and a.config.hidden_size == 32
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    state = torch.random.get_rng_state()
    half, _ = load_model(ModelConfig(source="tiny", tiny=SMALL, dtype="bfloat16"), seed=0)
    assert torch.equal(state, torch.random.get_rng_state())  # the global RNG is untouched
    assert next(half.parameters()).dtype == torch.bfloat16


def test_lora_trains_only_adapters_and_checkpointing():
    model, _ = load_model(ModelConfig(source="tiny", tiny=SMALL, gradient_checkpointing=True,
                                      lora={"rank": 4, "target_modules": ["q_proj", "v_proj"]}), seed=0)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    model.train()
    ids = torch.randint(4, 100, (2, 6))
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    with pytest.raises(ValueError, match="not found in the model"):
        load_model(ModelConfig(source="tiny", tiny=SMALL, lora={"target_modules": ["qkv"]}))


def test_frozen_copy_is_independent():
    model, _ = load_model(ModelConfig(source="tiny", tiny=SMALL))
    ref = frozen_copy(model)
    assert not ref.training and not any(p.requires_grad for p in ref.parameters())
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    assert not torch.equal(model.lm_head.weight, ref.lm_head.weight)


def test_config_and_missing_model_errors(tmp_path):
    with pytest.raises(ValidationError, match="source"):
        ModelConfig(source="gpt5")
    with pytest.raises(ValidationError, match="extra"):
        ModelConfig(sorce="tiny")
    with pytest.raises(ValueError, match="model.path is required"):
        load_model(ModelConfig(source="hf"))
    missing = tmp_path / "no_model_here"
    with pytest.raises(ModelNotFoundError, match="no_model_here"):
        load_model(ModelConfig(source="hf", path=str(missing)))
    with pytest.raises(ValueError, match="divisible"):
        load_model(ModelConfig(source="tiny", tiny={"hidden_size": 30, "num_heads": 4}))


def test_hf_folder_roundtrip(tmp_path):
    model, tok = load_model(ModelConfig(source="tiny", tiny=SMALL), seed=5)
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    again, tok2 = load_model(ModelConfig(source="hf", path=str(tmp_path / "m")))
    assert torch.equal(again.lm_head.weight, model.lm_head.weight)
    assert tok2.decode(tok2("1+2=", add_special_tokens=False)["input_ids"]) == "1+2="


@pytest.mark.slow   # a long end-to-end run: make test-slow (the default suite stays near 10 minutes)
def test_smollm2_loads_generates_and_saves(tmp_path):
    """The default model: GGUF dequantised, greedy tokens through our sampler, save_pretrained works."""
    pytest.importorskip("gguf")
    from covrl.rollout import SamplerConfig, build_sampler
    from covrl.tasks import TaskConfig, build_task

    try:
        model, tok = load_model(ModelConfig(source="smollm2"))
    except ModelNotFoundError as err:
        pytest.skip(str(err))
    task = build_task(TaskConfig(n_train=4, n_eval=4))
    ex = task.eval[0]
    sampler = build_sampler(SamplerConfig(max_new_tokens=4), model, tok)
    batch = sampler.generate([task.encode(tok, ex)], 1, generator=torch.Generator(), greedy=True)
    text = tok.decode(batch.response_ids[0][batch.response_mask[0].bool()], skip_special_tokens=True)
    assert batch.response_mask.sum() >= 1 and text.strip()
    assert getattr(model, "hf_quantizer", None) is None or not getattr(model.config, "quantization_config", None)
    model.save_pretrained(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "model.safetensors").exists()
