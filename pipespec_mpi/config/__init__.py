"""Typed configuration: one dataclass per component, the only home of every default.

``AppConfig`` is the Hydra schema (``register`` stores it in Hydra's ConfigStore as
``app_schema``, the first entry of conf/config.yaml's defaults list): Hydra rejects an unknown key
or a value of the wrong type while it composes, and the YAML files under conf/ hold only what
differs from these defaults (a hierarchy's stages, a dataset's name and files). Every setting has
one name, its path in this tree (``decode.lookahead``, ``dataset.n_prompts``, ``run.mode``). An
enumerated setting's type is a ``Choice`` (pipespec_mpi/choices.py, a ``StrEnum``): Hydra refuses
any other value while composing, and ``validate`` checks a config built in Python from the same type.

The dataclasses are not frozen: Hydra merges the YAML files and the overrides into the schema's
nodes, which a frozen dataclass makes read-only. Nothing changes a config after ``load_config``;
derive a variant with ``dataclasses.replace``.

Every component receives only its own node (``HierarchyConfig`` for model loading, ``DecodeConfig``
for the stage loop, ...). ``load_config`` turns the composed tree into these dataclasses and runs
``validate``, the rules across fields, raising one ``ConfigError`` that
names every offending value, so a typo never reaches a rank's model loader.

  schema.py  the dataclasses (AppConfig and its nodes) and the allowed values
  load.py    register, load_config, compose_config, compose_tool_config (a tool's settings as
             the app's keys), validate, validate_decode
"""

from pipespec_mpi.config.load import (
    compose_config,
    compose_tool_config,
    load_config,
    load_run_config,
    register,
    split_tool_args,
    unknown_keys,
    validate,
    validate_decode,
)
from pipespec_mpi.config.schema import (
    CONF_DIR,
    DRAFTER_KINDS,
    METHODS,
    AppConfig,
    AutoConfig,
    ConfigError,
    DecodeConfig,
    DeviceConfig,
    HierarchyConfig,
    OnlineConfig,
    RunConfig,
    SamplingConfig,
    StageConfig,
    TinyBaseConfig,
    TokenizerConfig,
    TransportConfig,
)

__all__ = [
    "AppConfig",
    "AutoConfig",
    "CONF_DIR",
    "ConfigError",
    "DRAFTER_KINDS",
    "DecodeConfig",
    "DeviceConfig",
    "HierarchyConfig",
    "METHODS",
    "OnlineConfig",
    "RunConfig",
    "SamplingConfig",
    "StageConfig",
    "TinyBaseConfig",
    "TokenizerConfig",
    "TransportConfig",
    "compose_config",
    "compose_tool_config",
    "load_config",
    "load_run_config",
    "register",
    "split_tool_args",
    "unknown_keys",
    "validate",
    "validate_decode",
]
