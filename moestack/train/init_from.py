"""Start a run from existing weights (TrainSpec.init_from, `moestack train --init-from PATH`).

PATH is a moestack checkpoint (a step_* directory, or a root holding them: the newest complete one) or a Hugging
Face directory (*.safetensors, model.safetensors.index.json, config.json; MXFP4 experts dequantised, the vision
tower skipped: moestack/train/convert.py). Only the model weights are read: the optimizer, the learning-rate
schedule, the data position and the step start fresh (that is what separates it from --resume).

Names and shapes are checked before any weight is copied: an HF checkpoint's every missing / unexpected /
mis-shaped tensor is named in one line (ConvertError), a moestack checkpoint's first difference (CheckpointError).

The weights go into the whole model before it is parallelised (the trainer builds every model that fits whole
on every rank), so FSDP, TP, EP and PP slice the loaded weights exactly as they slice a seeded initialisation. A
model too large for that (built on the meta device, GPU) loads a moestack checkpoint after sharding (DCP reshards
it); an HF directory must be converted first (`moestack convert HF_DIR CKPT_ROOT`, streamed) in that case.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from moestack.config.base import ConfigError

HF, MOESTACK = "hf", "moestack"


@dataclass
class InitSource:
    kind: str  # HF or MOESTACK
    path: Path  # the HF directory, or the step_* checkpoint directory


@dataclass
class InitResult:
    source: InitSource
    tensors: int
    message: str  # one line for the log
    skipped_line: str | None = None  # one line naming HF tensors skipped on purpose (vision tower), if any
    extra: dict[str, Any] = field(default_factory=dict)  # for the run's checkpoints: the HF layout and family


def resolve_init_source(path: str | Path) -> InitSource:
    """Which kind of weights `path` holds; ConfigError naming the path when it is neither."""
    from moestack.train.checkpoint import COMPLETE, latest_checkpoint
    from moestack.train.convert import INDEX

    p = Path(path)
    if not p.exists():
        raise ConfigError(f"init_from: {p}: no such file or directory")
    if p.is_dir() and ((p / COMPLETE).is_file() or (p / ".metadata").is_file()):
        return InitSource(MOESTACK, p)
    if p.is_dir() and ((p / INDEX).is_file() or any(p.glob("*.safetensors"))):
        return InitSource(HF, p)
    found = latest_checkpoint(p / "checkpoints") or latest_checkpoint(p) if p.is_dir() else None
    if found is not None:
        return InitSource(MOESTACK, found)
    raise ConfigError(f"init_from: {p} is neither a moestack checkpoint (step_* with COMPLETE, or a run directory "
                      "holding them) nor an HF checkpoint (*.safetensors)")


def hf_config_path(path: str | Path) -> Path | None:
    """PATH/config.json when PATH is an HF checkpoint directory that has one (the model it was saved from)."""
    try:
        src = resolve_init_source(path)
    except ConfigError:
        return None
    cfg = src.path / "config.json"
    return cfg if src.kind == HF and cfg.is_file() else None


def _family(spec, root: Path) -> str | None:
    if spec.family is not None:
        return None  # the spec's own
    cfg = root / "config.json"
    if cfg.is_file():
        try:
            return json.loads(cfg.read_text()).get("model_type")
        except ValueError:
            return None
    return None


def load_initial_weights(model: nn.Module, path: str | Path, sharded: bool = False,
                         partial: bool = False, trust_key: bytes | None = None) -> InitResult:
    """Copy the weights at `path` into `model`: a whole moestack Transformer, or (sharded) one already
    parallelised, moestack checkpoints only; partial: it holds one pipeline rank's layers. trust_key: a moestack
    checkpoint must be signed with it (checkpoint.trust_key_file). Returns what to log and to keep in the run's
    checkpoints."""
    src = resolve_init_source(path)
    if src.kind == MOESTACK:
        from moestack.train.checkpoint import load_checkpoint

        extra = load_checkpoint(src.path, model, None, partial=partial, trust_key=trust_key)
        n = len(model.state_dict())
        keep = {k: extra[k] for k in ("hf_layout", "family") if k in extra}
        return InitResult(src, n, f"initialised from {src.path}: model weights of step {extra.get('step', '?')} "
                                  f"({n} tensors); optimizer, schedule and data position start fresh", extra=keep)
    if sharded:
        raise ConfigError(f"init_from: {src.path} is an HF checkpoint; a model this large is sharded before its "
                          f"weights load: convert it first (moestack convert {src.path} CKPT_ROOT) and pass "
                          "--init-from CKPT_ROOT")
    from moestack.train.convert import describe_skipped, load_hf_weights

    loaded = load_hf_weights(model, src.path, _family(model.spec, src.path))
    packed = len(loaded.layout.packed)
    mx = f", {packed} MXFP4 tensors dequantised" if packed else ""
    msg = (f"initialised from HF checkpoint {src.path} (family {loaded.family}): {loaded.tensors} tensors{mx}; "
           "optimizer, schedule and data position start fresh")
    skipped = describe_skipped(loaded.skipped, loaded.nmap) if loaded.skipped else None
    return InitResult(src, loaded.tensors, msg, skipped, {"hf_layout": loaded.layout.to_json(),
                                                          "family": loaded.family})
