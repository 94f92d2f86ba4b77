"""The run's settings: typed, validated sections (:mod:`~obow.config.schema`) and the YAML recipes that fill
them (:mod:`~obow.config.recipes`, built-in recipes under ``recipes/``)."""

from obow.config.recipes import RECIPES_DIR, available_recipes, load_config, parse_override, save_config
from obow.config.schema import (
    BoWNetConfig,
    Config,
    ConfigError,
    DataConfig,
    MoCoConfig,
    ModelConfig,
    OptimConfig,
    TrainConfig,
    ViewsConfig,
    from_dict,
    to_dict,
)

__all__ = [
    "RECIPES_DIR",
    "BoWNetConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "ModelConfig",
    "MoCoConfig",
    "OptimConfig",
    "TrainConfig",
    "ViewsConfig",
    "available_recipes",
    "from_dict",
    "load_config",
    "parse_override",
    "save_config",
    "to_dict",
]
