"""The one place that reads MOESTACK_* environment variables: a documented override layer over typed fields.

Configuration is typed (TrainSpec, Plan, KernelSpec); these variables exist for scripts and quick GPU checks and
map onto those fields. An override is applied where the kernels are resolved (moestack/ops/backends.py) and is
recorded with its source in the run's kernels.json. A bad value is a one-line ConfigError naming the variable.

    variable                       field (KernelSpec unless said)     values
    MOESTACK_KDA_BACKEND           kda.backend                        auto | triton | reference | fla
    MOESTACK_KDA_FUSED_LAYER_OPS   kda.layer_ops                      1 (= auto) | 0 (= torch)
    MOESTACK_DSA_BACKEND           dsa.backend                        auto | triton | reference
    MOESTACK_MOE_ROUTING_BACKEND   moe.routing                        auto | triton | reference
    MOESTACK_MOE_BACKEND           moe.gemm                           auto | crossover | torch | triton | reference
    MOESTACK_MOE_CROSSOVER         moe.crossover                      path of a crossover JSON
    MOESTACK_FP8_CACHE             fp8.weight_cache                   1 (= on) | step | 0 (= off)
    MOESTACK_FP8_CUBLAS_MIN_ROWS   fp8.cublas_min_rows                integer >= 0
    MOESTACK_KDA_AUTOTUNE,
    MOESTACK_DSA_AUTOTUNE          autotune (either 0 turns it off)   1 | 0
    MOESTACK_TUNE_CACHE            path of `moestack tune`'s per-shape cache (default ~/.cache/moestack/tuned-ops.json)
    MOESTACK_CACHE                 cache directory of downloaded / tokenised data (default ~/.cache/moestack)
    MOESTACK_EP_DOMAIN_SIZE        EP ranks per fast domain of the hierarchical dispatcher (default: the plan's
                                   cluster's innermost tier, else LOCAL_WORLD_SIZE)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from moestack.config.base import ConfigError
from moestack.config.kernel_spec import KernelSpec, with_fields

# variable -> (KernelSpec field, {env value: field value} or None to pass the value through)
KERNEL_ENV: dict[str, tuple[str, dict[str, object] | None]] = {
    "MOESTACK_KDA_BACKEND": ("kda.backend", None),
    "MOESTACK_KDA_FUSED_LAYER_OPS": ("kda.layer_ops", {"1": "auto", "0": "torch"}),
    "MOESTACK_DSA_BACKEND": ("dsa.backend", None),
    "MOESTACK_MOE_ROUTING_BACKEND": ("moe.routing", None),
    "MOESTACK_MOE_BACKEND": ("moe.gemm", None),
    "MOESTACK_MOE_CROSSOVER": ("moe.crossover", None),
    "MOESTACK_FP8_CACHE": ("fp8.weight_cache", {"1": "on", "step": "step", "0": "off"}),
    "MOESTACK_FP8_CUBLAS_MIN_ROWS": ("fp8.cublas_min_rows", None),
    "MOESTACK_KDA_AUTOTUNE": ("autotune", {"1": True, "0": False}),
    "MOESTACK_DSA_AUTOTUNE": ("autotune", {"1": True, "0": False}),
}
TUNE_CACHE_ENV = "MOESTACK_TUNE_CACHE"
DATA_CACHE_ENV = "MOESTACK_CACHE"
EP_DOMAIN_ENV = "MOESTACK_EP_DOMAIN_SIZE"


def kernel_overrides(environ: Mapping[str, str] | None = None) -> dict[str, tuple[object, str]]:
    """{field: (value, "VAR=value")} for every KernelSpec override set in the environment (empty values ignored).
    Two variables on one field: a False autotune wins, otherwise the later one in KERNEL_ENV."""
    environ = os.environ if environ is None else environ
    out: dict[str, tuple[object, str]] = {}
    for var, (field, table) in KERNEL_ENV.items():
        raw = environ.get(var, "")
        if not raw:
            continue
        if table is not None and raw not in table:
            raise ConfigError(f"${var}={raw!r}: use one of {', '.join(table)} (it sets kernels.{field})")
        value = table[raw] if table is not None else raw
        if field == "autotune" and field in out and out[field][0] is False:
            continue
        out[field] = (value, f"{var}={raw}")
    return out


def apply_kernel_overrides(spec: KernelSpec, environ: Mapping[str, str] | None = None
                           ) -> tuple[KernelSpec, dict[str, str]]:
    """(spec with the environment's overrides, {field: "VAR=value"} of those applied)."""
    found = kernel_overrides(environ)
    if not found:
        return spec, {}
    try:
        new = with_fields(spec, {field: value for field, (value, _) in found.items()})
    except ValueError as err:
        sources = ", ".join(src for _, src in found.values())
        raise ConfigError(f"{sources}: {err}") from None
    return new, {field: src for field, (_, src) in found.items()}


def autotune_default() -> bool:
    """The process-wide autotune switch before any KernelSpec is applied (kernels launched outside a model)."""
    return kernel_overrides().get("autotune", (True, ""))[0] is not False


def tune_cache_path() -> Path:
    env = os.environ.get(TUNE_CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "moestack" / "tuned-ops.json"


def data_cache_dir() -> Path:
    return Path(os.environ.get(DATA_CACHE_ENV) or Path.home() / ".cache" / "moestack")


def ep_domain_size() -> int | None:
    """$MOESTACK_EP_DOMAIN_SIZE as a positive int, None when unset."""
    raw = os.environ.get(EP_DOMAIN_ENV)
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ConfigError(f"${EP_DOMAIN_ENV}={raw!r}: use a positive integer (EP ranks per fast domain)")
    return int(raw)
