"""Typed specs, validated at the edge."""

from moestack.config.base import ConfigError
from moestack.config.model_spec import (
    DenseMLPSpec,
    GQASpec,
    IndexerSpec,
    KDASpec,
    LayerKind,
    MLASpec,
    ModelSpec,
    MoESpec,
    RouterSpec,
    list_presets,
    load_model_spec,
)
from moestack.config.train_spec import TrainSpec, load_train_spec

__all__ = [
    "ConfigError",
    "DenseMLPSpec",
    "GQASpec",
    "IndexerSpec",
    "KDASpec",
    "LayerKind",
    "MLASpec",
    "ModelSpec",
    "MoESpec",
    "RouterSpec",
    "TrainSpec",
    "list_presets",
    "load_model_spec",
    "load_train_spec",
]
