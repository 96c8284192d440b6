"""Token data for training: the built-in corpus, user text / jsonl / pre-tokenized .bin files, and batching.

Everything ends as one 1-D token array (or a memory-mapped view of one), split into train and eval tails.
`BatchSampler` cuts the train part into non-overlapping windows of S+1 tokens and serves them in a seeded,
epoch-wise shuffled order; each data-parallel rank takes a disjoint strided shard of every epoch.

Legend: B = batch size, S = sequence length, N = tokens, W = windows of S+1 tokens (starts at multiples of S).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
import torch

from moestack.config.settings import DATA_CACHE_ENV, data_cache_dir
from moestack.config.train_spec import DataSpec
from moestack.train.tokenizer import token_dtype

CACHE_ENV = DATA_CACHE_ENV
BUILTIN_MAX_BYTES = 8_000_000  # ~8 MB of text: tokenizes in well under a couple of seconds
_CACHE_VERSION = 1
_DOC_SUFFIXES = (".txt", ".rst", ".md")
_TEST_DIRS = {"test", "tests", "idle_test"}
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_SUFFIX = {"text": (".txt",), "jsonl": (".jsonl",), "bin": (".bin",)}


def cache_dir() -> Path:
    """Where token caches live: $MOESTACK_CACHE or ~/.cache/moestack."""
    return data_cache_dir()


# ---------------------------------------------------------------------------------------------------------------
# Sources -> token arrays
# ---------------------------------------------------------------------------------------------------------------


def builtin_corpus_files(max_bytes: int = BUILTIN_MAX_BYTES) -> list[Path]:
    """Files of the built-in corpus, in a fixed order, whole files until `max_bytes` is reached.

    Order: docs present with this Python (stdlib .txt/.rst/.md, share/doc/python*), then standard-library
    sources (*.py), then the stdlib's own tests (*.py). Within each group paths are sorted. Third-party
    site-packages are excluded so the corpus depends only on the Python version.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs: list[Path] = []
    sources: list[Path] = []
    tests: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(stdlib):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        rel_parts = set(Path(dirpath).relative_to(stdlib).parts)
        in_tests = bool(rel_parts & _TEST_DIRS)
        for name in filenames:
            path = Path(dirpath) / name
            if name.endswith(".py"):
                (tests if in_tests else sources).append(path)
            elif name.endswith(_DOC_SUFFIXES) and not in_tests:
                docs.append(path)
    for doc_root in sorted((Path(sys.base_prefix) / "share" / "doc").glob("python*")):
        docs.extend(p for p in doc_root.rglob("*") if p.is_file() and p.name.endswith(_DOC_SUFFIXES))
    chosen: list[Path] = []
    total = 0
    for path in sorted(docs) + sorted(sources) + sorted(tests):
        if total >= max_bytes:
            break
        size = path.stat().st_size
        if size:
            chosen.append(path)
            total += size
    return chosen


def tokenize_documents(docs: Iterable[str], tokenizer) -> np.ndarray:
    """Concatenate the token ids of each non-empty document, each followed by eos. Returns a 1-D array [N]."""
    dtype = token_dtype(tokenizer.vocab_size)
    eos = np.array([tokenizer.eos_id], dtype=dtype)
    parts: list[np.ndarray] = []
    for doc in docs:
        if doc:
            parts.append(tokenizer.encode_to_array(doc).astype(dtype, copy=False))
            parts.append(eos)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def _cached(kind: str, files: list[Path], tokenizer, build: Callable[[], np.ndarray]) -> np.ndarray:
    """Token array for (kind, files, tokenizer), from the cache if present; the key covers paths, sizes, mtimes."""
    key = hashlib.sha256(f"{_CACHE_VERSION}|{kind}|{tokenizer.fingerprint}".encode())
    for f in files:
        st = f.stat()
        key.update(f"|{f.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    path = cache_dir() / f"{kind}-{key.hexdigest()[:24]}.npy"
    if path.is_file():
        try:
            return np.load(path, mmap_mode="r")
        except (OSError, ValueError):
            pass  # unreadable cache file: rebuild it below
    tokens = build()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:  # write-then-rename, so concurrent ranks never read a half-written cache
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            np.save(f, tokens)
        os.replace(tmp, path)
    except OSError as err:
        warnings.warn(f"token cache not written ({err}); set ${CACHE_ENV} to a writable directory", stacklevel=2)
        tmp.unlink(missing_ok=True)
    return tokens


def _expand_paths(spec: DataSpec) -> list[Path]:
    """Files named by spec.paths; directories contribute their files with the source's suffix, sorted."""
    suffixes = _SUFFIX[spec.source]
    files: list[Path] = []
    for raw in spec.paths:
        p = Path(raw).expanduser()
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.name.endswith(suffixes))
            if not found:
                raise ValueError(f"data.paths: directory '{p}' has no {'/'.join(suffixes)} files for source "
                                 f"'{spec.source}'; point at the files or change data.source")
            files.extend(found)
        elif p.is_file():
            if not os.access(p, os.R_OK):
                raise ValueError(f"data.paths: '{p}' is not readable (permission denied); fix its permissions or "
                                 "drop it from --data")
            files.append(p)
        else:
            raise ValueError(f"data.paths: '{p}' does not exist; check the path (relative to {Path.cwd()})")
    return files


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 text (byte {err.start}); convert it, or use data.source 'bin' "
                         "for pre-tokenized ids") from None


def _jsonl_documents(path: Path, field: str) -> list[str]:
    docs = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({err.msg}); each line must be one object") from None
            if not isinstance(record, dict) or field not in record:
                keys = ", ".join(map(str, record)) if isinstance(record, dict) else type(record).__name__
                raise ValueError(f"{path}:{lineno}: no field '{field}' (found: {keys}); set data.jsonl_field")
            if not isinstance(record[field], str):
                raise ValueError(f"{path}:{lineno}: field '{field}' is {type(record[field]).__name__}, not a string")
            docs.append(record[field])
    return docs


def _documents(spec: DataSpec, files: list[Path]) -> Iterator[str]:
    for path in files:
        if spec.source == "builtin":  # stdlib files are UTF-8; a stray byte must not stop training
            yield path.read_bytes().decode("utf-8", errors="replace")
        elif spec.source == "text":
            yield _read_text(path)
        else:
            yield from _jsonl_documents(path, spec.jsonl_field)


def _open_bin(path: Path, dtype: str) -> np.memmap:
    size = path.stat().st_size
    itemsize = np.dtype(dtype).itemsize
    if size == 0:
        raise ValueError(f"{path}: empty token file; remove it from data.paths")
    if size % itemsize:
        raise ValueError(f"{path}: {size} bytes is not a multiple of {itemsize} (data.bin_dtype={dtype}); "
                         "is data.bin_dtype right?")
    return np.memmap(path, dtype=dtype, mode="r")


def check_token_ids(tokens, vocab_size: int, source: str, fix: str) -> None:
    """Raise a one-line ValueError naming `source` if any id >= vocab_size. Scans in chunks (memmap-safe)."""
    chunk = 1 << 24
    for start in range(0, len(tokens), chunk):
        block = np.asarray(tokens[start : start + chunk])
        if block.size and int(block.max()) >= vocab_size:
            pos = start + int(np.argmax(block >= vocab_size))
            raise ValueError(f"{source}: token id {int(tokens[pos])} at position {pos} >= model vocab_size "
                             f"{vocab_size}; {fix}")


class ConcatTokens:
    """Several 1-D token arrays (e.g. memory-mapped .bin shards) seen as one, without copying them.

    `len()`, `x[a:b]` (materialises just that range as an ndarray) and `view(a, b)` (a lazy sub-range).
    """

    def __init__(self, parts: list[np.ndarray]):
        self.parts = [p for p in parts if len(p)]
        assert self.parts and len({p.dtype for p in self.parts}) == 1
        self.dtype = self.parts[0].dtype
        self.offsets = np.cumsum([0] + [len(p) for p in self.parts])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, key):
        if isinstance(key, (int, np.integer)):
            key = int(key) + (len(self) if key < 0 else 0)
            i = int(np.searchsorted(self.offsets, key, side="right")) - 1
            return self.parts[i][key - self.offsets[i]]
        start, stop, step = key.indices(len(self))
        assert step == 1, "ConcatTokens supports contiguous slices only"
        out = []
        i = max(int(np.searchsorted(self.offsets, start, side="right")) - 1, 0)
        while start < stop:
            part_end = int(self.offsets[i + 1])
            take = min(stop, part_end) - start
            lo = start - int(self.offsets[i])
            out.append(np.asarray(self.parts[i][lo : lo + take]))
            start += take
            i += 1
        return np.concatenate(out) if out else np.zeros(0, dtype=self.dtype)

    def view(self, start: int, stop: int) -> ConcatTokens | np.ndarray:
        """Tokens [start, stop) without copying."""
        parts = []
        for i, part in enumerate(self.parts):
            lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
            a, b = max(start, lo), min(stop, hi)
            if a < b:
                parts.append(part[a - lo : b - lo])
        return ConcatTokens(parts) if parts else np.zeros(0, dtype=self.dtype)

    def __array__(self, dtype=None, copy=None):
        arr = self[:]
        return arr if dtype is None else arr.astype(dtype)


def _lazy_slice(tokens, start: int, stop: int):
    return tokens.view(start, stop) if isinstance(tokens, ConcatTokens) else tokens[start:stop]


def load_tokens(spec: DataSpec, tokenizer, vocab_size: int):
    """All tokens of the data source as a 1-D array-like [N] (ndarray, memmap or ConcatTokens).

    Checks that every id < vocab_size and that there is data; errors are one-line ValueErrors.
    """
    tok_fix = (f"the tokenizer's vocab ({tokenizer.vocab_size}) is larger than the model's; use a model with "
               f"vocab_size >= {tokenizer.vocab_size} or another data.tokenizer")
    if spec.source == "bin":
        arrays = []
        for path in _expand_paths(spec):
            arr = _open_bin(path, spec.bin_dtype)
            check_token_ids(arr, vocab_size, str(path),
                            "was it tokenized for another model (or is data.bin_dtype wrong)?")
            arrays.append(arr)
        return arrays[0] if len(arrays) == 1 else ConcatTokens(arrays)
    if spec.source == "builtin":
        files, what, kind = builtin_corpus_files(), "builtin corpus", "builtin"
        if not files:
            raise ValueError(f"builtin corpus: no Python sources found under {sysconfig.get_paths()['stdlib']}; "
                             "use data.source 'text' with your own files")
    else:
        files, what, kind = _expand_paths(spec), f"data.paths {spec.paths}", f"{spec.source}-{spec.jsonl_field}"
    tokens = _cached(kind, files, tokenizer, lambda: tokenize_documents(_documents(spec, files), tokenizer))
    if len(tokens) == 0:
        raise ValueError(f"{what}: no text found (all files or '{spec.jsonl_field}' fields are empty)")
    check_token_ids(tokens, vocab_size, f"{what} tokenized with '{spec.tokenizer}'", tok_fix)
    return tokens


# ---------------------------------------------------------------------------------------------------------------
# Split and batching
# ---------------------------------------------------------------------------------------------------------------


class TokenStream:
    """A 1-D token array and its split: the last `eval_fraction` of the tokens are held out for eval."""

    def __init__(self, tokens, eval_fraction: float):
        assert 0 <= eval_fraction < 1
        n = len(tokens)
        n_eval = int(n * eval_fraction)
        self.tokens = tokens
        self.train = _lazy_slice(tokens, 0, n - n_eval)
        self.eval = _lazy_slice(tokens, n - n_eval, n)


def _gather_windows(tokens, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows of S+1 tokens at `starts` -> (inputs [B, S], targets [B, S]) int64, targets shifted by one."""
    rows_BS1 = np.stack([np.asarray(tokens[s : s + seq_len + 1]) for s in starts.tolist()]).astype(np.int64)
    rows = torch.from_numpy(rows_BS1)
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


class BatchSampler:
    """Deterministic, resumable batches of shuffled non-overlapping windows.

    Window w covers tokens [w*S, w*S + S + 1). Each epoch permutes all W windows with a generator seeded by
    (seed, epoch); rank r takes permutation[r::world_size], cut to the same length on every rank, so ranks see
    disjoint windows and the same number of batches. The last partial batch of an epoch is dropped.
    """

    def __init__(self, tokens, seq_len: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.num_windows = max(len(tokens) - 1, 0) // seq_len
        self.batches_per_epoch = self.num_windows // world_size // batch_size
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"{len(tokens)} training tokens give {self.num_windows} windows of seq_len+1={seq_len + 1}, but one "
                f"batch on each of {world_size} rank(s) needs {batch_size * world_size}; use more data or a smaller "
                "seq_len / micro_batch_size")
        self.epoch = 0
        self.position = 0  # batches already served in this epoch
        self._shard_epoch = -1
        self._shard_W = np.zeros(0, dtype=np.int64)

    def _shard(self) -> np.ndarray:
        if self._shard_epoch != self.epoch:  # one permutation per epoch, cached
            rng = np.random.default_rng([self.seed % 2**63, self.epoch])
            perm_W = rng.permutation(self.num_windows)
            per_rank = self.batches_per_epoch * self.batch_size
            self._shard_W = perm_W[self.rank :: self.world_size][:per_rank]
            self._shard_epoch = self.epoch
        return self._shard_W

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs LongTensor [B, S], targets LongTensor [B, S]) on CPU; targets are inputs shifted by one."""
        if self.position == self.batches_per_epoch:
            self.epoch += 1
            self.position = 0
        b = self.batch_size
        window_ids = self._shard()[self.position * b : (self.position + 1) * b]
        self.position += 1
        return _gather_windows(self.tokens, window_ids * self.seq_len, self.seq_len)

    def state_dict(self) -> dict:
        """JSON-able position plus the settings that must match for an exact resume."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "seq_len": self.seq_len,
                "batch_size": self.batch_size, "world_size": self.world_size, "num_windows": self.num_windows}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "seq_len", "batch_size", "world_size", "num_windows"):
            if state[key] != getattr(self, key):
                raise ValueError(f"data sampler state was saved with {key}={state[key]} but this run has "
                                 f"{getattr(self, key)}; resume with the same data and batch settings")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])


def eval_batches(tokens, seq_len: int, batch_size: int, num_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed eval batches: `num_batches` (fewer if the data is short) batches of windows spread evenly over `tokens`.

    Returns a list of (inputs LongTensor [B, S], targets [B, S]).
    """
    n_windows = max(len(tokens) - 1, 0) // seq_len
    if n_windows < batch_size:
        raise ValueError(f"eval data has {len(tokens)} tokens: fewer than batch_size={batch_size} windows of "
                         f"seq_len+1={seq_len + 1}; raise data.eval_fraction or set it to 0 to skip eval")
    count = min(num_batches, n_windows // batch_size) * batch_size
    window_ids = np.linspace(0, n_windows - 1, count).round().astype(np.int64)  # distinct: spacing >= 1
    return [_gather_windows(tokens, window_ids[i : i + batch_size] * seq_len, seq_len)
            for i in range(0, count, batch_size)]


def build_data(spec: DataSpec, tokenizer, seq_len: int, batch_size: int, seed: int, vocab_size: int,
               rank: int = 0, world_size: int = 1):
    """Load, check and split the data. Returns (train BatchSampler, eval tokens array-like [N_eval]).

    eval tokens are empty when spec.eval_fraction is 0; otherwise they hold at least one eval batch.
    """
    stream = TokenStream(load_tokens(spec, tokenizer, vocab_size), spec.eval_fraction)
    what = "builtin corpus" if spec.source == "builtin" else f"data.paths {spec.paths}"
    need = (seq_len * batch_size * world_size) + 1
    if len(stream.train) < need:
        raise ValueError(f"{what}: {len(stream.train)} training tokens, but seq_len={seq_len} x micro_batch_size="
                         f"{batch_size} x {world_size} rank(s) needs {need}; add data or lower seq_len / batch size")
    if spec.eval_fraction > 0 and len(stream.eval) < seq_len * batch_size + 1:
        raise ValueError(f"{what}: eval split (data.eval_fraction={spec.eval_fraction}) has {len(stream.eval)} "
                         f"tokens, fewer than one batch ({seq_len * batch_size + 1}); raise data.eval_fraction "
                         "or set it to 0")
    sampler = BatchSampler(stream.train, seq_len, batch_size, seed, rank, world_size)
    return sampler, stream.eval
