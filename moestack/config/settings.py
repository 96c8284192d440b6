"""The one place that reads MOESTACK_* environment variables: two cache locations, nothing that changes a run.

Every choice a user or the tuner makes is a typed field (TrainSpec, Plan, KernelSpec) recorded in the run
directory: kernels as `--set kernels.kda.backend=reference` (kernels.json), the hierarchical dispatcher's domain as
`plan.ep_domain_size`. Only where caches live is read from the environment:

    MOESTACK_TUNE_CACHE   path of `moestack tune`'s per-shape cache (default ~/.cache/moestack/tuned-ops.json);
                          the choices it supplies are recorded per run in kernels.json
    MOESTACK_CACHE        cache directory of downloaded / tokenised data (default ~/.cache/moestack)
"""

from __future__ import annotations

import os
from pathlib import Path

TUNE_CACHE_ENV = "MOESTACK_TUNE_CACHE"
DATA_CACHE_ENV = "MOESTACK_CACHE"


def tune_cache_path() -> Path:
    env = os.environ.get(TUNE_CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "moestack" / "tuned-ops.json"


def data_cache_dir() -> Path:
    return Path(os.environ.get(DATA_CACHE_ENV) or Path.home() / ".cache" / "moestack")
