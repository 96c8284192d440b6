"""Build a model on the meta device to check what the planner counted (the planner itself builds no modules)."""

from __future__ import annotations

from moestack.config.model_spec import ModelSpec
from moestack.planner.profile import ArchProfile


def check_builds(spec: ModelSpec, prof: ArchProfile | None = None) -> int:
    """Build `spec` on the meta device (no memory) and return its parameter count; with a profile, assert that
    the built model and the profile agree (the profiler mirrors the modules)."""
    from moestack.model.transformer import build_model

    model = build_model(spec, "meta")
    n = sum(p.numel() for p in model.parameters())
    if prof is not None and n != prof.total_params:
        raise AssertionError(f"built model has {n} parameters but the profile counts {prof.total_params}")
    del model
    return n
