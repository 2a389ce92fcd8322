"""Training configuration: what the user asked, as one frozen ``TrainConfig``.

Precedence, stated once: **defaults < --model preset < --config FILE.yaml < command-line flags.**
A preset (``configs/<name>.yaml``) and a config file may set any field; a flag always wins.

One job per module: ``fields`` (the TrainConfig field list: add a setting there), ``values`` (coercion,
YAML and presets), ``flags`` (the parser and docs/flags.md's flag table), ``rules`` (cross-field resolution,
default run dir). This package re-exports their public names, so ``llama_fp8.config.X`` keeps working.
"""

from llama_fp8.config.fields import MODEL_FIELDS, ROPE_THETA_BY_TYPE, TrainConfig
from llama_fp8.config.flags import build_parser, flag_reference_markdown, parse_args, preset_table_markdown
from llama_fp8.config.rules import asked, default_run_dir, resolve
from llama_fp8.config.values import (
    PRESET_DIR,
    available_presets,
    choices_of,
    coerce,
    help_of,
    load_preset,
    load_yaml,
)
from llama_fp8.errors import EXIT_BAD_CONFIG, EXIT_NONFINITE, EXIT_REQUEUE, ConfigError

__all__ = ["EXIT_BAD_CONFIG", "EXIT_NONFINITE", "EXIT_REQUEUE", "MODEL_FIELDS", "PRESET_DIR", "ROPE_THETA_BY_TYPE",
           "ConfigError", "TrainConfig", "asked", "available_presets", "build_parser", "choices_of", "coerce",
           "default_run_dir", "flag_reference_markdown", "help_of", "load_preset", "load_yaml", "parse_args",
           "preset_table_markdown", "resolve"]
