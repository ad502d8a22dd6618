"""Run configuration: frozen dataclasses (schema, model_schema) whose fields declare their help and ranges
(rules), presets and key=value overrides (loading), and the checks (validation). Callers import the names
below from `jaxlm.config`."""

from jaxlm.config.loading import (apply_overrides, apply_parameter_scale, fit_warmup, flatten, from_dict,
                                  load, load_base, parse_overrides, preset_names, to_json, type_name)
from jaxlm.config.model_schema import ATTENTION_KINDS, DType, ModelConfig, RematPolicy
from jaxlm.config.rules import ConfigError
from jaxlm.config.schema import (ALIASES, LORA_TARGETS, MESH_AXES, PREFERENCE_OBJECTIVES, CheckpointConfig,
                                 CompileConfig, Config, DataConfig, DecodeConfig, DiagnosticsConfig,
                                 DistributedConfig, DpoConfig, GrpoConfig, LoggingConfig, LoraConfig, MeshConfig,
                                 OptimizerConfig, OrpoConfig, ProfilerConfig, ServeConfig, TrainingConfig, all_keys,
                                 spelled)
from jaxlm.config.validation import (KERNEL_OPTIONS, UDS_MAX_BYTES, draft_tokens, kernel_options,
                                     parse_mixture, serve_adapters,
                                     stop_token_ids, validate, validate_compile, validate_decode, validate_serve,
                                     validate_uds)

__all__ = [
    "ALIASES", "ATTENTION_KINDS", "KERNEL_OPTIONS", "LORA_TARGETS", "MESH_AXES", "PREFERENCE_OBJECTIVES",
    "UDS_MAX_BYTES", "DType", "RematPolicy", "CheckpointConfig", "CompileConfig", "Config", "ConfigError",
    "DataConfig", "DecodeConfig", "DiagnosticsConfig", "DistributedConfig", "DpoConfig", "GrpoConfig",
    "LoggingConfig", "LoraConfig", "MeshConfig", "ModelConfig", "OptimizerConfig", "OrpoConfig", "ProfilerConfig",
    "ServeConfig", "TrainingConfig", "all_keys", "apply_overrides", "apply_parameter_scale", "draft_tokens",
    "fit_warmup", "flatten", "from_dict", "kernel_options", "load", "load_base", "parse_mixture", "parse_overrides",
    "preset_names", "serve_adapters", "spelled", "stop_token_ids", "to_json", "type_name", "validate",
    "validate_compile", "validate_decode", "validate_serve", "validate_uds",
]
