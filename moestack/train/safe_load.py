"""Reading checkpoints without running code from them, and refusing checkpoints that are not trusted.

What a DCP checkpoint holds that Python would unpickle, and how each is read here:
    .metadata                  a pickled `Metadata` (torch's FileSystemReader unpickles it with plain pickle): read
                               by `RestrictedUnpickler`, which resolves only the DCP metadata classes listed in
                               `_METADATA_GLOBALS` and refuses any other global (os.system, builtins.eval, ...)
    non-tensor entries         optimizer hyper-parameters etc., saved with torch.save (DefaultLoadPlanner reads them
    (BytesStorageMetadata)     with torch.load(weights_only=False)): `SafeLoadPlanner` reads them weights-only
    tensors                    torch already reads them with torch.load(weights_only=True)
meta.json and COMPLETE are JSON.

Trust: a checkpoint carries the sha256 of its files in COMPLETE, which detects damage but not forgery (anyone can
recompute them). With a key (`checkpoint.trust_key_file`, a file of at least 16 bytes), COMPLETE also carries an
HMAC-SHA256 over that list, and loading with the key refuses a checkpoint whose HMAC is missing or wrong. The
digests of files above 64 MiB cover their size and first and last 8 MiB (checkpoint.py), so the signature binds the
metadata and small files completely and large tensor files by those samples; tensor files cannot run code.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from moestack.config.base import ConfigError

MIN_KEY_BYTES = 16


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message is one line naming the path and the problem."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint whose pickled parts name something other than DCP metadata (it would run code if unpickled).
    The message is one line; nothing from the file was executed."""


class UntrustedCheckpointError(CheckpointError):
    """A checkpoint without a valid signature under the configured trust key; the message is one line."""


def _metadata_globals() -> dict[tuple[str, str], Any]:
    """(module, name) -> object for every global a DCP `.metadata` pickle of this torch refers to: the metadata
    dataclasses, torch.Size, the dtypes, the layout / memory-format decoders, and the Path type of the checkpoint id
    torch records. Resolved by name so that a class torch moved between versions is simply absent, not an error."""
    import importlib

    names = {
        "torch.distributed.checkpoint.metadata": ["Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                                  "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                                  "StorageMeta", "_MEM_FORMAT_ENCODING"],
        "torch.distributed.checkpoint.filesystem": ["_StorageInfo"],
        "torch.distributed.checkpoint._extension": ["StreamTransformExtension"],
        "torch.serialization": ["_get_layout"],
        "torch": ["Size", "device"],
        "pathlib": ["PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"],
        "collections": ["OrderedDict"],
    }
    allowed: dict[tuple[str, str], Any] = {}
    for module, attrs in names.items():
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        for attr in attrs:
            if hasattr(mod, attr):
                allowed[(module, attr)] = getattr(mod, attr)
    for value in vars(torch).values():  # torch.float32, torch.bfloat16, ...: pickled as globals of torch
        if isinstance(value, torch.dtype):
            allowed[("torch", str(value).removeprefix("torch."))] = value
    return allowed


_METADATA_GLOBALS = _metadata_globals()


class RestrictedUnpickler(pickle.Unpickler):
    """pickle.Unpickler that resolves only the globals in `_METADATA_GLOBALS` (Python's documented way of
    restricting unpickling: every GLOBAL / STACK_GLOBAL / EXT opcode goes through find_class) and has no persistent
    ids. Anything else raises UnsafeCheckpointError before it is imported, let alone called."""

    def __init__(self, file, source: str):
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str):
        obj = _METADATA_GLOBALS.get((module, name))
        if obj is None:
            raise UnsafeCheckpointError(
                f"{self.source}: refers to '{module}.{name}', which DCP metadata never holds; the file was crafted "
                "or is not a DCP checkpoint: refused, nothing from it was run")
        return obj

    def persistent_load(self, pid):
        raise UnsafeCheckpointError(f"{self.source}: holds a persistent reference, which DCP metadata never does; "
                                    "refused, nothing from it was run")


def read_dcp_metadata(path: str | Path, rank: int | None = None) -> Metadata:
    """The `Metadata` of the DCP checkpoint directory `path`, through RestrictedUnpickler."""
    name = ".metadata" if rank is None else f"__{rank}.metadata"
    file = Path(path) / name
    try:
        data = file.read_bytes()
    except OSError as err:
        raise UnsafeCheckpointError(f"checkpoint {path}: cannot read {name} ({err.strerror})") from None
    where = f"checkpoint {path}: {name}"
    try:
        md = RestrictedUnpickler(io.BytesIO(data), where).load()
    except UnsafeCheckpointError:
        raise
    except Exception as err:  # truncated / garbage pickle: unpickling errors of many types
        raise UnsafeCheckpointError(f"{where}: not a readable DCP metadata file ({type(err).__name__}: "
                                    f"{str(err).splitlines()[0] if str(err) else ''})") from None
    if not isinstance(md, Metadata):
        raise UnsafeCheckpointError(f"{where}: holds a {type(md).__name__}, not DCP Metadata; refused")
    return md


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose read_metadata goes through RestrictedUnpickler (tensor reads are torch's,
    weights-only already)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md = read_dcp_metadata(self.path, kwargs.get("rank"))
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = getattr(self, "load_id", None)
        return md


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that reads non-tensor entries (torch.save'd Python values) weights-only: plain
    containers, numbers, strings and tensors; anything that would need code to rebuild is refused."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            raise UnsafeCheckpointError(f"entry '{read_item.dest_index.fqn}' is not a plain value (weights-only "
                                        f"load refused it: {str(err).splitlines()[0]}); refused, nothing from it "
                                        "was run") from None
        super().load_bytes(read_item, io.BytesIO(_resave(obj)))


def _resave(obj: Any) -> bytes:
    # DefaultLoadPlanner.load_bytes unpickles its argument itself; hand it the checked value re-serialised, so the
    # flattening / mapping logic stays torch's and the bytes it reads are ours
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf.getvalue()


# ---------------------------------------------------------------------------------------------- trust (HMAC)


def read_trust_key(path: str | Path | None, field: str = "checkpoint.trust_key_file") -> bytes | None:
    """The key bytes of a trust key file (surrounding whitespace stripped), or None without one. ConfigError (one
    line naming `field`) when the file is missing, unreadable or shorter than MIN_KEY_BYTES."""
    if path is None:
        return None
    p = Path(path)
    try:
        key = p.read_bytes().strip()
    except OSError as err:
        raise ConfigError(f"{field}: cannot read '{p}' ({err.strerror}); point it at a file holding the key, e.g. "
                          f"made with: head -c 32 /dev/urandom | base64 > {p.name}") from None
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(f"{field}: '{p}' holds {len(key)} bytes; a key needs at least {MIN_KEY_BYTES}, e.g. "
                          f"head -c 32 /dev/urandom | base64 > {p.name}")
    return key


def sign(complete: dict, key: bytes) -> str:
    """HMAC-SHA256 (hex) over COMPLETE's content (format version, step, every file's size and digest)."""
    body = json.dumps({k: complete[k] for k in ("format_version", "step", "files")}, sort_keys=True,
                      separators=(",", ":"))
    return hmac.new(key, body.encode(), hashlib.sha256).hexdigest()


def check_signature(complete: dict, key: bytes, where: str) -> None:
    """Raise UntrustedCheckpointError unless COMPLETE carries the HMAC of its content under `key`."""
    got = complete.get("hmac")
    if not isinstance(got, str):
        raise UntrustedCheckpointError(f"{where}: not signed, but checkpoint.trust_key_file is set: a checkpoint from "
                                       "elsewhere is refused unless signed with the run's key (re-save it with the "
                                       "key, or drop checkpoint.trust_key_file to accept unsigned checkpoints)")
    if not hmac.compare_digest(got, sign(complete, key)):
        raise UntrustedCheckpointError(f"{where}: signature does not match the key in checkpoint.trust_key_file "
                                       "(signed with another key, or its files were changed and re-hashed); "
                                       "refused")

