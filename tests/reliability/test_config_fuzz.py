"""Hostile configs: every malformed file, key or value ends in a `ConfigError` that names the file and line
(or the override) and the field -- never another exception type from deep inside yaml / pydantic / torch.

- every leaf field of `TrainConfig` x a list of hostile values (wrong types, huge numbers, inf/nan, unicode,
  NUL bytes, 5000-character strings);
- hypothesis: random nested mappings mixing real section/key names with junk, written as YAML files;
- hypothesis: random text as the whole file, random override strings;
- files that are missing, directories, not UTF-8, multi-document, or carry python object tags."""

from __future__ import annotations

import math
import re
import typing
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from covrl.config import ConfigError, load_config
from covrl.train.config import TrainConfig

# Fields where +inf is a meaningful setting: an IS threshold of inf = no truncation; a surge ratio of inf = the
# trigger never fires. Everywhere else a non-finite float must be refused at start-up.
INF_ALLOWED = {"correction.is_threshold", "lr_surge.ratio"}

HOSTILE = {
    "null": "null", "text": "'x'", "long_text": "'" + "y" * 5000 + "'", "negative": "-1", "zero": "0",
    "huge_int": str(2 ** 70), "huge_negative": str(-2 ** 70), "huge_float": "1.0e308", "inf": ".inf",
    "neg_inf": "-.inf", "nan": ".nan", "list": "[1, 2]", "mapping": "{a: 1}", "bool": "true",
    "unicode": "'ünï©ødé ∑ 🚀'", "nul_byte": "'a\\x00b'", "empty": "",
}


def leaf_fields(cls: type[BaseModel], prefix: tuple = ()) -> list[str]:
    out = []
    for name, field in cls.model_fields.items():
        ann = field.annotation
        args = () if typing.get_origin(ann) in (list, tuple, dict) else typing.get_args(ann)   # a list of models is a leaf
        sub = [a for a in (ann, *args) if isinstance(a, type) and issubclass(a, BaseModel)]
        out += leaf_fields(sub[0], prefix + (name,)) if sub else [".".join(prefix + (name,))]
    return out


LEAVES = leaf_fields(TrainConfig)


def non_finite_floats(obj, path=()):
    if isinstance(obj, BaseModel):
        for name in type(obj).model_fields:
            yield from non_finite_floats(getattr(obj, name), path + (name,))
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from non_finite_floats(item, path)
    elif isinstance(obj, float) and not math.isfinite(obj):
        yield ".".join(path)


def test_walk_finds_the_sections():
    assert {"optim.lr", "loop.steps", "task.reward", "run.seed", "sampler.temperature"} <= set(LEAVES)


@pytest.mark.parametrize("value_name", sorted(HOSTILE))
def test_every_field_takes_or_refuses_hostile_values_by_name(value_name):
    problems = []
    for key in LEAVES:
        override = f"{key}={HOSTILE[value_name]}"
        try:
            cfg = load_config(None, [override])
        except ConfigError as err:
            text = str(err)
            # the override and the field's own name appear (a section validator may name 'section: key')
            if f"override {override!r}" not in text or key.rsplit(".", 1)[-1] not in text:
                problems.append(f"{override}: unclear error {text!r}")
            continue
        except Exception as err:  # noqa: BLE001 - the point of the test
            problems.append(f"{override}: {type(err).__name__}: {err}")
            continue
        bad = [p for p in non_finite_floats(cfg) if p not in INF_ALLOWED]
        if bad:
            problems.append(f"{override}: accepted a non-finite value in {bad}")
        if cfg.run.seed > 2 ** 63 - 1:
            problems.append(f"{override}: accepted seed {cfg.run.seed} (torch.manual_seed overflows)")
    assert not problems, "\n".join(problems[:20])


SECTIONS = list(TrainConfig.model_fields)
KEYS = sorted({k.split(".")[-1] for k in LEAVES})

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-2 ** 80, max_value=2 ** 80),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40),
    st.sampled_from(["otb", "grpo", "ppo_clip", "token-mean", "arithmetic", "jsonl", "tiny", "cpu", "1e-5"]))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=8), inner, max_size=3)),
    max_leaves=8)
documents = st.dictionaries(
    st.sampled_from(SECTIONS) | st.text(max_size=10),
    st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=10), values, max_size=4) | values, max_size=5)

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                        HealthCheck.too_slow])


@FUZZ
@given(doc=documents)
def test_fuzzed_yaml_documents_load_or_fail_with_file_and_line(tmp_path, doc):
    path = tmp_path / "fuzz.yaml"
    path.write_text(yaml.safe_dump(doc, allow_unicode=True), encoding="utf-8")
    try:
        cfg = load_config(path)
    except ConfigError as err:
        lines = str(err).splitlines()
        body = lines[1:] if lines[0] == "invalid config:" else lines
        for line in body:  # every problem line says where: <file>:<line> (or <file> for a whole-file issue)
            assert line.startswith(str(path)), f"error line without a location: {line!r}"
        return
    assert not [p for p in non_finite_floats(cfg) if p not in INF_ALLOWED]


@FUZZ
@given(text=st.text(max_size=200))
def test_fuzzed_raw_text_never_escapes_as_another_exception(tmp_path, text):
    path = tmp_path / "raw.yaml"
    path.write_text(text, encoding="utf-8")
    try:
        load_config(path)
    except ConfigError as err:
        assert str(path) in str(err) or "invalid config" in str(err)


@FUZZ
@given(items=st.lists(st.text(max_size=30) | st.builds(lambda k, v: f"{k}={v}", st.sampled_from(LEAVES),
                                                        st.text(max_size=20)), max_size=4))
def test_fuzzed_overrides_never_escape_as_another_exception(items):
    try:
        load_config(None, items)
    except ConfigError as err:
        assert "override" in str(err) or "invalid config" in str(err)


def test_unreadable_and_exotic_files(tmp_path):
    cases = {
        "missing.yaml": (None, "config file not found"),
        "folder.yaml": ("<dir>", "config file not found"),
        "latin1.yaml": (b"run:\n  name: caf\xe9\n", r"latin1.yaml:2: not UTF-8"),
        "multi.yaml": (b"run: {seed: 1}\n---\nrun: {seed: 2}\n", r"multi.yaml:2: invalid YAML"),
        "dupe.yaml": (b"optim:\n  lr: 1.0e-3\n  lr: 2.0e-3\n", r"dupe.yaml:3: invalid YAML: duplicate key 'lr'"),
        "list.yaml": (b"- 1\n- 2\n", "top level must be a mapping"),
        "tab.yaml": (b"run:\n\tseed: 1\n", r"tab.yaml:2: invalid YAML"),
    }
    for name, (content, needle) in cases.items():
        path = tmp_path / name
        if content == "<dir>":
            path.mkdir()
        elif content is not None:
            path.write_bytes(content)
        with pytest.raises(ConfigError, match=re.escape(needle).replace(r"\ ", " ") if "\\" not in needle
                           else needle):
            load_config(path)


def test_a_utf8_byte_order_mark_is_accepted(tmp_path):
    path = tmp_path / "bom.yaml"
    path.write_bytes(b"\xef\xbb\xbfrun: {seed: 5}\n")
    assert load_config(path).run.seed == 5


def test_python_object_tags_are_refused_not_executed(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.yaml"
    path.write_text(f'run: !!python/object/apply:os.system ["touch {marker}"]\n')
    with pytest.raises(ConfigError, match=r"evil.yaml:1: invalid YAML: could not determine a constructor"):
        load_config(path)
    # an override value that is not safe YAML is kept as plain text, never constructed
    cfg = load_config(None, [f"run.name=!!python/object/apply:os.system ['touch {marker}']"])
    assert cfg.run.name.startswith("!!python/object/apply:os.system")
    assert not marker.exists()


def test_reference_line_numbers_point_at_the_bad_key(tmp_path):
    path = tmp_path / "located.yaml"
    path.write_text("run:\n  seed: 1\noptim:\n  lr: -3\n  betas: [0.9, 2.0]\nloop:\n  stepz: 3\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    text = str(info.value)
    assert f"{path}:4: optim.lr" in text
    assert f"{path}:5: optim.betas" in text
    assert f"{path}:7: loop.stepz: unknown key in loop; allowed keys:" in text


def test_config_file_is_read_relative_to_nothing_but_the_given_path(tmp_path, monkeypatch):
    """A config path is used as given; no search path, no package lookup."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="config file not found: tiny.yaml"):
        load_config(Path("tiny.yaml"))
