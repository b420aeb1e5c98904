"""Config files and overrides, generic in the root model class: YAML + dotted `key=value` overrides -> a
validated pydantic model.

Every error names the field, the file and line (or the override) and, where it applies, the allowed keys or
values, e.g. ``configs/x.yaml:12: optim.lrr: unknown key; allowed keys: betas, eps, lr, ...``.
Imports nothing from covrl outside covrl.settings, so every layer may use it; `covrl.train.config` binds it to
`TrainConfig`."""

from __future__ import annotations

import difflib
import functools
import operator
import re
import types
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from covrl.settings.base import config_note

__all__ = ["ConfigError", "apply_overrides", "build_section", "config_reference", "dump_config",
           "format_validation_error", "load_section", "parse_overrides", "read_yaml"]

M = TypeVar("M", bound=BaseModel)


class ConfigError(ValueError):
    """A config file, an override or a value that cannot be used; the message says where and why."""


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads `1e-5` as a float (YAML 1.1 needs `1.0e-5`) and rejects duplicate keys."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                  |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                  |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                  |[-+]?\.(?:inf|Inf|INF)
                  |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."),
)


def _construct_mapping(loader: _Loader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first at line {seen[key] + 1})", key_node.start_mark)
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _key_lines(node: yaml.Node | None, prefix: tuple = (), out: dict | None = None) -> dict[tuple, int]:
    """Map each dotted key path of a YAML document to its 1-based line (for error messages)."""
    out = {} if out is None else out
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            path = prefix + (str(key_node.value),)
            out[path] = key_node.start_mark.line + 1
            _key_lines(value_node, path, out)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            out[prefix + (str(i),)] = item.start_mark.line + 1
            _key_lines(item, prefix + (str(i),), out)
    return out


def read_yaml(path: str | Path) -> tuple[dict, dict[tuple, int]]:
    """The mapping in a YAML file and the line of each key; clear errors for a missing file or bad YAML."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:  # used to escape as a bare UnicodeDecodeError without the file's name
        line = raw[:err.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    try:
        data = yaml.load(text, Loader=_Loader)
        lines = _key_lines(yaml.compose(text, Loader=_Loader))
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(err, "problem", None) or str(err)
        raise ConfigError(f"{where}: invalid YAML: {problem}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (run:, model:, ...), "
                          f"got {type(data).__name__}")
    return data, lines


def parse_overrides(items: list[str] | tuple[str, ...]) -> list[tuple[list[str], Any, str]]:
    """`a.b=value` strings -> (key path, YAML-parsed value, original text)."""
    parsed = []
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form section.key=value (e.g. optim.lr=2e-5)")
        key, raw = item.split("=", 1)
        path = [p for p in key.strip().split(".")]
        if not key.strip() or any(not p for p in path):
            raise ConfigError(f"override {item!r}: empty key; use section.key=value")
        try:
            # `None` as Python spells it is accepted as YAML's null (a common slip on the command line)
            value = None if raw.strip() in ("None", "none") else (yaml.load(raw, Loader=_Loader) if raw.strip() else "")
        except yaml.YAMLError:
            value = raw
        parsed.append((path, value, item))
    return parsed


def apply_overrides(data: dict, items: list[str] | tuple[str, ...]) -> tuple[dict, dict[tuple, str]]:
    """Set dotted keys in a nested dict (creating sections as needed). Returns the dict and, per key path,
    the override text (used to say where a bad value came from)."""
    sources: dict[tuple, str] = {}
    for path, value, text in parse_overrides(items):
        node = data
        for i, part in enumerate(path[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {'.'.join(path[:i + 1])} is a value, not a section")
            node = child
        node[path[-1]] = value
        sources[tuple(path)] = text
    return data, sources


def _model_at(cls: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The pydantic model class that holds the field at `loc` (to list its allowed keys)."""
    current: Any = cls
    for part in loc:
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return None
        field = current.model_fields.get(str(part))
        if field is None:
            return None
        ann = field.annotation
        args = getattr(ann, "__args__", ())
        candidates = [ann, *args]
        current = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if current is None:
            return None
    return current


def _where(loc: tuple, source: str, lines: dict[tuple, int], overrides: dict[tuple, str], msg: str = "") -> str:
    keys = tuple(str(p) for p in loc)
    # a validator of a whole section names the exact key in its message: point at that key if we can
    # (either its full dotted path or its path below the section, e.g. "letters.max_length" or "rs_threshold")
    # (or a section above the key: "sampler.vllm is read by ..." points at the override sampler.vllm.seed=...)
    def mentioned(k: tuple) -> int:   # the longest part of k (a dotted path from its root or below loc) in msg
        parts = [k[i:j] for i in {0, len(keys)} for j in range(max(len(keys), i) + 1, len(k) + 1)]
        return max((len(p) for p in parts if re.search(rf"(?<![\w.]){re.escape('.'.join(p))}(?![\w])", msg)),
                   default=0)

    named = [k for k in (*overrides, *lines) if len(k) > len(keys) and k[:len(keys)] == keys and mentioned(k)]
    if named:
        keys = max(named, key=lambda k: (mentioned(k), len(k)))
    for n in range(len(keys), 0, -1):
        if keys[:n] in overrides:
            return f"override {overrides[keys[:n]]!r}"
    for n in range(len(keys), 0, -1):
        if keys[:n] in lines:
            return f"{source}:{lines[keys[:n]]}"
    # a key that only overrides created (a misspelt section in `optm.lr=1e-5`): the override that wrote below it
    below = [text for path, text in overrides.items() if path[:len(keys)] == keys]
    if keys and below:
        return f"override {below[0]!r}"
    return source


def format_validation_error(err: ValidationError, *, source: str = "<config>",
                            lines: dict[tuple, int] | None = None,
                            overrides: dict[tuple, str] | None = None,
                            root: type[BaseModel]) -> str:
    """One line per problem: `where: field: what is wrong (allowed ...)`."""
    lines = lines or {}
    overrides = overrides or {}
    out = []
    for e in err.errors():
        # pydantic puts union/function markers in loc (e.g. 'function-after[...]'); keep real keys only.
        loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and ("[" in p or p.startswith("function"))))
        # a key with a line break or other control character would split / overwrite the message line
        field = ".".join(str(p) if str(p).isprintable() else repr(str(p)) for p in loc) or "(top level)"
        where = _where(loc, source, lines, overrides, e["msg"])
        if e["type"] == "extra_forbidden":
            parent = _model_at(root, loc[:-1])
            allowed = ", ".join(parent.model_fields) if parent is not None else "?"
            section = ".".join(str(p) for p in loc[:-1]) or "top level"
            close = difflib.get_close_matches(str(loc[-1]), list(parent.model_fields), n=1) if parent and loc else []
            hint = f"; did you mean {close[0]!r}?" if close else ""
            out.append(f"{where}: {field}: unknown key in {section}; allowed keys: {allowed}{hint}")
        else:
            msg = e["msg"]
            if msg.startswith("Value error, "):
                msg = msg[len("Value error, "):]
            got = e.get("input")
            got_text = "" if isinstance(got, dict) or e["type"] == "missing" else f" (got {got!r})"
            out.append(f"{where}: {field}: {msg}{got_text}")
    return "\n".join(out)


def build_section(root: type[M], data: dict, *, source: str = "<config>", lines: dict[tuple, int] | None = None,
                  overrides: dict[tuple, str] | None = None) -> M:
    """`root` validated from `data`; a ConfigError lists every problem with its file:line or override."""
    try:
        return root.model_validate(data)
    except ValidationError as err:
        raise ConfigError("invalid config:\n" + format_validation_error(
            err, source=source, lines=lines, overrides=overrides, root=root)) from None


def _choice_points(cls: type[BaseModel], prefix: tuple = ()):
    """(section path, sub-section, choosing field, values that read it) of every `Section.choices` under `cls`."""
    for sub, (choice, readers) in getattr(cls, "choices", {}).items():
        yield prefix, sub, choice, readers
    for name, field in cls.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            yield from _choice_points(field.annotation, prefix + (name,))


def _drop_preset_options_of_changed_choices(root: type[BaseModel], data: dict, source: str,
                                            overrides: list[str] | tuple[str, ...]) -> list[str]:
    """An override that changes a choice (e.g. `task.name=jsonl` on a preset whose file sets task.arithmetic)
    makes the file's options of the old choice unread: they are dropped with a note, not refused. Options the
    overrides set themselves are the user's own and stay (the validator refuses them). Returns the notes."""
    notes = []
    parsed = {tuple(path): (value, text) for path, value, text in parse_overrides(list(overrides))}
    for prefix, sub, choice, readers in _choice_points(root):
        chosen = parsed.get(prefix + tuple(choice.split(".")))
        if chosen is None or chosen[0] in readers or any(p[:len(prefix) + 1] == prefix + (sub,) for p in parsed):
            continue
        node: Any = data
        for part in prefix:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and sub in node:
            del node[sub]
            key = ".".join(prefix + (sub,))
            notes.append(f"{key} from {source} is not read after override {chosen[1]!r}: dropped")
    return notes


def load_section(root: type[M], path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> M:
    """Read `path` (YAML; None = all defaults), apply `section.key=value` overrides, validate as `root`."""
    notes: list[str] = []
    if path is None:
        data, lines, source = {}, {}, "<defaults>"
    else:
        data, lines = read_yaml(path)
        source = str(path)
        notes = _drop_preset_options_of_changed_choices(root, data, source, overrides)
    data, sources = apply_overrides(data, list(overrides))
    config = build_section(root, data, source=source, lines=lines, overrides=sources)
    for note in notes:   # after validation: a config that fails says only what is wrong
        config_note(note)
    return config


def dump_config(cfg: BaseModel) -> str:
    """The resolved config as YAML (every field, defaults included), loadable by `load_config`."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, default_flow_style=False)


def _plain(annotation: Any) -> Any:
    """`annotation` without `Annotated[...]` metadata (e.g. a per-field AllowInfNan), for the reference table."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return _plain(args[0])
    if not args or origin is Literal:
        return annotation
    plain = tuple(_plain(a) for a in args)
    if plain == args:
        return annotation
    if origin in (Union, types.UnionType):  # typing.Union: X | Annotated[...]
        return functools.reduce(operator.or_, plain)
    return origin[plain]


def _type_text(annotation: Any) -> str:
    annotation = _plain(annotation)
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    text = text or str(annotation).replace("typing.", "")
    return text.replace("NoneType", "None")


def config_reference(root: type[BaseModel]) -> str:
    """Markdown reference of every config field: dotted key, type, default, description (docs/configuration.md)."""
    out = ["| key | type | default | description |", "|---|---|---|---|"]

    def walk(cls: type[BaseModel], prefix: str) -> None:
        for name, field in cls.model_fields.items():
            key = f"{prefix}{name}"
            sub = _model_at(cls, (name,))
            if sub is not None and field.annotation is sub:
                out.append(f"| **{key}** | section | | {field.description or ''} |")
                walk(sub, key + ".")
                continue
            default = field.get_default(call_default_factory=True)
            if isinstance(default, BaseModel):
                default = default.model_dump(mode="json")
            desc = (field.description or "").replace("|", "\\|")
            type_text = _type_text(field.annotation).replace("|", "\\|")
            out.append(f"| `{key}` | {type_text} | `{default!r}` | {desc} |")

    walk(root, "")
    return "\n".join(out) + "\n"
