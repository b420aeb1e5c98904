"""covrl.settings: the config machinery every layer may use; it imports nothing from covrl.

- `Section`: the base class of every config section (one validation policy, `SECTION_POLICY`);
- YAML files with line numbers, dotted `key=value` overrides, validation errors that name the file and line
  (or the override) and the allowed keys, the resolved config as YAML, the markdown reference table -- all
  generic in the root model class (`covrl.train.config.TrainConfig` for a training run);
- how a command reports a user-input error (`user_error`: one line and exit code 2, or the traceback in debug
  mode, `covrl --debug` / COVRL_DEBUG=1).
"""

from covrl.settings.base import SECTION_POLICY, Section, config_note, known_name, one_of
from covrl.settings.debug import DEBUG_ENV, debug_enabled, enable_debug, user_error
from covrl.settings.io import (
    ConfigError,
    apply_overrides,
    build_section,
    config_reference,
    dump_config,
    format_validation_error,
    load_section,
    parse_overrides,
    read_yaml,
)

__all__ = [
    "DEBUG_ENV", "SECTION_POLICY", "ConfigError", "Section", "apply_overrides", "build_section", "config_note",
    "config_reference", "debug_enabled", "dump_config", "enable_debug", "format_validation_error", "known_name",
    "load_section", "one_of", "parse_overrides", "read_yaml", "user_error",
]
