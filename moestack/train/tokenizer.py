"""Tokenizers: a byte-level one that needs nothing, and a wrapper around a local HuggingFace tokenizer.json.

Both expose the same small surface the data pipeline uses: `vocab_size`, `eos_id`, `bos_id`, `pad_id`,
`fingerprint` (names the tokenizer in cache keys), `encode`, `encode_to_array`, `decode`.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from moestack.config.base import ConfigError
from moestack.config.train_spec import DataSpec

# Special-token spellings tried, in order, when a tokenizer.json does not say which token ends a document.
_EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "<|im_end|>", "[SEP]")
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|bos|>", "[CLS]")
_PAD_NAMES = ("<pad>", "<|pad|>", "[PAD]")


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype that holds every id of a vocabulary of this size."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; then eos=256, bos=257, pad=258 (vocab_size 259)."""

    eos_id = 256
    bos_id = 257
    pad_id = 258
    vocab_size = 259
    fingerprint = "byte-v1"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_to_array(self, text: str) -> np.ndarray:
        """Token ids of `text` as a 1-D uint16 array (no specials added)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids) -> str:
        """Bytes back to text; special ids are dropped, invalid UTF-8 becomes U+FFFD."""
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A local HuggingFace `tokenizer.json`, loaded with the optional `tokenizers` package."""

    def __init__(self, path: str | Path):
        path = Path(path)
        if path.is_dir() and (path / "tokenizer.json").is_file():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise ConfigError(f"data.tokenizer: '{path}' is not a file; give a local tokenizer.json or 'byte'")
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ConfigError(f"data.tokenizer '{path}' needs the 'tokenizers' package: pip install 'moestack[hf]' "
                              "(or use --tokenizer byte)") from None
        self.path = path
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as err:  # tokenizers raises its own exception type for a bad file
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise ConfigError(f"data.tokenizer: '{path}' is not a readable tokenizer.json ({first})") from None
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.eos_id = self._find(_EOS_NAMES)
        if self.eos_id is None:
            raise ValueError(
                f"data.tokenizer '{path}': no end-of-document token found (looked for {', '.join(_EOS_NAMES)})"
            )
        self.bos_id = self._find(_BOS_NAMES)
        self.pad_id = self._find(_PAD_NAMES)
        self.fingerprint = "hf-" + hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        self._dtype = token_dtype(self.vocab_size)

    def _find(self, names: tuple[str, ...]) -> int | None:
        for name in names:
            tid = self._tok.token_to_id(name)
            if tid is not None:
                return int(tid)
        return None

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_to_array(self, text: str) -> np.ndarray:
        """Token ids of `text` as a 1-D uint16 (vocab <= 65536) or uint32 array."""
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=self._dtype)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


def build_tokenizer(spec: DataSpec) -> ByteTokenizer | HFTokenizer:
    """`spec.tokenizer` is "byte" or a path to a local tokenizer.json."""
    if spec.tokenizer == "byte":
        return ByteTokenizer()
    return HFTokenizer(spec.tokenizer)
