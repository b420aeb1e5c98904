"""Security: nothing in a config, a data file or a checkpoint is executed.

- static scan (AST) of src/covrl: no eval/exec/compile/__import__, no pickle/marshal loads, every torch.load with
  weights_only=True, yaml only through safe loaders, no shell=True / os.system, no trust_remote_code=True, and
  arbitrary files executed as modules only where the user names them (task.reward);
- config strings that look like code are refused as unknown names, never evaluated;
- a user reward is loaded from exactly the file/module the user names;
- a checkpoint whose trainer_state.pt carries a pickled payload (or garbage) is refused with a clear error and
  nothing in it runs; checkpoints hold weights as safetensors only;
- a sharded (fsdp2) checkpoint's dcp/.metadata, a pickle that torch.distributed.checkpoint itself would
  `pickle.load`, is read through an allowlist unpickler: a payload in it is refused, not run."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
import torch
from _reliability_tiny import TINY, tiny_overrides

from covrl.config import ConfigError, load_config
from covrl.train.run import checkpoint as ckpt

SRC = Path(__file__).resolve().parents[2] / "src" / "covrl"
# the only place that turns a user-named file into a module (task.reward = "path/to/file.py:function")
FILE_EXEC_ALLOWED = {"tasks/rewards.py"}
SAFE_YAML_LOADERS = {"_Loader", "SafeLoader", "CSafeLoader", "yaml.SafeLoader", "yaml.CSafeLoader"}
# (file, enclosing function) -> why a full unpickle is acceptable there
UNPICKLE_ALLOWED = {
    ("train/asyncrl/process_pool.py", "_loads"): "messages from covrl's own spawned sampler process (what a multiprocessing "
                                        "queue unpickles anyway); never data from disk or the network",
}
# file -> why it imports pickle: a restricted Unpickler (its find_class names an allowlist; checked by the scan)
RESTRICTED_UNPICKLER_ALLOWED = {
    "train/parallel/shards.py": "DCP's dcp/.metadata through an allowlist of torch.distributed.checkpoint's "
                                "metadata classes, in place of DCP's own pickle.load",
}


def _defines_restricted_unpickler(tree: ast.AST) -> bool:
    """A class deriving from pickle.Unpickler that overrides find_class (the allowlist)."""
    return any(isinstance(node, ast.ClassDef) and any(dotted(b) == "pickle.Unpickler" for b in node.bases)
               and any(isinstance(f, ast.FunctionDef) and f.name == "find_class" for f in node.body)
               for node in ast.walk(tree))


def dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{dotted(node.value)}.{node.attr}"
    return "?"


def keyword(call: ast.Call, name: str):
    return next((k.value for k in call.keywords if k.arg == name), None)


def scan(path: Path, rel: str | None = None) -> list[str]:
    rel = rel or path.relative_to(SRC).as_posix()
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    enclosing: dict[ast.AST, str] = {}
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(fn):
                enclosing.setdefault(inner, fn.name) if inner is not fn else None
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
            restricted = rel in RESTRICTED_UNPICKLER_ALLOWED and _defines_restricted_unpickler(tree) and all(
                n in ("pickle", None) for n in names)
            if any(n and n.split(".")[0] in ("pickle", "marshal", "dill", "cloudpickle", "shelve") for n in names) \
                    and not restricted:
                found.append(f"{rel}:{node.lineno}: imports a pickle-style deserializer")
        if not isinstance(node, ast.Call):
            continue
        name = dotted(node.func)
        where = f"{rel}:{node.lineno}"
        if name in ("eval", "exec", "compile", "__import__", "builtins.eval", "builtins.exec"):
            found.append(f"{where}: {name}()")
        if name == "torch.load" or name.endswith(".torch.load"):
            value = keyword(node, "weights_only")
            allowed = (rel, enclosing.get(node)) in UNPICKLE_ALLOWED
            if not (isinstance(value, ast.Constant) and value.value is True) and not allowed:
                found.append(f"{where}: torch.load without weights_only=True")
        if name in ("yaml.unsafe_load", "yaml.full_load", "yaml.load_all", "yaml.unsafe_load_all"):
            found.append(f"{where}: {name}")
        if name == "yaml.load":
            loader = keyword(node, "Loader") or (node.args[1] if len(node.args) > 1 else None)
            if loader is None or dotted(loader) not in SAFE_YAML_LOADERS:
                found.append(f"{where}: yaml.load with loader {dotted(loader) if loader is not None else None}")
        if name in ("os.system", "os.popen", "subprocess.getoutput", "subprocess.getstatusoutput"):
            found.append(f"{where}: {name}")
        shell = keyword(node, "shell")
        if shell is not None and not (isinstance(shell, ast.Constant) and shell.value is False):
            found.append(f"{where}: shell=...")
        trust = keyword(node, "trust_remote_code")
        if trust is not None and not (isinstance(trust, ast.Constant) and trust.value is False):
            found.append(f"{where}: trust_remote_code=...")
        if name.endswith("spec_from_file_location") and rel not in FILE_EXEC_ALLOWED:
            found.append(f"{where}: executes a file as a module")
    return found


def test_the_scanner_catches_what_it_looks_for(tmp_path):
    bad = tmp_path / "probe.py"
    code = ("import pickle\nimport yaml, torch, os, subprocess\neval('1')\nexec('x=1')\ntorch.load('f')\n"
            "torch.load('f', weights_only=False)\nyaml.load(s, Loader=yaml.Loader)\nyaml.unsafe_load(s)\n"
            "os.system('ls')\nsubprocess.run('ls', shell=True)\nf(trust_remote_code=True)\n"
            "importlib.util.spec_from_file_location('m', 'p')\nobj.eval()\nmodel.exec_module(m)\n")
    bad.write_text(code)
    found = scan(bad, rel="tasks/probe.py")
    assert len(found) == 11, found  # everything but the last two lines (methods named eval/exec_module)


def test_source_tree_has_no_code_execution_paths():
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 30
    found = [hit for f in files for hit in scan(f)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("override", [
    "task.reward=__import__('os').system('touch {marker}')",
    "task.grader=__import__('os').system('touch {marker}')",
    "task.name=__import__('os').system('touch {marker}')",
    "algorithm.advantage=__import__('os').system('touch {marker}')",
    "algorithm.loss=exec(\"open('{marker}','w')\")",
    "sampler.backend=__import__('os').system('touch {marker}')",
])
def test_config_strings_are_names_never_code(tmp_path, override):
    from covrl.tasks import build_task

    marker = tmp_path / "executed"
    text = override.format(marker=marker)
    try:
        cfg = load_config(None, [text])
    except ConfigError as err:
        assert "allowed" in str(err)
    else:  # names checked by the builders (reward / grader / backend): refused there, by name
        with pytest.raises(ValueError, match="allowed"):
            if text.startswith("sampler."):
                from covrl.models import char_tokenizer, tiny_llama
                from covrl.rollout import build_sampler

                build_sampler(cfg.sampler, tiny_llama(100, hidden_size=16, num_layers=1, num_heads=2,
                                                      intermediate_size=32, max_positions=32), char_tokenizer())
            else:
                build_task(cfg.task)
    assert not marker.exists()


def test_reward_fn_specs_are_not_evaluated(tmp_path):
    from covrl.tasks import TaskConfig, build_task

    marker = tmp_path / "executed"
    for spec in (f"__import__('os').system('touch {marker}'):f", f"os.system('touch {marker}'):f",
                 f"{tmp_path}/missing.py:f"):
        with pytest.raises((ImportError, FileNotFoundError, ValueError, AttributeError)):
            build_task(TaskConfig(reward=spec, n_train=4, n_eval=1))
    assert not marker.exists()


def test_reward_file_is_loaded_from_exactly_the_named_path(tmp_path, monkeypatch):
    from covrl.tasks import TaskConfig, build_task

    for sub, value in (("a", 0.25), ("b", 0.75)):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "reward.py").write_text(f"def score(completion, example):\n    return {value}\n")
    monkeypatch.chdir(tmp_path / "a")
    monkeypatch.syspath_prepend(str(tmp_path / "a"))
    for spec, want in ((f"{tmp_path / 'b' / 'reward.py'}:score", 0.75), ("reward.py:score", 0.25),
                       (f"{tmp_path / 'b'}/reward.py:score", 0.75)):
        task = build_task(TaskConfig(reward=spec, n_train=4, n_eval=1, reward_timeout_s=5))
        assert task.score(["1"], task.train[:1]).rewards == [want], spec


class _Payload:
    """Unpickling this would run os.system (touch a marker)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickled_payload_in_a_checkpoint_is_refused_not_run(tmp_path, capsys):
    from covrl.train.launch.modes import train_from_config

    torch.set_num_threads(1)
    overrides = tiny_overrides(tmp_path, "sec", "logging.console=false", "sft_warmup.steps=0", "loop.steps=1",
                               "logging.diagnostics=false")
    assert train_from_config(load_config(TINY, overrides)) == 0
    run_dir = tmp_path / "sec"
    latest = ckpt.latest_checkpoint(run_dir)
    assert not list(latest.rglob("*.bin")) and not list(latest.rglob("*.pkl"))      # weights: safetensors only
    assert list((latest / "model").glob("*.safetensors"))
    marker = tmp_path / "executed"
    torch.save({"trainer": _Payload(marker)}, latest / ckpt.STATE_FILE)
    with pytest.raises(ckpt.CheckpointError, match="is not unpickled"):
        ckpt.load_state(latest)
    assert train_from_config(load_config(TINY, overrides + ["loop.steps=2"]), resume=True) == 2
    err = capsys.readouterr().err
    assert "trainer_state.pt is corrupt or holds more than tensors" in err and "weights_only=False" not in err
    assert not marker.exists()
    (latest / ckpt.STATE_FILE).write_bytes(b"\x80\x04garbage")
    with pytest.raises(ckpt.CheckpointError, match="is not unpickled"):
        ckpt.load_state(latest)
    weights = latest / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:64])
    from covrl.models import load_model

    model, _ = load_model(load_config(TINY, overrides).model)
    with pytest.raises(ckpt.CheckpointError, match="model.safetensors: unreadable weights"):
        ckpt.load_model_weights(model, latest / "model")


def test_a_pickled_payload_in_sharded_metadata_is_refused_not_run(tmp_path):
    """dcp/.metadata of an fsdp2 checkpoint is a pickle (torch.distributed.checkpoint writes it so and would read
    it with pickle.load): covrl reads it through an allowlist, for the resume check and for the load itself."""
    import pickle

    from covrl.train.parallel import shards

    marker = tmp_path / "executed"
    dcp_dir = tmp_path / "dcp"
    dcp_dir.mkdir()
    (dcp_dir / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(ValueError, match=r"\.system is not part of a torch.distributed.checkpoint metadata"):
        shards.check(dcp_dir)
    with pytest.raises(pickle.UnpicklingError, match="it is not unpickled"):
        shards.reader(str(dcp_dir)).read_metadata()
    assert not marker.exists()
    # the scan's exception is for a restricted unpickler only
    probe = tmp_path / "shards.py"
    probe.write_text("import pickle\n\nx = pickle.loads(b'')\n")
    assert scan(probe, rel="train/parallel/shards.py") == ["train/parallel/shards.py:1: imports a pickle-style "
                                                           "deserializer"]
