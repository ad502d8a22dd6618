"""Presets: one module per preset, each with `config() -> Config`. `jaxlm train NAME` loads them by file name."""
