"""Tokenizers, data sources (builtin / text / jsonl / bin), the train/eval split and batch sampling."""

from __future__ import annotations

import json
import sys
import types

import numpy as np
import pytest
import torch

from moestack.config.base import ConfigError
from moestack.config.train_spec import DataSpec
from moestack.train.data import (
    BatchSampler,
    ConcatTokens,
    TokenStream,
    build_data,
    builtin_corpus_files,
    eval_batches,
    load_tokens,
)
from moestack.train.tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOESTACK_CACHE", str(tmp_path / "cache"))


def _unique_tokens(n: int, seed: int) -> np.ndarray:
    """Every token distinct, so a window is identified by its first token."""
    return np.random.default_rng(seed).permutation(n).astype(np.uint32)


# ------------------------------------------------------------------------------------------------- tokenizer


def test_byte_tokenizer_round_trip():
    tok = build_tokenizer(DataSpec())
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 259
    assert (tok.eos_id, tok.bos_id, tok.pad_id) == (256, 257, 258)
    rng = np.random.default_rng(0)
    noise = "".join(chr(c) for c in rng.integers(32, 0x2FFF, 200))
    text = "def f(x):\n    return x ** 2  # ünïcødé ✓ 数据 " + noise
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    arr = tok.encode_to_array(text)
    assert arr.dtype == np.uint16 and arr.tolist() == ids
    assert tok.decode(ids) == text
    assert tok.decode([tok.bos_id] + ids + [tok.eos_id, tok.pad_id]) == text  # specials are dropped


def test_hf_tokenizer_without_package_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    # the path is checked first: a typo is named as a typo, not as a missing package
    with pytest.raises(ConfigError, match=r"data\.tokenizer: .*tokenizer\.json' is not a file"):
        HFTokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"pip install 'moestack\[hf\]'"):
        HFTokenizer(tmp_path / "tokenizer.json")
    with pytest.raises(ConfigError, match="tokenizers"):
        build_tokenizer(DataSpec(tokenizer=str(tmp_path / "tokenizer.json")))


class _FakeHFTokenizer:
    """Stands in for tokenizers.Tokenizer (not installed in CI): whitespace words from a JSON vocab."""

    def __init__(self, vocab: dict[str, int]):
        self.vocab = vocab
        self.inverse = {i: w for w, i in vocab.items()}

    @classmethod
    def from_file(cls, path: str):
        return cls(json.loads(open(path).read()))

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return len(self.vocab)

    def token_to_id(self, name: str):
        return self.vocab.get(name)

    def encode(self, text: str, add_special_tokens: bool = True):
        return types.SimpleNamespace(ids=[self.vocab[w] for w in text.split()])

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(self.inverse[i] for i in ids if not self.inverse[i].startswith("<"))


@pytest.mark.parametrize("vocab_size", [1000, 70_000])
def test_hf_tokenizer_wrapper(tmp_path, monkeypatch, vocab_size):
    monkeypatch.setitem(sys.modules, "tokenizers", types.SimpleNamespace(Tokenizer=_FakeHFTokenizer))
    rng = np.random.default_rng(vocab_size)
    ids = rng.permutation(vocab_size)
    vocab = {f"w{i}": int(ids[i]) for i in range(vocab_size - 2)}
    vocab |= {"</s>": int(ids[-2]), "<s>": int(ids[-1])}
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(vocab))
    tok = build_tokenizer(DataSpec(tokenizer=str(path)))
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == vocab_size
    assert (tok.eos_id, tok.bos_id, tok.pad_id) == (int(ids[-2]), int(ids[-1]), None)
    words = [f"w{i}" for i in rng.integers(0, vocab_size - 2, 50)]
    arr = tok.encode_to_array(" ".join(words))
    assert arr.dtype == (np.uint16 if vocab_size <= 65536 else np.uint32)
    assert arr.tolist() == [vocab[w] for w in words] == tok.encode(" ".join(words))
    assert tok.decode(arr.tolist() + [tok.eos_id]) == " ".join(words)
    (tmp_path / "doc.txt").write_text(" ".join(words))
    tokens = load_tokens(DataSpec(source="text", paths=[str(tmp_path / "doc.txt")], tokenizer=str(path)), tok,
                         vocab_size=vocab_size)
    assert np.asarray(tokens).tolist() == arr.tolist() + [tok.eos_id]
    del vocab["</s>"]
    path.write_text(json.dumps(vocab))
    with pytest.raises(ValueError, match="no end-of-document token found"):
        HFTokenizer(path)


# ------------------------------------------------------------------------------------------------- sources


def test_builtin_corpus_offline_deterministic(tmp_path, monkeypatch):
    tok = ByteTokenizer()
    files = builtin_corpus_files()
    sizes = [f.stat().st_size for f in files]
    assert sum(sizes) >= 8_000_000 > sum(sizes[:-1])  # whole files, capped at ~8 MB
    assert files == builtin_corpus_files()
    first = load_tokens(DataSpec(), tok, vocab_size=259)
    cached = list((tmp_path / "cache").glob("builtin-*.npy"))
    assert len(cached) == 1
    again = load_tokens(DataSpec(), tok, vocab_size=259)  # from the cache
    monkeypatch.setenv("MOESTACK_CACHE", str(tmp_path / "cache2"))
    rebuilt = load_tokens(DataSpec(), tok, vocab_size=259)  # from scratch
    assert np.array_equal(first, again) and np.array_equal(first, rebuilt)
    # documents are whole files joined by eos
    assert int((np.asarray(first) == tok.eos_id).sum()) == len(files)
    n0 = sizes[0]
    assert bytes(np.asarray(first[:n0]).astype(np.uint8)) == files[0].read_bytes()
    assert first[n0] == tok.eos_id


def test_text_files_and_directories(tmp_path):
    tok = ByteTokenizer()
    d = tmp_path / "docs"
    (d / "sub").mkdir(parents=True)
    texts = {"b.txt": "second document\n", "a.txt": "first ✓ document", "sub/c.txt": "third"}
    for name, text in texts.items():
        (d / name).write_text(text)
    (d / "ignored.md").write_text("not a .txt file")
    tokens = load_tokens(DataSpec(source="text", paths=[str(d)]), tok, vocab_size=300)
    want = []
    for name in ("a.txt", "b.txt", "sub/c.txt"):  # sorted paths
        want += tok.encode(texts[name]) + [tok.eos_id]
    assert np.asarray(tokens).tolist() == want


def test_jsonl_field_and_errors(tmp_path):
    tok = ByteTokenizer()
    p = tmp_path / "data.jsonl"
    p.write_text(json.dumps({"body": "hello", "id": 1}) + "\n\n" + json.dumps({"body": "world ✓"}) + "\n")
    tokens = load_tokens(DataSpec(source="jsonl", paths=[str(p)], jsonl_field="body"), tok, vocab_size=259)
    assert np.asarray(tokens).tolist() == tok.encode("hello") + [256] + tok.encode("world ✓") + [256]

    with pytest.raises(ValueError, match=r"data\.jsonl:1: no field 'text' \(found: body, id\); set data.jsonl_field"):
        load_tokens(DataSpec(source="jsonl", paths=[str(p)]), tok, vocab_size=259)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": oops}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not valid JSON"):
        load_tokens(DataSpec(source="jsonl", paths=[str(bad)]), tok, vocab_size=259)


def test_bin_memmap_single_and_sharded(tmp_path):
    rng = np.random.default_rng(1)
    a = rng.integers(0, 1000, 5000).astype(np.uint16)
    b = rng.integers(0, 1000, 3000).astype(np.uint16)
    a.tofile(tmp_path / "a.bin")
    b.tofile(tmp_path / "b.bin")
    one = load_tokens(DataSpec(source="bin", paths=[str(tmp_path / "a.bin")]), ByteTokenizer(), vocab_size=1000)
    assert isinstance(one, np.memmap) and np.array_equal(one, a)
    both = load_tokens(DataSpec(source="bin", paths=[str(tmp_path)]), ByteTokenizer(), vocab_size=1000)
    assert isinstance(both, ConcatTokens) and len(both) == 8000
    assert np.array_equal(both[:], np.concatenate([a, b]))
    c32 = rng.integers(0, 70000, 100).astype(np.uint32)
    c32.tofile(tmp_path / "c.bin")
    got = load_tokens(DataSpec(source="bin", paths=[str(tmp_path / "c.bin")], bin_dtype="uint32"), ByteTokenizer(),
                      vocab_size=70000)
    assert np.array_equal(got, c32)


def test_concat_tokens_matches_concatenation():
    rng = np.random.default_rng(2)
    parts = [rng.integers(0, 500, n).astype(np.uint16) for n in (7, 1, 30, 12)]
    ref = np.concatenate(parts)
    cat = ConcatTokens(parts)
    for _ in range(200):
        i, j = sorted(rng.integers(0, len(ref) + 1, 2).tolist())
        assert np.array_equal(cat[i:j], ref[i:j])
        view = cat.view(i, j)
        assert len(view) == j - i and np.array_equal(np.asarray(view), ref[i:j])
        if j - i > 2:
            k, m = sorted(rng.integers(0, j - i + 1, 2).tolist())
            assert np.array_equal(np.asarray(view[k:m]), ref[i:j][k:m])
    assert cat[len(ref) - 1] == ref[-1] and cat[-1] == ref[-1] and cat[8] == ref[8]


def test_bad_inputs_raise_one_line_errors(tmp_path):
    tok = ByteTokenizer()
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match=r"data\.paths: '.*nope' does not exist"):
        load_tokens(DataSpec(source="text", paths=[str(missing)]), tok, vocab_size=259)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "e.txt").write_text("")
    with pytest.raises(ValueError, match="no text found"):
        load_tokens(DataSpec(source="text", paths=[str(tmp_path / "empty")]), tok, vocab_size=259)
    (tmp_path / "nodir").mkdir()
    with pytest.raises(ValueError, match=r"has no \.txt files"):
        load_tokens(DataSpec(source="text", paths=[str(tmp_path / "nodir")]), tok, vocab_size=259)
    ids = np.random.default_rng(3).integers(0, 500, 1000).astype(np.uint16)
    ids[617] = 900
    ids.tofile(tmp_path / "big.bin")
    with pytest.raises(ValueError, match=r"big\.bin: token id 900 at position 617 >= model vocab_size 800"):
        load_tokens(DataSpec(source="bin", paths=[str(tmp_path / "big.bin")]), tok, vocab_size=800)
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(ValueError, match=r"odd\.bin: 3 bytes is not a multiple of 2"):
        load_tokens(DataSpec(source="bin", paths=[str(tmp_path / "odd.bin")]), tok, vocab_size=800)
    (tmp_path / "t.txt").write_text("some text")
    with pytest.raises(ValueError, match="vocab_size 200"):  # eos=256 does not fit a 200-token model
        load_tokens(DataSpec(source="text", paths=[str(tmp_path / "t.txt")]), tok, vocab_size=200)
    with pytest.raises(ValueError, match="training tokens, but seq_len=64"):
        build_data(DataSpec(source="text", paths=[str(tmp_path / "t.txt")], eval_fraction=0), tok, 64, 2, 0, 259)
    (tmp_path / "u.txt").write_text("x" * 2000)
    with pytest.raises(ValueError, match=r"eval split \(data.eval_fraction=0.02\) has 40 tokens"):
        build_data(DataSpec(source="text", paths=[str(tmp_path / "u.txt")]), tok, 64, 2, 0, 259)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.txt: not UTF-8"):
        load_tokens(DataSpec(source="text", paths=[str(tmp_path / "latin1.txt")]), tok, vocab_size=259)


# ------------------------------------------------------------------------------------------------- batching


def test_split_and_build_data(tmp_path):
    tokens = _unique_tokens(10_000, seed=4)
    tokens.astype(np.uint32).tofile(tmp_path / "t.bin")
    spec = DataSpec(source="bin", paths=[str(tmp_path / "t.bin")], bin_dtype="uint32", eval_fraction=0.1)
    sampler, eval_tokens = build_data(spec, ByteTokenizer(), seq_len=16, batch_size=4, seed=0, vocab_size=10_000)
    assert np.array_equal(eval_tokens, tokens[9000:])
    assert len(sampler.tokens) == 9000 and np.array_equal(sampler.tokens, tokens[:9000])
    stream = TokenStream(tokens, 0.0)
    assert len(stream.eval) == 0 and len(stream.train) == 10_000


def test_sampler_windows_targets_and_determinism():
    tokens = _unique_tokens(4001, seed=5)
    S, B = 20, 6
    s1 = BatchSampler(tokens, S, B, seed=11)
    s2 = BatchSampler(tokens, S, B, seed=11)
    s3 = BatchSampler(tokens, S, B, seed=12)
    where = {int(t): i for i, t in enumerate(tokens)}
    differs = False
    for _ in range(5):
        x, y = s1.next_batch()
        x2, y2 = s2.next_batch()
        x3, _ = s3.next_batch()
        assert x.dtype == torch.int64 and x.shape == (B, S) and y.shape == (B, S)
        assert torch.equal(x, x2) and torch.equal(y, y2)
        differs |= not torch.equal(x, x3)
        for row_x, row_y in zip(x.tolist(), y.tolist()):
            start = where[row_x[0]]
            assert start % S == 0  # non-overlapping windows
            assert row_x == tokens[start : start + S].tolist()
            assert row_y == tokens[start + 1 : start + S + 1].tolist()
    assert differs


def test_rank_shards_are_disjoint_and_cover_each_epoch():
    tokens = _unique_tokens(3 * 7 * 10 * 4 + 1 + 9, seed=6)  # 213 windows of S=4 (+ spare)
    S, B, world = 4, 7, 3
    samplers = [BatchSampler(tokens, S, B, seed=3, rank=r, world_size=world) for r in range(world)]
    assert samplers[0].num_windows == 212 and samplers[0].batches_per_epoch == 10
    for epoch in range(2):
        seen = []
        for s in samplers:
            mine = [int(v) for _ in range(s.batches_per_epoch) for v in s.next_batch()[0][:, 0]]
            seen.append(set(mine))
            assert len(mine) == len(set(mine))  # no repeats within a rank's epoch
        for a in range(world):
            for b in range(a + 1, world):
                assert not seen[a] & seen[b]
        assert sum(len(x) for x in seen) == world * 10 * B
    assert all(s.epoch == 1 for s in samplers)


@pytest.mark.parametrize("consumed", [0, 3, 9, 10, 23])
def test_sampler_resume_yields_identical_batches(consumed):
    tokens = _unique_tokens(2000, seed=7)
    S, B = 8, 12  # 249 windows, 124 per rank -> 10 batches per epoch: resume points span epoch boundaries
    ref = BatchSampler(tokens, S, B, seed=5, rank=1, world_size=2)
    for _ in range(consumed):
        ref.next_batch()
    state = json.loads(json.dumps(ref.state_dict()))  # survives JSON (it goes into meta.json)
    resumed = BatchSampler(tokens, S, B, seed=5, rank=1, world_size=2)
    resumed.load_state_dict(state)
    for _ in range(15):
        x_ref, y_ref = ref.next_batch()
        x_res, y_res = resumed.next_batch()
        assert torch.equal(x_ref, x_res) and torch.equal(y_ref, y_res)


def test_sampler_refuses_mismatched_state():
    tokens = _unique_tokens(1000, seed=8)
    state = BatchSampler(tokens, 8, 4, seed=1).state_dict()
    with pytest.raises(ValueError, match="saved with batch_size=4 but this run has 5"):
        BatchSampler(tokens, 8, 5, seed=1).load_state_dict(state)


def test_eval_batches_fixed_and_spread():
    tokens = _unique_tokens(2001, seed=9)
    S, B = 10, 4
    a = eval_batches(tokens, S, B, num_batches=3)
    b = eval_batches(tokens, S, B, num_batches=3)
    assert len(a) == 3
    starts = []
    where = {int(t): i for i, t in enumerate(tokens)}
    for (x, y), (x2, y2) in zip(a, b):
        assert torch.equal(x, x2) and torch.equal(y, y2) and x.shape == (B, S)
        assert torch.equal(x[:, 1:], y[:, :-1])
        starts += [where[int(v)] for v in x[:, 0]]
    assert len(set(starts)) == 12 and all(s % S == 0 for s in starts)
    assert max(starts) - min(starts) > 1500  # spread over the data, not just its head
    assert len(eval_batches(tokens[:101], S, B, num_batches=5)) == 2  # only 10 windows: 2 full batches
    with pytest.raises(ValueError, match="fewer than batch_size=4 windows"):
        eval_batches(tokens[:35], S, B, num_batches=1)
