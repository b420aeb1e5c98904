"""`covrl diagnose` end to end on tiny models saved as HF folders (and as a run folder)."""

import json

import pytest
import torch

from covrl.cli import main

torch.set_num_threads(1)


def _save_pair(root, with_tokenizer=True):
    from covrl.models import char_tokenizer, tiny_llama

    tok = char_tokenizer()
    before = tiny_llama(len(tok), hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, max_positions=64)
    after = tiny_llama(len(tok), hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, max_positions=64)
    after.load_state_dict(before.state_dict())
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a rank-1 change of one matrix and a tiny change of the lm_head
        w = after.model.layers[0].mlp.up_proj.weight
        w += 1e-2 * torch.randn(w.shape[0], 1, generator=gen) @ torch.randn(1, w.shape[1], generator=gen)
        after.lm_head.weight += 1e-6 * torch.randn(after.lm_head.weight.shape, generator=gen)
    paths = []
    for name, model in (("before", before), ("after", after)):
        path = root / name
        model.save_pretrained(path)
        if with_tokenizer:
            tok.save_pretrained(path)
        paths.append(path)
    return paths


def test_before_after_writes_report(tmp_path, capsys):
    before, after = _save_pair(tmp_path)
    out = tmp_path / "report"
    rc = main(["diagnose", "--before", str(before), "--after", str(after), "--out", str(out), "--k", "1",
               "--samples", "2", "--max-new-tokens", "6"])
    assert rc == 0
    report = json.loads((out / "diagnose.json").read_text())
    assert (out / "diagnose.png").stat().st_size > 0
    up = report["matrices"]["model.layers.0.mlp.up_proj.weight"]
    assert up["numerical_rank"] == 1 and up["energy_top_k"] == pytest.approx(1.0)
    assert up["sparsity_full"] == pytest.approx(0.0, abs=0.02)
    head = report["matrices"]["lm_head.weight"]
    assert head["sparsity_full"] == 1.0  # |Δ| ~ 1e-6 ≤ 1e-5
    q = report["matrices"]["model.layers.0.self_attn.q_proj.weight"]
    assert q["sparsity_full"] == 1.0 and q["numerical_rank"] == 0
    assert report["fisher"]["sequences"] == 8 and report["fisher"]["tokenizer"].endswith("after")
    assert 0.0 <= report["summary"]["update_top_fisher_share"] <= 1.0
    assert "absorbed share" in capsys.readouterr().out


def test_run_folder_layout_and_bos_only_prompts(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "initial").mkdir(parents=True)
    (run / "config.yaml").write_text("{}\n")   # not read: the run saved its initial weights
    ckpt = run / "checkpoints" / "ckpt-000000016"
    ckpt.mkdir(parents=True)
    before, after = _save_pair(tmp_path, with_tokenizer=False)
    before.rename(run / "checkpoints" / "initial" / "model")
    after.rename(ckpt / "model")
    (ckpt / "COMPLETE").write_text("")
    # an incomplete later checkpoint is ignored
    (run / "checkpoints" / "ckpt-000000032" / "model").mkdir(parents=True)
    rc = main(["diagnose", "--run", str(run), "--samples", "2", "--max-new-tokens", "4"])
    assert rc == 0
    report = json.loads((run / "diagnose" / "diagnose.json").read_text())
    assert report["after"].endswith("ckpt-000000016/model")
    assert report["fisher"]["tokenizer"].startswith("none")


def test_bad_arguments(tmp_path, capsys):
    assert main(["diagnose"]) == 2
    assert main(["diagnose", "--run", str(tmp_path)]) == 2
    assert "no config.yaml" in capsys.readouterr().err


def _tiny_run(tmp_path, name, **extra):
    from covrl.train import load_config, train_from_config

    overrides = [f"run.output_dir={tmp_path}", f"run.name={name}", "run.num_threads=1", "loop.steps=2",
                 "eval.before=false", "eval.after=false", "logging.console=false", "logging.progress_bar=false",
                 "logging.curves=false", "sft_warmup.steps=3", "checkpoint.at_end=true",
                 *(f"{k}={v}" for k, v in extra.items())]
    assert train_from_config(load_config("configs/tiny.yaml", overrides)) == 0
    return tmp_path / name


def test_a_run_without_saved_initial_weights_is_diagnosed_from_its_rebuilt_start(tmp_path, capsys):
    """The main job saves no initial weights: diagnose rebuilds them from config.yaml (model, seed, threads,
    warm-up) and uses them only when their fingerprint is the one the run recorded at its start."""
    run = _tiny_run(tmp_path, "plain")
    assert not (run / "checkpoints" / "initial").exists()
    recorded = json.loads((run / "summary.json").read_text())["initial_weights"]
    assert recorded["saved"] is False and len(recorded["fingerprint"]) == 32
    assert main(["diagnose", "--run", str(run), "--no-fisher", "--k", "2"]) == 0
    report = json.loads((run / "diagnose" / "diagnose.json").read_text())
    assert report["before"] == "rebuilt from config.yaml" and report["summary"]["matrices"] > 0
    # a start that does not rebuild to the same bits is refused, not diagnosed against the wrong weights
    summary = json.loads((run / "summary.json").read_text())
    summary["initial_weights"]["fingerprint"] = "0" * 32
    (run / "summary.json").write_text(json.dumps(summary))
    assert main(["diagnose", "--run", str(run), "--no-fisher"]) == 2
    assert "run.save_initial=true" in capsys.readouterr().err


def test_the_fingerprint_of_a_saved_start_is_the_saved_weights(tmp_path):
    from covrl.models import load_pretrained
    from covrl.train.run.checkpoint import weights_fingerprint

    run = _tiny_run(tmp_path, "saved", **{"run.save_initial": "true"})
    recorded = json.loads((run / "summary.json").read_text())["initial_weights"]
    model, _ = load_pretrained(run / "checkpoints" / "initial" / "model")
    assert recorded["saved"] is True and weights_fingerprint(model) == recorded["fingerprint"]
