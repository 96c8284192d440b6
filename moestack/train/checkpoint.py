"""Atomic, verified checkpoints with torch.distributed.checkpoint (DCP).

Layout of one checkpoint, `root/step_{step:08d}/`:
    .metadata, __*.distcp   DCP: {"model": model state, "optim": optimizer state}, keyed by parameter name
                            (get_state_dict / set_state_dict, so the same code works for FSDP2-sharded models)
    meta.json               format version, step, and `extra` (the trainer's JSON-able values and tensors:
                            scheduler, sampler and RNG state, train spec, model name)
    COMPLETE                written last: size and sha256 of every other file (and, with a trust key, their
                            HMAC: moestack/train/safe_load.py)

A save goes to `root/.tmp_step_{step:08d}` and is renamed into place only after every file is fsynced and
COMPLETE is written, so a crash leaves at most a `.tmp_*` directory, which readers ignore and the next save
removes. The writer holds an flock on `.tmp_*/.writer.lock` until the rename, and the sweep of leftovers skips
directories whose lock another live process holds (sweep and claim happen under `root/.lock`), so a second writer
never deletes a save in progress. Works with and without an initialised process group (rank 0 writes meta.json /
COMPLETE and renames; a shared filesystem is assumed when there are several ranks).

Nothing in a checkpoint is unpickled with plain pickle: DCP's metadata and non-tensor entries go through the
restricted readers of moestack/train/safe_load.py.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import json
import os
import random
import re
import shutil
import sys
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from moestack.memory.adamw import NO_ROUNDING_STATE, ROUNDING_RNG_KEY
from moestack.train.safe_load import (
    CheckpointError,
    SafeFileSystemReader,
    SafeLoadPlanner,
    UnsafeCheckpointError,
    UntrustedCheckpointError,
    check_signature,
    read_dcp_metadata,
    sign,
)

FORMAT_VERSION = 1
COMPLETE = "COMPLETE"
META = "meta.json"
WRITER_LOCK = ".writer.lock"  # held by the process writing a .tmp_* directory; not part of the checkpoint's files
_STEP_RE = re.compile(r"step_(\d{8,})")
_FULL_HASH_BYTES = 64 << 20  # files up to this size are hashed whole
_SAMPLE_BYTES = 8 << 20  # larger files: size + sha256 of the first and last 8 MiB (a full hash of TBs costs too much)


# ---------------------------------------------------------------------------------------------------------------
# JSON codec for `extra`: tensors and numpy arrays as base64, tuples kept as tuples (RNG states need them)
# ---------------------------------------------------------------------------------------------------------------


def _encode(obj: Any, where: str) -> Any:
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        return {"__tensor__": base64.b64encode(raw).decode(), "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape)}
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            raise TypeError(f"{where}: numpy arrays of Python objects cannot be stored in a checkpoint")
        return {"__ndarray__": base64.b64encode(np.ascontiguousarray(obj).tobytes()).decode(),
                "dtype": obj.dtype.str, "shape": list(obj.shape)}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: _encode(v, f"{where}[{k!r}]") for k, v in obj.items()}
        return {"__items__": [[_encode(k, where), _encode(v, f"{where}[{k!r}]")] for k, v in obj.items()]}
    raise TypeError(f"{where}: cannot store a {type(obj).__name__} in a checkpoint; use JSON-able values or tensors")


def _decode(obj: Any) -> Any:
    if isinstance(obj, list):
        return [_decode(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        dtype = getattr(torch, str(obj["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"tensor of unknown dtype {obj['dtype']!r}")
        raw = base64.b64decode(obj["__tensor__"])
        if not raw:
            return torch.empty(obj["shape"], dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(obj["shape"]).clone()
    if "__ndarray__" in obj:
        raw = base64.b64decode(obj["__ndarray__"])
        dtype = np.dtype(obj["dtype"])
        if dtype.hasobject:
            raise ValueError("numpy array of Python objects")
        return np.frombuffer(raw, dtype=dtype).reshape(obj["shape"]).copy()
    if "__tuple__" in obj:
        return tuple(_decode(v) for v in obj["__tuple__"])
    if "__items__" in obj:
        return {_decode(k): _decode(v) for k, v in obj["__items__"]}
    return {k: _decode(v) for k, v in obj.items()}


# ---------------------------------------------------------------------------------------------------------------
# RNG state
# ---------------------------------------------------------------------------------------------------------------


def capture_rng_state() -> dict:
    """Python, numpy, torch CPU and (if initialised) CUDA generator states of this process."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    """Inverse of `capture_rng_state` (a CUDA state is restored only where CUDA is available)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------------------------------------------------
# Files: fsync, digests, process-group helpers
# ---------------------------------------------------------------------------------------------------------------


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _no_dist() -> bool:
    return not (dist.is_available() and dist.is_initialized())


@contextmanager
def _quiet_single_process():
    # DCP warns on every single-process save/load that it "assumes the intent"; that is our intent
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; the data files were synced already
    finally:
        os.close(fd)


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _digest(path: Path) -> dict:
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= _FULL_HASH_BYTES:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        else:
            h.update(f.read(_SAMPLE_BYTES))
            f.seek(size - _SAMPLE_BYTES)
            h.update(f.read(_SAMPLE_BYTES))
    return {"size": size, "sha256": h.hexdigest()}


def _data_files(ckpt: Path) -> list[str]:
    return sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*")
                  if p.is_file() and p.name not in (COMPLETE, WRITER_LOCK))


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of complete checkpoints under root, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_RE.fullmatch(p.name)
        if m and p.is_dir() and (p / COMPLETE).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def step_dirs_any(root: Path) -> list[tuple[int, Path, bool]]:
    """(step, path, has COMPLETE) of every `step_*` directory under root, newest first."""
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_RE.fullmatch(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p, (p / COMPLETE).is_file()))
    return sorted(found, reverse=True)


def _lock_file(path: Path, block: bool) -> int | None:
    """An fd holding an exclusive flock on file `path` (created if absent); None if another process holds it
    (block=False). A filesystem without flock support (ENOLCK, EOPNOTSUPP) gets an unlocked fd, not a failure."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB))
    except BlockingIOError:
        os.close(fd)
        return None
    except OSError:
        pass
    return fd


@contextmanager
def _flocked(path: Path):
    """Hold an exclusive flock on `path` (blocking: the sections it guards are short)."""
    fd = _lock_file(path, block=True)
    try:
        yield
    finally:
        os.close(fd)


def _sweep_leftovers(root: Path) -> None:
    """Remove `.tmp_*` leftovers of crashed saves / prunes; one whose WRITER_LOCK another live process holds is a
    save in progress and is left alone. Call under `root/.lock` (a writer creates its lock under it too)."""
    for stale in root.glob(".tmp_*"):
        lock = stale / WRITER_LOCK
        fd = _lock_file(lock, block=False) if lock.is_file() else -1
        if fd is None:
            continue  # held: another process is writing it
        try:
            shutil.rmtree(stale, ignore_errors=True)
        finally:
            if fd >= 0:
                os.close(fd)


def _remove_dir(root: Path, path: Path) -> None:
    """Rename to a .tmp_* name first, so a crash mid-delete never leaves a half-deleted step_* directory."""
    doomed = root / f".tmp_del_{path.name}_{os.getpid()}"
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------------
# Save / load
# ---------------------------------------------------------------------------------------------------------------


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def save_checkpoint(root: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    extra: dict, keep: int, trust_key: bytes | None = None) -> Path:
    """Write `root/step_{step:08d}` atomically and keep only the `keep` newest checkpoints. Returns its path.

    Collective when a process group is initialised (every rank must call it). `extra` holds the trainer's
    JSON-able values, tuples, numpy arrays and tensors (e.g. scheduler.state_dict(), sampler.state_dict(),
    capture_rng_state(), the train spec); `load_checkpoint` returns it unchanged. trust_key: sign COMPLETE with
    it (HMAC, moestack/train/safe_load.py), so that loading with the key accepts this checkpoint.
    """
    assert keep > 0
    root = Path(root)
    name = f"step_{step:08d}"
    final, tmp = root / name, root / f".tmp_{name}"
    encoded_extra = _encode(extra, "extra")  # fail on bad types before touching the disk
    held = None
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        with _flocked(root / ".lock"):
            _sweep_leftovers(root)
            try:
                tmp.mkdir()
            except FileExistsError:
                raise CheckpointError(f"checkpoint {final}: another process is saving this step into {root} now; "
                                      "one run directory takes one writer") from None
            held = _lock_file(tmp / WRITER_LOCK, block=True)
    try:
        _barrier()
        with _quiet_single_process():
            dcp.save(_state(model, optimizer), storage_writer=dcp.FileSystemWriter(tmp, sync_files=True),
                     no_dist=_no_dist())
        _barrier()
        if _rank() == 0:
            _publish(root, tmp, final, step, optimizer is not None, encoded_extra, keep, trust_key)
    finally:
        if held is not None:
            os.close(held)  # the save is over (renamed, or abandoned: the next sweep may remove it)
    _barrier()
    return final


def _publish(root: Path, tmp: Path, final: Path, step: int, has_optimizer: bool, encoded_extra: Any, keep: int,
             trust_key: bytes | None) -> None:
    """Rank 0: meta.json, then COMPLETE (digests, signature), then the rename into place and the prune."""
    meta = {"format_version": FORMAT_VERSION, "step": step, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "has_optimizer": has_optimizer, "extra": encoded_extra}
    _write_synced(tmp / META, json.dumps(meta))
    digests = {f: _digest(tmp / f) for f in _data_files(tmp)}
    complete = {"format_version": FORMAT_VERSION, "step": step, "files": digests}
    if trust_key is not None:
        complete["hmac"] = sign(complete, trust_key)
    _write_synced(tmp / COMPLETE, json.dumps(complete))
    _fsync_path(tmp)
    if final.exists():  # re-saving a step (e.g. the final save lands on a periodic one): replace it
        _remove_dir(root, final)
    os.rename(tmp, final)
    _fsync_path(root)
    for _, old in _step_dirs(root)[:-keep]:
        _remove_dir(root, old)


def latest_checkpoint(root: str | Path) -> Path | None:
    """Newest complete `step_*` checkpoint under root (`.tmp_*` and directories without COMPLETE are ignored)."""
    dirs = _step_dirs(Path(root))
    return dirs[-1][1] if dirs else None


def find_resumable(root: str | Path, trust_key: bytes | None = None) -> tuple[Path | None, list[str]]:
    """(the newest intact checkpoint under root or None, one line per thing passed over and why).

    Newer `step_*` directories that fail verification (no COMPLETE marker, a damaged or missing file) are skipped
    with a line naming them; leftovers of interrupted saves (`.tmp_step_*`) are named too. Raises CheckpointError
    when step directories exist but none is intact (never a silent start from step 0), and at once for a crafted or
    unsigned checkpoint (UnsafeCheckpointError / UntrustedCheckpointError: refused, not passed over).
    """
    root = Path(root)
    leftovers = []  # (step, name) of interrupted saves
    for p in root.glob(".tmp_step_*") if root.is_dir() else []:
        m = _STEP_RE.fullmatch(p.name.removeprefix(".tmp_"))
        if m:
            leftovers.append((int(m.group(1)), p.name))

    def interrupted_after(step: int) -> list[str]:
        names = [name for s, name in sorted(leftovers) if s > step]
        return [f"ignored {', '.join(names)} (an interrupted save: never completed, not a checkpoint)"] if names \
            else []

    notes = []
    found = step_dirs_any(root)
    for step, path, _ in found:
        try:
            verify_checkpoint(path, trust_key)
        except (UnsafeCheckpointError, UntrustedCheckpointError):
            raise
        except CheckpointError as err:
            reason = str(err).removeprefix(f"checkpoint {path}: ").split("; use an earlier")[0]
            notes.append(f"skipped {path.name}: {reason}")
            continue
        if notes:
            notes[-1] += f"; resuming from {path.name}, the newest intact checkpoint"
        return path, interrupted_after(step) + notes
    if found:
        raise CheckpointError(f"--resume: no intact checkpoint under {root}: {'; '.join(notes)}; move the broken "
                              "ones out of the folder to start from step 0, or restore them")
    return None, interrupted_after(-1)


def verify_checkpoint(path: str | Path, trust_key: bytes | None = None) -> dict:
    """Check COMPLETE, every file's size and checksum, the signature (with `trust_key`) and that the DCP metadata
    reads with the restricted unpickler; returns the parsed meta.json. Raises CheckpointError (UnsafeCheckpointError
    / UntrustedCheckpointError for a crafted or unsigned one)."""
    path = Path(path)
    where = f"checkpoint {path}"
    if not path.is_dir():
        raise CheckpointError(f"{where}: not a directory")
    marker = path / COMPLETE
    if not marker.is_file():
        raise CheckpointError(f"{where}: no {COMPLETE} marker (the save did not finish); use an earlier checkpoint")
    try:
        complete = json.loads(marker.read_text())
        files = complete["files"]
        assert isinstance(files, dict) and all(isinstance(v, dict) for v in files.values())
    except (ValueError, KeyError, TypeError, AssertionError, OSError):
        raise CheckpointError(f"{where}: {COMPLETE} marker is unreadable (corrupted)") from None
    if trust_key is not None:
        check_signature(complete, trust_key, where)
    for rel, want in files.items():
        f = path / rel
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise CheckpointError(f"{where}: {COMPLETE} lists '{rel}', outside the checkpoint; refused")
        if not f.is_file():
            raise CheckpointError(f"{where}: missing file '{rel}' (deleted or not copied)")
        got = _digest(f)
        if got["size"] != want["size"]:
            raise CheckpointError(f"{where}: file '{rel}' is {got['size']} bytes, expected {want['size']} (truncated?)")
        if got["sha256"] != want["sha256"]:
            raise CheckpointError(f"{where}: checksum mismatch in '{rel}' (the file is corrupted)")
    if META not in files or ".metadata" not in files:
        raise CheckpointError(f"{where}: {COMPLETE} does not list {META} and .metadata; not a moestack checkpoint")
    try:
        meta = json.loads((path / META).read_text())
        assert isinstance(meta, dict) and isinstance(meta.get("extra", {}), dict)
    except (ValueError, AssertionError):
        raise CheckpointError(f"{where}: {META} is not a JSON object (corrupted)") from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{where}: format version {meta.get('format_version')}, this moestack reads "
                              f"{FORMAT_VERSION}")
    read_dcp_metadata(path)  # a crafted .metadata is refused here, before anything else reads it
    return meta


def _tensor_shapes(obj: Any, prefix: str, out: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Flatten a nested state dict the way DCP names its entries ("a.b.0.c") -> shape of every tensor."""
    if isinstance(obj, torch.Tensor):
        out[prefix] = tuple(obj.shape)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _tensor_shapes(v, f"{prefix}.{k}", out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _tensor_shapes(v, f"{prefix}.{i}", out)
    return out


def _check_matches(path: Path, state: dict[str, Any], partial: bool = False) -> None:
    """Every tensor the model/optimizer expects is in the checkpoint with the same shape, and (unless `partial`: a
    pipeline stage holds only its own layers) vice versa for the model's. Raises CheckpointError naming the first
    difference."""
    where = f"checkpoint {path}"
    saved = {k: tuple(v.size) for k, v in read_dcp_metadata(path).state_dict_metadata.items()
             if isinstance(v, TensorStorageMetadata)}
    hint = "was it saved from a different --model?"
    for section, what in (("model", "tensor"), ("optim", "optimizer state")):
        if section not in state:
            continue
        want = _tensor_shapes(state[section], section, {})
        if section == "optim" and want and not any(k.startswith("optim.") for k in saved):
            raise CheckpointError(f"{where}: has no optimizer state (saved without an optimizer); load the model only")
        for key, shape in want.items():
            short = key.removeprefix(f"{section}.")
            if key not in saved:
                raise CheckpointError(f"{where}: missing {what} '{short}' (model has it, checkpoint does not); {hint}")
            if saved[key] != shape:
                raise CheckpointError(f"{where}: {what} '{short}' has shape {list(saved[key])} in the checkpoint but "
                                      f"{list(shape)} in the model; {hint}")
        if section == "model" and not partial:
            for key in saved:
                if key.startswith("model.") and key not in want:
                    raise CheckpointError(f"{where}: unexpected tensor '{key.removeprefix('model.')}' (checkpoint "
                                          f"has it, model does not); {hint}")


def _drop_absent_rounding_rng(path: Path, state: dict[str, Any]) -> bool:
    """A checkpoint saved before the optimizers kept their stochastic-rounding noise state (param_groups[i]
    [ROUNDING_RNG_KEY], moestack.memory.adamw.RoundingStateMixin) lacks those entries, and dcp.load is strict:
    drop them from the load template where the checkpoint has none, so the optimizer keeps its fresh noise. Only
    this entry: any other missing key still fails the load. Returns whether something was dropped."""
    groups = state.get("optim", {}).get("param_groups", [])
    if not any(ROUNDING_RNG_KEY in g for g in groups):
        return False
    saved = read_dcp_metadata(path).state_dict_metadata
    dropped = False
    for i, group in enumerate(groups):
        prefix = f"optim.param_groups.{i}.{ROUNDING_RNG_KEY}"
        if ROUNDING_RNG_KEY in group and not any(k == prefix or k.startswith(prefix + ".") for k in saved):
            del group[ROUNDING_RNG_KEY]
            dropped = True
    return dropped


# Tied embeddings (spec.tie_word_embeddings). One process, or any layout without pipeline parallelism, has one
# parameter under two names: the model section stores it twice (embed.weight and lm_head.weight), the optimizer
# section once, as embed.weight (torch's get_state_dict names a shared parameter's state once). Under PP the last
# stage's head is its own copy (moestack.parallel.pipeline), stored with its own optimizer entry.
TIED_EMBED, TIED_HEAD = "embed.weight", "lm_head.weight"


def _tied_weights(model: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
    """(embedding, head) weights this module holds (None where it has not that part) if the model ties them, else
    None. Under PP a stage holds one of them or both as separate copies; otherwise both are one parameter."""
    if not getattr(getattr(model, "spec", None), "tie_word_embeddings", False):
        return None
    embed, head = getattr(model, "embed", None), getattr(model, "lm_head", None)
    return (embed.weight if embed is not None else None), (head.weight if head is not None else None)


def _borrow_embedding_state(path: Path, model: nn.Module, state: dict[str, Any]) -> tuple[dict, bool] | None:
    """A pipeline stage's own head copy loading a checkpoint that stores the tied weight's optimizer state once
    (under embed.weight, see above): read the head copy's state from the embedding's entries. Both copies take
    identical steps, so those are the head copy's values. Changes the load template in place; returns what
    `_return_embedding_state` needs to undo it after dcp.load, or None when there is nothing to borrow."""
    tied = _tied_weights(model)
    states = state.get("optim", {}).get("state", {})
    if tied is None or tied[0] is tied[1] or TIED_HEAD not in states:
        return None
    saved = read_dcp_metadata(path).state_dict_metadata
    if any(k.startswith(f"optim.state.{TIED_HEAD}.") for k in saved):  # saved under PP: the copy has its own
        return None
    head_state = states.pop(TIED_HEAD)
    if TIED_EMBED in states:  # both copies on this rank (V-shape schedules): copy the embedding's once loaded
        return head_state, False
    states[TIED_EMBED] = head_state  # DCP fills the head copy's tensors from the embedding's entries
    return head_state, True


def _return_embedding_state(state: dict[str, Any], borrowed: tuple[dict, bool]) -> None:
    head_state, renamed = borrowed
    states = state["optim"]["state"]
    if renamed:
        head_state = states.pop(TIED_EMBED)  # (DCP may have replaced non-tensor values in this dict)
    else:
        for k, v in states[TIED_EMBED].items():
            if isinstance(v, torch.Tensor) and isinstance(head_state.get(k), torch.Tensor):
                head_state[k].copy_(v)
            else:
                head_state[k] = v
    states[TIED_HEAD] = head_state


def _read_head_apart(model: nn.Module, state: dict[str, Any]) -> torch.Tensor | None:
    """A model whose embedding and head are one parameter reads the checkpoint's two entries of it into one tensor:
    the later read would silently win. Read lm_head.weight into a tensor of its own (compared by
    `_check_head_read`); None when the model does not hold the tied weight as one parameter."""
    tied, sd = _tied_weights(model), state["model"]
    if tied is None or tied[0] is None or tied[0] is not tied[1] or TIED_HEAD not in sd or TIED_EMBED not in sd:
        return None
    sd[TIED_HEAD] = torch.empty_like(sd[TIED_HEAD])
    return sd[TIED_HEAD]


def _check_head_read(path: Path, state: dict[str, Any], head: torch.Tensor) -> None:
    sd = state["model"]
    embed, head = (t.to_local() if isinstance(t, DTensor) else t for t in (sd[TIED_EMBED], head))
    differs = torch.tensor(float(not torch.equal(embed, head)), device=embed.device)
    if not _no_dist():  # every rank holds its shard of both: refuse on all ranks alike
        dist.all_reduce(differs, op=dist.ReduceOp.MAX)
    sd[TIED_HEAD] = sd[TIED_EMBED]
    if differs.item():
        raise CheckpointError(f"checkpoint {path}: tensors '{TIED_EMBED}' and '{TIED_HEAD}' differ, but the model "
                              "ties them (tie_word_embeddings): one parameter cannot take both; load a checkpoint "
                              "of a tied model, or set tie_word_embeddings: false if it was trained untied")


def _unsafe_failure(err: BaseException) -> str | None:
    """The message of an UnsafeCheckpointError inside DCP's wrappers (its per-rank failures, or a cause chain)."""
    seen = [err]
    if isinstance(err, CheckpointException):
        seen += [e for e, _ in err.failures.values()]
    for e in seen:
        while e is not None:
            if isinstance(e, UnsafeCheckpointError):
                return str(e)
            e = e.__cause__ or e.__context__
    return None


def forget_fp8_weights() -> None:
    """Drop the FP8 expert-weight cache (moestack.ops.fp8.weight_cache) if it was loaded: under FSDP2 a load
    reaches the weights' gathered copies without moving the version counter the cache watches."""
    cache = sys.modules.get("moestack.ops.fp8.weight_cache")
    if cache is not None:
        cache.clear()


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    partial: bool = False, trust_key: bytes | None = None) -> dict:
    """Verify `path`, restore model (and optimizer, if given) in place, and return the saved `extra` dict.

    Collective when a process group is initialised. Raises CheckpointError (one line) for a partial or corrupted
    checkpoint or one whose parameter names/shapes differ from the model's. partial: `model` is one pipeline
    stage's part of the saved model (tensors of other stages in the checkpoint are expected, not an error).
    A checkpoint saved before the optimizer kept its stochastic-rounding noise state loads with one warning (the
    noise restarts from the seed; `_drop_absent_rounding_rng`). trust_key: refuse a checkpoint not signed with it.
    """
    path = Path(path)
    meta = verify_checkpoint(path, trust_key)
    state = _state(model, optimizer)
    borrowed = _borrow_embedding_state(path, model, state)  # tied model, PP stage <- checkpoint without PP
    head_apart = _read_head_apart(model, state)  # tied model without PP <- any checkpoint (PP: two copies)
    _check_matches(path, state, partial)
    old_rounding = _drop_absent_rounding_rng(path, state)
    # The saved param groups' name lists are one rank's (DCP keeps one copy of a non-tensor entry), and under PP
    # each rank names other parameters: set_state_dict maps each group by those names (and picks the names of a
    # parameter held under two, a tied embedding's), so a PP rank missing from the saved lists would lose its groups'
    # hyper-parameters (KeyError at the first step). DCP matches the groups by index; give each its own names back.
    own_names = [group.get("params") for group in state.get("optim", {}).get("param_groups", [])]
    try:
        with _quiet_single_process():
            dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner(),
                     no_dist=_no_dist())
    except (Exception, CheckpointException) as err:  # DCP wraps per-rank failures; keep the message to one line
        # (CheckpointException, DCP's per-rank wrapper, is a BaseException: name it, or it passes through unread)
        unsafe = _unsafe_failure(err)
        if unsafe is not None:
            raise UnsafeCheckpointError(f"checkpoint {path}: {unsafe}") from None
        if isinstance(err, CheckpointException) and err.failures:
            err_type, text = next((type(e).__name__, str(e)) for e, _ in err.failures.values())
        else:
            err_type, text = type(err).__name__, str(err)
        missing = re.search(r"Missing key in checkpoint state_dict: (\S+?)\.?$", text, re.MULTILINE)
        if missing:  # a non-tensor entry (tensors were checked above), e.g. an optimizer hyper-parameter
            raise CheckpointError(f"checkpoint {path}: missing entry '{missing.group(1)}' (the model/optimizer has "
                                  "it, the checkpoint does not); was it saved with a different optimizer?") from err
        first = text.strip().splitlines()[0] if text.strip() else ""
        raise CheckpointError(f"checkpoint {path}: reading tensors failed ({err_type}: {first})") from err
    if borrowed is not None:
        _return_embedding_state(state, borrowed)
    for group, names in zip(state.get("optim", {}).get("param_groups", []), own_names, strict=True):
        group["params"] = names
    if head_apart is not None:
        _check_head_read(path, state, head_apart)
    if old_rounding:
        warnings.warn(f"checkpoint {path}: rounding noise restarts: checkpoint predates the optimizer's "
                      f"rounding-noise state ('{ROUNDING_RNG_KEY}'), so the resumed run is not bitwise the "
                      "uninterrupted one", stacklevel=2)
    forget_fp8_weights()
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        with warnings.catch_warnings():
            if old_rounding:  # warned above, with the path; the optimizer says the same
                warnings.filterwarnings("ignore", message=f".*{re.escape(NO_ROUNDING_STATE)}")
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return decode_extra(path, meta)


def decode_extra(path: Path, meta: dict) -> dict:
    """meta.json's `extra`, decoded (tensors, arrays, tuples); CheckpointError naming the file if it is damaged."""
    try:
        return _decode(meta.get("extra", {}))
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError) as err:
        raise CheckpointError(f"checkpoint {path}: {META} 'extra' is unreadable ({type(err).__name__}: "
                              f"{str(err).splitlines()[0] if str(err) else ''}); the file is damaged or was "
                              "edited") from None
