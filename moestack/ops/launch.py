"""Launch-time settings shared by the Triton kernels: interpreter mode and the process-wide autotune switch.

TRITON_INTERPRET=1 (Triton's own variable) must be set before a kernel module is imported: Triton decides how to
build a kernel when it is decorated. `autotune` (KernelSpec.autotune, set when a model's kernels are resolved;
initially from the documented overrides in moestack/config/settings.py) keeps only the first launch config of each
autotuned kernel that fits the device when off.
"""

from __future__ import annotations

import os

from moestack.config.settings import autotune_default

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # as the kernel modules were built
_AUTOTUNE = [autotune_default()]


def interpret() -> bool:
    """TRITON_INTERPRET=1 now (the availability checks read it per call: a test may set it after import)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def set_autotune(on: bool) -> None:
    _AUTOTUNE[0] = bool(on)


def autotune_enabled() -> bool:
    return _AUTOTUNE[0]


def prune_recurrence(configs, named_args, **kwargs):
    """KDA's state recurrences (forward K2, backward B2): placeholder, replaced by the shared-memory pruning."""
    return configs[:1] if not autotune_enabled() else configs
