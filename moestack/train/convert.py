"""Weights in and out: Hugging Face safetensors (sharded, with model.safetensors.index.json) <-> moestack.

moestack side: a plain state dict (`hf_to_state_dict`, `load_hf_weights`, `export_hf(state_dict)`) or a DCP
checkpoint as moestack/train/checkpoint.py writes it (`hf_to_checkpoint`, `export_hf(CheckpointSource(path))`).
Names come from per-family maps (moestack/train/hf_names.py); per-expert HF tensors are stacked into moestack's
fused expert tensors and split back on export.

Streaming. Import reads one shard at a time and one tensor at a time (safetensors `safe_open`); a fused expert
tensor is filled slice by slice as its experts arrive, from however many shards they span, and handed on when
complete. Peak memory beyond the output is one tensor plus the fused expert tensors still being filled (normally
one layer's). `hf_to_checkpoint` writes into file-backed tensors (a spool next to the output) before the DCP save,
so the model is never held in RAM. Export loads, per output shard, only the moestack tensors that shard needs
(from a DCP checkpoint: a partial DCP load), keeping a fused expert tensor until its last expert is written.

Checks, before any tensor data is read (safetensors headers only): every HF tensor the model needs is present,
nothing unexpected is there, every shape matches; failures raise ConvertError listing every offending name (expert
names compacted as `...experts.{3,7-9}.w1.weight`), never a dropped expert. `skip` (regexes) leaves named HF
tensors out on purpose (e.g. MTP layers); the family's untrained parts (Kimi K3's vision tower: vision_tower.*,
mm_projector.*) are skipped always; both are counted in the result (`describe_skipped`: one line).

Quantised checkpoints (the released Kimi K3). compressed-tensors stores a quantised Linear `X` as `X.weight_packed`
+ `X.weight_scale` (+ optionally `X.weight_shape`), its format in config.json's quantization_config (top level, or
text_config's for K3). `mxfp4-pack-quantized` (group 32, uint8 E8M0 scales; moestack/ops/mxfp4.py) is read: the
parts of `X` are grouped into one logical tensor `X.weight` (dtype "MXFP4" in `HFLayout.logical()`), checked
against the model like any other, and dequantised on import (exact in bf16, the default `mxfp4_dtype`) as soon as
its parts have arrived, shard by shard. Export writes the recorded layout's packed tensors packed again
(`quantize_mxfp4`: values that came from MXFP4 come back identical), and without a recorded layout packs the
routed experts when the model's config.json says mxfp4 (as the release: every other tensor bf16 / fp32).
`dequantize=True` writes every tensor unpacked and drops quantization_config from config.json. Other formats
are refused by name.

Round trip HF -> moestack -> HF is bit-exact (same names, bytes, dtypes, shard files): the import records the HF
layout (files, names per file, dtypes, metadata, config.json) in the checkpoint's `extra`, and export reproduces it.
Without a recorded layout export writes `dtype` (default bf16; the family's fp32 tensors stay fp32) in shards of
at most `max_shard_bytes`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moestack.config.model_spec import ModelSpec
from moestack.ops.mxfp4 import GROUP as MXFP4_GROUP
from moestack.ops.mxfp4 import MXFP4Error, check_packed_shapes, dequantize_mxfp4, quantize_mxfp4
from moestack.train.hf_names import Direct, ExpertStack, NameMap, build_name_map

INDEX = "model.safetensors.index.json"
SPOOL = ".convert_spool"
_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I8": torch.int8, "U8": torch.uint8,
    "I16": torch.int16, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool,
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
_EXPERT_RE = re.compile(r"^(.*\.experts\.)(\d+)(\..*)$")
MXFP4_FORMAT = "mxfp4-pack-quantized"
MXFP4 = "MXFP4"  # the logical dtype of a packed group


class ConvertError(ValueError):
    """A checkpoint that does not match the model. The message is one line; the lists hold every offending name."""

    def __init__(self, message: str, missing: Sequence[str] = (), unexpected: Sequence[str] = (),
                 mismatched: Sequence[str] = ()):
        super().__init__(message)
        self.missing, self.unexpected, self.mismatched = list(missing), list(unexpected), list(mismatched)


def compact_names(names: Sequence[str], limit: int | None = None) -> str:
    """Comma-separated names with expert indices folded: a.experts.{0-3,7}.w1.weight; at most `limit` entries,
    then "and N more"."""
    groups: dict[tuple[str, str], list[int]] = {}
    order: list[tuple[str, str] | str] = []
    for name in names:
        m = _EXPERT_RE.match(name)
        if m is None:
            order.append(name)
            continue
        key = (m.group(1), m.group(3))
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(int(m.group(2)))
    out = []
    for item in order:
        if isinstance(item, str):
            out.append(item)
            continue
        ids = sorted(set(groups[item]))
        spans, start = [], ids[0]
        for prev, cur in zip(ids, ids[1:] + [None]):
            if cur != prev + 1:
                spans.append(str(start) if start == prev else f"{start}-{prev}")
                start = cur
        ix = spans[0] if len(spans) == 1 and "-" not in spans[0] else "{" + ",".join(spans) + "}"
        out.append(f"{item[0]}{ix}{item[1]}")
    return _capped(out, limit, ", ")


def _capped(items: Sequence[str], limit: int | None, sep: str) -> str:
    if limit is None or len(items) <= limit:
        return sep.join(items)
    return sep.join(items[:limit]) + f"{sep}and {len(items) - limit} more"


_SHOWN = 6  # names per kind of problem in a one-line message (the ConvertError lists hold them all)


# ---------------------------------------------------------------------------------------------- HF layout


@dataclass
class HFLayout:
    """Where every HF tensor lives: shard files in order with their tensor names, each tensor's dtype and shape,
    the safetensors metadata of each file, the index.json metadata, and the config.json text if there was one."""

    files: list[tuple[str, list[str]]]
    dtypes: dict[str, str]  # safetensors dtype names ("BF16", "F32", ...)
    shapes: dict[str, tuple[int, ...]]
    file_metadata: dict[str, dict[str, str] | None] = field(default_factory=dict)
    index: dict[str, Any] | None = None  # index.json without its weight_map; None: one file, no index
    config: str | None = None
    # logical name ("X.weight") -> its packed parts: {"format": "mxfp4", "packed": .., "scale": .., ["shape": ..]}
    packed: dict[str, dict[str, str]] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({
            "files": [[f, names] for f, names in self.files], "dtypes": self.dtypes,
            "shapes": {k: list(v) for k, v in self.shapes.items()}, "file_metadata": self.file_metadata,
            "index": self.index, "config": self.config, "packed": self.packed,
        })

    @classmethod
    def from_json(cls, text: str) -> HFLayout:
        d = json.loads(text)
        return cls([(f, list(n)) for f, n in d["files"]], d["dtypes"], {k: tuple(v) for k, v in d["shapes"].items()},
                   d["file_metadata"], d["index"], d["config"], d.get("packed", {}))

    def part_of(self) -> dict[str, str]:
        """Stored name of every packed part -> its logical name."""
        return {entry[k]: logical for logical, entry in self.packed.items() for k in _PARTS if k in entry}

    def logical(self) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
        """(shapes, dtypes) with each packed group as one tensor `X.weight` of its unpacked shape, dtype MXFP4."""
        parts = self.part_of()
        shapes = {n: s for n, s in self.shapes.items() if n not in parts}
        dtypes = {n: d for n, d in self.dtypes.items() if n not in parts}
        for logical, entry in self.packed.items():
            p = self.shapes[entry["packed"]]
            shapes[logical] = (*p[:-1], 2 * p[-1])
            dtypes[logical] = MXFP4
        return shapes, dtypes


_PARTS = ("packed", "scale", "shape")


def quantization_config(config_text: str | None) -> dict[str, Any] | None:
    """quantization_config of a config.json text: top level, or text_config's (multimodal wrappers like K3)."""
    if not config_text:
        return None
    try:
        cfg = json.loads(config_text)
    except ValueError:
        return None
    if not isinstance(cfg, dict):
        return None
    q = cfg.get("quantization_config") or (cfg.get("text_config") or {}).get("quantization_config")
    return q if isinstance(q, dict) else None


def mxfp4_groups(q: dict[str, Any] | None, where: str) -> bool:
    """True when `q` (a quantization_config) is compressed-tensors mxfp4-pack-quantized with 4-bit float weights
    in groups of 32; False without one; ConvertError naming the format for any other."""
    if not q:
        return False
    groups = list((q.get("config_groups") or {}).values())
    formats = sorted({str(f) for f in [q.get("format")] + [g.get("format") for g in groups] if f})
    if q.get("quant_method") != "compressed-tensors" or formats != [MXFP4_FORMAT]:
        raise ConvertError(f"{where}: quantization_config {q.get('quant_method')} / format {', '.join(formats)}: "
                           f"moestack reads compressed-tensors {MXFP4_FORMAT} only; dequantise the checkpoint first")
    for g in groups:
        w = g.get("weights") or {}
        if (w.get("num_bits"), w.get("type"), w.get("group_size")) != (4, "float", MXFP4_GROUP):
            raise ConvertError(f"{where}: quantization_config weights {w.get('num_bits')}-bit {w.get('type')} group "
                               f"{w.get('group_size')}: MXFP4 is 4-bit float in groups of {MXFP4_GROUP}")
    return True


def _group_packed(layout: HFLayout, root: Path) -> None:
    """Fill layout.packed from the `*.weight_packed` names (format from config.json). Raises ConvertError for
    packed tensors without a readable quantization_config, missing scales, wrong dtypes or inconsistent shapes."""
    packed = sorted(n for n in layout.shapes if n.endswith(".weight_packed"))
    if not packed:
        return
    where = f"HF checkpoint {root}"
    q = quantization_config(layout.config)
    if q is None:
        raise ConvertError(f"{where}: {len(packed)} compressed-tensors packed tensor(s) ({compact_names(packed[:2])}"
                           f"{', ...' if len(packed) > 2 else ''}) but config.json has no quantization_config: "
                           "their format is unknown")
    mxfp4_groups(q, where)
    bad = []
    for p in packed:
        logical = p.removesuffix("_packed")
        entry = {"format": "mxfp4", "packed": p, "scale": logical + "_scale"}
        if logical + "_shape" in layout.shapes:
            entry["shape"] = logical + "_shape"
        if entry["scale"] not in layout.shapes:
            bad.append(f"{p}: no {entry['scale']}")
            continue
        if layout.dtypes[p] != "U8" or layout.dtypes[entry["scale"]] != "U8":
            bad.append(f"{p}: packed / scale dtypes {layout.dtypes[p]} / {layout.dtypes[entry['scale']]}, "
                       "expected U8 / U8")
            continue
        try:
            check_packed_shapes(layout.shapes[p], layout.shapes[entry["scale"]], where=logical)
        except MXFP4Error as err:
            bad.append(str(err))
            continue
        layout.packed[logical] = entry
    if bad:
        raise ConvertError(f"{where}: {len(bad)} bad MXFP4 tensor group(s): " + "; ".join(bad))


def _safe_open(path: Path):
    from safetensors import safe_open

    return safe_open(str(path), framework="pt")


def _open_header(path: Path):
    try:
        return _safe_open(path)
    except Exception as err:  # safetensors raises its own error type for a bad header
        raise ConvertError(f"{path}: not a readable safetensors file ({err})") from None


def read_hf_layout(hf_dir: str | Path) -> HFLayout:
    """Read index.json (or the lone *.safetensors files) and every shard's header; no tensor data is read.

    Raises ConvertError naming a missing shard file, a tensor the index places in a file that lacks it, or
    tensors a shard holds that the index does not list.
    """
    root = Path(hf_dir)
    if not root.is_dir():
        raise ConvertError(f"{root}: not a directory")
    index_path = root / INDEX
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text())
            weight_map: dict[str, str] = index["weight_map"]
        except (ValueError, KeyError) as err:
            raise ConvertError(f"{index_path}: not a safetensors index ({type(err).__name__}: {err})") from None
        index_fields = {k: v for k, v in index.items() if k != "weight_map"}
        names_by_file: dict[str, list[str]] = {}
        for name, f in weight_map.items():
            names_by_file.setdefault(f, []).append(name)
        missing_files = sorted(f for f in names_by_file if not (root / f).is_file())
        if missing_files:
            raise ConvertError(f"{index_path}: lists shard file(s) that do not exist: {', '.join(missing_files)}")
        files = sorted(names_by_file)
    else:
        files = sorted(p.name for p in root.glob("*.safetensors"))
        if not files:
            raise ConvertError(f"{root}: no {INDEX} and no *.safetensors files")
        index_fields, names_by_file = None, {}
    layout = HFLayout([], {}, {}, {}, index_fields)
    for f in files:
        with _open_header(root / f) as st:
            held = list(st.keys())
            layout.file_metadata[f] = st.metadata()
            listed = names_by_file[f] if index_fields is not None else held
            absent = sorted(set(listed) - set(held))
            if absent:
                raise ConvertError(f"{index_path}: places tensors in {f} that it lacks: {compact_names(absent)}")
            unlisted = sorted(set(held) - set(listed))
            if unlisted:
                raise ConvertError(f"{root / f}: holds tensors {INDEX} does not list: {compact_names(unlisted)}")
            for name in sorted(listed):
                sl = st.get_slice(name)
                layout.dtypes[name] = sl.get_dtype()
                layout.shapes[name] = tuple(sl.get_shape())
            layout.files.append((f, sorted(listed)))
    dup = _duplicates(n for _, names in layout.files for n in names)
    if dup:
        raise ConvertError(f"{root}: tensors stored in more than one shard: {compact_names(dup)}")
    if (root / "config.json").is_file():
        layout.config = (root / "config.json").read_text()
    _group_packed(layout, root)
    return layout


def _duplicates(names) -> list[str]:
    seen, dup = set(), []
    for n in names:
        if n in seen:
            dup.append(n)
        seen.add(n)
    return dup


def check_layout(layout: HFLayout, nmap: NameMap, skip: Sequence[str] = (), where: str = "HF checkpoint") -> list[str]:
    """Compare the checkpoint's names and shapes with what the model needs; raise ConvertError listing every
    missing, unexpected and mismatched tensor. Returns the names skipped on purpose (`skip` regexes)."""
    patterns = [re.compile(p) for p in skip]
    shapes, dtypes = layout.logical()
    skipped = [n for n in shapes if n.startswith(nmap.skip_prefixes or ()) or any(p.search(n) for p in patterns)]
    have = {n: s for n, s in shapes.items() if n not in set(skipped)}
    want = nmap.hf_shapes()
    padded = {rule.hf: rule.ms_shape[0] for rule in nmap.rules if isinstance(rule, Direct) and rule.pad}
    missing = [n for n in want if n not in have]
    unexpected = [n for n in have if n not in want]
    mismatched = [f"{n}: checkpoint {list(have[n])} vs model {list(s)}" for n, s in want.items()
                  if n in have and tuple(have[n]) != tuple(s)
                  and not (n in padded and len(have[n]) == 1 and have[n][0] >= padded[n])]
    bad_dtype = [f"{n} ({dtypes[n]})" for n in want if n in have and dtypes[n] != MXFP4
                 and not _DTYPES.get(dtypes[n], torch.int8).is_floating_point]
    mixed = []
    for rule in nmap.rules:
        if isinstance(rule, ExpertStack):
            kinds = {dtypes.get(n) for parts in rule.hf for n in parts if n in have}
            if len(kinds) > 1:
                mixed.append(f"{rule.ms} ({'/'.join(sorted(kinds))})")
    problems = []
    for label, items in (("missing", missing), ("unexpected", unexpected)):
        if items:
            problems.append(f"{len(items)} {label}: {compact_names(items, _SHOWN)}")
    if mismatched:
        problems.append(f"{len(mismatched)} shape mismatch: " + _capped(mismatched, _SHOWN, "; "))
    if bad_dtype:
        problems.append(f"{len(bad_dtype)} not floating point (quantized?): " + ", ".join(bad_dtype))
    if mixed:
        problems.append("experts of one fused tensor in different dtypes: " + ", ".join(mixed))
    if problems:
        raise ConvertError(f"{where} does not match {nmap.model} (family {nmap.family}): " + "; ".join(problems),
                           missing, unexpected, mismatched)
    return skipped


def describe_skipped(skipped: Sequence[str], nmap: NameMap | None = None) -> str:
    """One line: how many HF tensors were left out, by the family's untrained parts' prefixes and the rest."""
    prefixes = nmap.skip_prefixes if nmap is not None else ()
    counts: dict[str, int] = {}
    for n in skipped:
        key = next((p + "*" for p in prefixes if n.startswith(p)), "--skip")
        counts[key] = counts.get(key, 0) + 1
    parts = ", ".join(f"{k} ({v})" for k, v in counts.items())
    why = " (vision tower: moestack trains the text model)" if any(k != "--skip" for k in counts) else ""
    return f"skipped {len(skipped)} HF tensor(s): {parts}{why}"


# ---------------------------------------------------------------------------------------------- import


def iter_hf_tensors(
    hf_dir: str | Path, nmap: NameMap, layout: HFLayout | None = None, skip: Sequence[str] = (),
    mxfp4_dtype: torch.dtype = torch.bfloat16,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (moestack name, tensor in the HF dtype; MXFP4 groups dequantised to mxfp4_dtype) for every rule of
    `nmap`, reading one shard at a time.

    Direct tensors are yielded as read; a packed tensor once its parts have arrived; a fused expert tensor once its
    last expert slice has arrived. Raises ConvertError (after the header check, before any data is read) on
    mismatches, when it meets bad packed data or non-zero padding, and at the end for any fused tensor whose experts
    never all arrived.
    """
    root = Path(hf_dir)
    layout = layout or read_hf_layout(root)
    skipped = set(check_layout(layout, nmap, skip, f"HF checkpoint {root}"))
    part_of = layout.part_of()
    held: dict[str, dict[str, torch.Tensor]] = {}  # packed groups whose parts are still arriving
    pending: dict[str, tuple[ExpertStack, torch.Tensor, set[tuple[int, int]]]] = {}
    for f, names in layout.files:
        with _safe_open(root / f) as st:
            for name in names:
                logical = part_of.get(name, name)
                if logical in skipped:
                    continue
                if name in part_of:
                    parts = held.setdefault(logical, {})
                    parts[name] = st.get_tensor(name)
                    entry = layout.packed[logical]
                    if any(entry[k] not in parts for k in _PARTS if k in entry):
                        continue
                    t = _dequantized(logical, entry, held.pop(logical), mxfp4_dtype, root)
                else:
                    t = st.get_tensor(name)
                name = logical
                rule, slot = nmap.by_hf[name]
                if isinstance(rule, Direct):
                    yield rule.ms, _unpadded(rule, t, root) if rule.pad else t.reshape(rule.ms_shape)
                    continue
                if rule.ms not in pending:
                    todo = {(j, p) for j in range(len(rule.hf)) for p in range(len(rule.hf[0]))}
                    pending[rule.ms] = (rule, torch.empty(rule.ms_shape, dtype=t.dtype), todo)
                _, buf, todo = pending[rule.ms]
                j, rows = rule.slot(*slot)
                buf[j, rows].copy_(t)
                todo.discard(slot)
                if not todo:
                    del pending[rule.ms]
                    yield rule.ms, buf
    if pending or held:  # only if the files changed after the header check
        lost = [rule.hf[j][p] for rule, _, todo in pending.values() for j, p in sorted(todo)] + sorted(held)
        raise ConvertError(f"HF checkpoint {root}: experts never arrived: {compact_names(lost)}", missing=lost)


def _dequantized(logical: str, entry: dict[str, str], parts: dict[str, torch.Tensor], dtype: torch.dtype,
                 root: Path) -> torch.Tensor:
    packed, scale = parts[entry["packed"]], parts[entry["scale"]]
    try:
        t = dequantize_mxfp4(packed, scale, dtype, where=f"HF checkpoint {root}: {logical}")
    except MXFP4Error as err:
        raise ConvertError(str(err)) from None
    if "shape" in entry:
        stored = [int(v) for v in parts[entry["shape"]].reshape(-1).tolist()]
        if stored != list(t.shape):
            raise ConvertError(f"HF checkpoint {root}: {entry['shape']} says {stored}, the packed data holds "
                               f"{list(t.shape)}")
    return t


def _unpadded(rule: Direct, t: torch.Tensor, root: Path) -> torch.Tensor:
    """The first numel(ms) values of a zero-padded 1-D HF tensor; ConvertError if the padding is not zero."""
    n = rule.ms_shape[0]
    flat = t.reshape(-1)
    tail = flat[n:]
    if tail.numel() and bool((tail != 0).any()):
        raise ConvertError(f"HF checkpoint {root}: {rule.hf} has {flat.numel()} entries for {n} heads and its "
                           f"padding (entries {n}..{flat.numel() - 1}) is not zero (max |x| "
                           f"{float(tail.abs().max()):.3g}): not the layout moestack reads (per-head values, then "
                           "zeros)")
    return flat[:n].reshape(rule.ms_shape)


def hf_to_state_dict(hf_dir: str | Path, spec: ModelSpec, family: str | None = None,
                     skip: Sequence[str] = (), mxfp4_dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The moestack state dict of `spec` from an HF checkpoint, tensors in the checkpoint's dtypes (a tied LM head
    is the embedding tensor itself). For `model.load_state_dict(sd)`; `load_hf_weights` avoids holding both."""
    nmap = build_name_map(spec, family)
    sd = dict(iter_hf_tensors(hf_dir, nmap, skip=skip, mxfp4_dtype=mxfp4_dtype))
    for name, target in nmap.tied:
        sd[name] = sd[target]
    return sd


@dataclass
class LoadedHF:
    """What `load_hf_weights` read: tensors written, the HF layout and family (for a later export in the same
    layout), and the HF tensors skipped on purpose."""

    tensors: int
    layout: HFLayout
    family: str
    skipped: list[str]
    nmap: NameMap

    def __int__(self) -> int:
        return self.tensors


@torch.no_grad()
def load_hf_weights(model: nn.Module, hf_dir: str | Path, family: str | None = None,
                    skip: Sequence[str] = ()) -> LoadedHF:
    """Copy an HF checkpoint into `model` (a moestack Transformer) tensor by tensor, casting to each parameter's
    dtype (MXFP4 experts dequantised exactly). Peak extra memory: one tensor plus the fused experts in flight."""
    nmap = build_name_map(model.spec, family)
    layout = read_hf_layout(hf_dir)
    skipped = check_layout(layout, nmap, skip, f"HF checkpoint {hf_dir}")
    targets = model.state_dict()
    done = 0
    for name, t in iter_hf_tensors(hf_dir, nmap, layout, skip=skip, mxfp4_dtype=torch.float32):
        targets[name].copy_(t)
        done += 1
    from moestack.train.checkpoint import forget_fp8_weights

    forget_fp8_weights()
    return LoadedHF(done, layout_without(layout, skipped), nmap.family, skipped, nmap)


def hf_to_checkpoint(hf_dir: str | Path, out_root: str | Path, spec: ModelSpec, family: str | None = None,
                     skip: Sequence[str] = (), dtype: torch.dtype | None = None, step: int = 0,
                     trust_key: bytes | None = None) -> Path:
    """Convert an HF checkpoint into a moestack DCP checkpoint `out_root/step_{step:08d}` (atomic, verified, as
    checkpoint.save_checkpoint writes it; `load_checkpoint(path, model)` restores it). dtype: None keeps the HF
    dtypes (bit-exact), e.g. torch.float32 stores what the trainer holds. The HF layout and config.json go into the
    checkpoint's extra, so `export_hf` reproduces the source. trust_key: sign it (moestack/train/safe_load.py).
    A failed conversion removes `out_root` again if it created it. Returns the checkpoint path."""
    from moestack.model.transformer import Transformer
    from moestack.train.checkpoint import save_checkpoint

    root, out_root = Path(hf_dir), Path(out_root)
    if out_root.exists() and any(p.name != SPOOL for p in out_root.iterdir()):
        raise ConvertError(f"{out_root}: not empty; convert into a new directory (keeps existing checkpoints safe)")
    nmap = build_name_map(spec, family)
    layout = read_hf_layout(root)
    skipped = check_layout(layout, nmap, skip, f"HF checkpoint {root}")
    spool = out_root / SPOOL
    created = not out_root.exists()
    shutil.rmtree(spool, ignore_errors=True)
    spool.mkdir(parents=True)
    ok = False
    try:
        sd: dict[str, torch.Tensor] = {}
        for i, (name, t) in enumerate(iter_hf_tensors(root, nmap, layout, skip)):
            sd[name] = _spooled(spool / f"{i:06d}.bin", t, dtype or t.dtype)
        for name, target in nmap.tied:
            sd[name] = sd[target]
        with torch.device("meta"):
            model = Transformer(spec)
        model.load_state_dict(sd, strict=True, assign=True)
        extra = {
            "converted_from": str(root), "family": nmap.family, "hf_layout": layout_without(layout, skipped).to_json(),
            "model_spec": json.dumps(spec.model_dump(mode="json")), "skipped": skipped, "step": step,
        }
        path = save_checkpoint(out_root, step, model, None, extra, keep=1, trust_key=trust_key)
        ok = True
        return path
    finally:
        shutil.rmtree(spool, ignore_errors=True)
        if not ok and created:
            shutil.rmtree(out_root, ignore_errors=True)


def _spooled(path: Path, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A copy of t in a file-backed tensor (memory the kernel can write back and drop)."""
    out = torch.from_file(str(path), shared=True, size=t.numel(), dtype=dtype).view(t.shape)
    out.copy_(t)
    return out


# ---------------------------------------------------------------------------------------------- export


class CheckpointSource:
    """Model tensors of a moestack DCP checkpoint, loaded on demand (a partial DCP load of just those names)."""

    def __init__(self, path: str | Path, trust_key: bytes | None = None):
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from moestack.train.checkpoint import decode_extra, verify_checkpoint
        from moestack.train.safe_load import read_dcp_metadata

        self.path = Path(path)
        self.meta = verify_checkpoint(self.path, trust_key)
        self.meta["extra"] = decode_extra(self.path, self.meta) if "extra" in self.meta else {}
        md = read_dcp_metadata(self.path).state_dict_metadata
        self.tensors = {k.removeprefix("model."): (tuple(v.size), v.properties.dtype) for k, v in md.items()
                        if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}

    @property
    def extra(self) -> dict[str, Any]:
        return self.meta.get("extra", {})

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: shape for n, (shape, _) in self.tensors.items()}

    def keys(self):
        return self.tensors.keys()

    def get(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        import torch.distributed.checkpoint as dcp

        absent = [n for n in names if n not in self.tensors]
        if absent:
            raise ConvertError(f"checkpoint {self.path}: has no tensor(s) {compact_names(absent)}", missing=absent)
        from moestack.train.safe_load import SafeFileSystemReader, SafeLoadPlanner

        state = {"model": {n: torch.empty(self.tensors[n][0], dtype=self.tensors[n][1]) for n in names}}
        with warnings.catch_warnings():  # DCP warns that a load without a process group is single-process
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
            dcp.load(state, storage_reader=SafeFileSystemReader(self.path), planner=SafeLoadPlanner(), no_dist=True)
        return state["model"]


class _DictSource:
    def __init__(self, sd: Mapping[str, torch.Tensor]):
        self.sd = sd

    def keys(self):
        return self.sd.keys()

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: tuple(t.shape) for n, t in self.sd.items()}

    def get(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        absent = [n for n in names if n not in self.sd]
        if absent:
            raise ConvertError(f"state dict has no tensor(s) {compact_names(absent)}", missing=absent)
        return {n: self.sd[n].detach() for n in names}


def default_layout(nmap: NameMap, dtype: torch.dtype = torch.bfloat16, max_shard_bytes: int = 5 * 2**30,
                   mxfp4_experts: bool = False) -> HFLayout:
    """Model-order layout in shards of at most max_shard_bytes (one tensor per shard at least), `dtype` for every
    tensor but the family's fp32 ones (fp32 where `dtype` is narrower), HF's file naming and metadata.
    mxfp4_experts: the routed experts as compressed-tensors MXFP4 parts (`X.weight_packed` U8 [R, C/2],
    `X.weight_scale` U8 [R, C/32]), as the released Kimi K3 stores them."""
    logical = nmap.hf_shapes()
    experts = {n for rule in nmap.rules if isinstance(rule, ExpertStack) for parts in rule.hf for n in parts}
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    packed: dict[str, dict[str, str]] = {}
    units: list[list[str]] = []  # tensors kept in one shard (a packed group's parts)
    for name, shape in logical.items():
        if mxfp4_experts and name in experts:
            if shape[-1] % MXFP4_GROUP:
                raise ConvertError(f"export: {name} has {shape[-1]} columns, not a multiple of the MXFP4 group "
                                   f"{MXFP4_GROUP}; export with --dequantize")
            p, sc = name + "_packed", name + "_scale"
            shapes[p], shapes[sc] = (*shape[:-1], shape[-1] // 2), (*shape[:-1], shape[-1] // MXFP4_GROUP)
            dtypes[p] = dtypes[sc] = "U8"
            packed[name] = {"format": "mxfp4", "packed": p, "scale": sc}
            units.append([p, sc])
            continue
        shapes[name] = shape
        # the family's fp32 tensors stay fp32 under a narrower export dtype, never narrower than a wider one (fp64)
        wide = nmap.keep_fp32(name) and dtype.itemsize < 4
        dtypes[name] = "F32" if wide else _DTYPE_NAMES[dtype]
        units.append([name])
    groups: list[list[str]] = [[]]
    size = 0
    for unit in units:
        nbytes = sum(_numel(shapes[n]) * _DTYPES[dtypes[n]].itemsize for n in unit)
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].extend(unit)
        size += nbytes
    n = len(groups)
    files = [(f"model-{i + 1:05d}-of-{n:05d}.safetensors", names) for i, names in enumerate(groups)]
    index = {"metadata": {"total_size": _total_bytes(shapes, dtypes)}}
    return HFLayout(files, dtypes, shapes, {f: {"format": "pt"} for f, _ in files}, index, packed=packed)


def unpacked_layout(layout: HFLayout, dtype: torch.dtype = torch.bfloat16) -> HFLayout:
    """`layout` with every packed group written as one `dtype` tensor in the place of its parts, and
    quantization_config dropped from the config text."""
    if not layout.packed:
        return layout
    part_of = layout.part_of()
    shapes, _ = layout.logical()
    files = []
    dtypes = {k: v for k, v in layout.dtypes.items() if k not in part_of}
    for f, names in layout.files:
        out = []
        for name in names:
            if name not in part_of:
                out.append(name)
            elif name == layout.packed[part_of[name]]["packed"]:
                out.append(part_of[name])
                dtypes[part_of[name]] = _DTYPE_NAMES[dtype]
        files.append((f, sorted(out)))
    index = layout.index
    if index is not None and "total_size" in index.get("metadata", {}):
        index = {**index, "metadata": {**index["metadata"], "total_size": _total_bytes(shapes, dtypes)}}
    return replace(layout, files=files, dtypes=dtypes, shapes=shapes, index=index, packed={},
                   config=_without_quantization(layout.config))


def layout_without(layout: HFLayout, logical_names: Sequence[str]) -> HFLayout:
    """`layout` less the named (logical) tensors, e.g. the skipped vision tower: what an export writes back."""
    if not logical_names:
        return layout
    drop = set(logical_names)
    part_of = layout.part_of()
    gone = {n for n in layout.shapes if part_of.get(n, n) in drop}
    files = [(f, [n for n in names if n not in gone]) for f, names in layout.files]
    files = [(f, names) for f, names in files if names]
    shapes = {k: v for k, v in layout.shapes.items() if k not in gone}
    dtypes = {k: v for k, v in layout.dtypes.items() if k not in gone}
    index = layout.index
    if index is not None and "total_size" in index.get("metadata", {}):
        index = {**index, "metadata": {**index["metadata"], "total_size": _total_bytes(shapes, dtypes)}}
    return replace(layout, files=files, shapes=shapes, dtypes=dtypes, index=index,
                   file_metadata={f: layout.file_metadata.get(f) for f, _ in files},
                   packed={k: v for k, v in layout.packed.items() if k not in drop})


def _without_quantization(config: str | None) -> str | None:
    if config is None or quantization_config(config) is None:
        return config
    cfg = json.loads(config)
    cfg.pop("quantization_config", None)
    if isinstance(cfg.get("text_config"), dict):
        cfg["text_config"].pop("quantization_config", None)
    return json.dumps(cfg, indent=2) + "\n"


def _total_bytes(shapes: Mapping[str, Sequence[int]], dtypes: Mapping[str, str]) -> int:
    """index.json's metadata.total_size: the bytes of all tensors."""
    return sum(_numel(s) * _DTYPES[dtypes[k]].itemsize for k, s in shapes.items())


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def export_hf(source: Mapping[str, torch.Tensor] | CheckpointSource, spec: ModelSpec, out_dir: str | Path,
              family: str | None = None, layout: HFLayout | None = None, dtype: torch.dtype | None = None,
              max_shard_bytes: int = 5 * 2**30, config: str | None = None, dequantize: bool = False) -> list[Path]:
    """Write `source` (a moestack state dict, or a CheckpointSource) as an HF checkpoint in `out_dir`.

    layout: the HF layout to reproduce; default: the one recorded in a converted checkpoint (or a run started from
    an HF checkpoint), else `default_layout(dtype or bf16, max_shard_bytes)`, with the routed experts in MXFP4 when
    `config` (config.json text, written to out_dir) carries a compressed-tensors mxfp4 quantization_config. dtype
    given with a recorded layout: every floating tensor is written in dtype instead. Packed groups of the layout
    are quantised to MXFP4 (moestack/ops/mxfp4.py); dequantize: written unpacked instead (and config.json without
    quantization_config). Returns the files written (shards, then index.json / config.json). Raises ConvertError
    when the source lacks tensors the model has, holds tensors it does not, or the layout names tensors the model
    does not have.
    """
    nmap = build_name_map(spec, family)
    src = source if isinstance(source, CheckpointSource) else _DictSource(source)
    if layout is None and isinstance(src, CheckpointSource) and "hf_layout" in src.extra:
        layout = HFLayout.from_json(src.extra["hf_layout"])
    if layout is None:
        mx = mxfp4_groups(quantization_config(config), "export: config.json") and not dequantize
        layout = replace(default_layout(nmap, dtype or torch.bfloat16, max_shard_bytes, mx), config=config)
    elif dtype is not None:  # the recorded files, in another dtype
        dtypes = {k: _DTYPE_NAMES[dtype] if _DTYPES[v].is_floating_point else v for k, v in layout.dtypes.items()}
        index = layout.index
        if index is not None and "total_size" in index.get("metadata", {}):
            index = {**index, "metadata": {**index["metadata"], "total_size": _total_bytes(layout.shapes, dtypes)}}
        layout = replace(layout, dtypes=dtypes, index=index)
    if dequantize:
        layout = unpacked_layout(layout, dtype or torch.bfloat16)
    want = {r.ms for r in nmap.rules} | {ms for ms, _ in nmap.tied}
    extra_src = sorted(set(src.keys()) - want)
    missing_src = sorted(want - set(src.keys()))
    if extra_src or missing_src:
        parts = [f"{len(x)} {label}: {compact_names(x)}" for label, x in (("missing", missing_src),
                                                                          ("unexpected", extra_src)) if x]
        raise ConvertError(f"moestack weights do not match model '{spec.name}': " + "; ".join(parts),
                           missing_src, extra_src)
    check_layout(layout, nmap, where="HF layout")
    _check_source_shapes(src, nmap, spec)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConvertError(f"{out}: exists and is not a directory; export into a new directory")
    if out.is_dir() and (any(out.glob("*.safetensors")) or (out / INDEX).exists()):
        raise ConvertError(f"{out}: already holds safetensors files; export into a new directory")
    # written into a sibling temp folder and moved into `out` when complete: a failure leaves no partial export
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        written = _write_export(src, nmap, layout, staging)
        out.mkdir(exist_ok=True)
        moved = []
        for p in written:
            os.replace(p, out / p.name)
            moved.append(out / p.name)
        return moved
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _check_source_shapes(src, nmap: NameMap, spec: ModelSpec) -> None:
    """Every moestack tensor of the source has the shape the model's name map expects (before any file is made)."""
    shapes = getattr(src, "shapes", None)
    if shapes is None:
        return
    want = {r.ms: tuple(r.ms_shape) for r in nmap.rules}
    bad = [f"{n}: source {list(shapes[n])} vs model {list(s)}" for n, s in want.items()
           if n in shapes and tuple(shapes[n]) != s]
    if bad:
        raise ConvertError(f"moestack weights do not match model '{spec.name}' ({len(bad)} shape mismatch: "
                           f"{_capped(bad, _SHOWN, '; ')}); pass the --model the checkpoint was trained with",
                           mismatched=bad)


def _write_export(src, nmap: NameMap, layout: HFLayout, out: Path) -> list[Path]:
    part_of = layout.part_of()
    last_use: dict[str, int] = {}
    for i, (_, names) in enumerate(layout.files):
        for hf in names:
            last_use[nmap.by_hf[part_of.get(hf, hf)][0].ms] = i
    cache: dict[str, torch.Tensor] = {}
    quantized: dict[str, dict[str, torch.Tensor]] = {}  # packed groups with parts still to write
    written = []
    for i, (f, names) in enumerate(layout.files):
        needed = list(dict.fromkeys(nmap.by_hf[part_of.get(hf, hf)][0].ms for hf in names))
        cache.update(src.get([n for n in needed if n not in cache]))
        tensors = {}
        for hf in names:
            if hf not in part_of:
                tensors[hf] = _hf_tensor(nmap.by_hf[hf], cache, _DTYPES[layout.dtypes[hf]], layout.shapes[hf])
                continue
            logical = part_of[hf]
            entry = layout.packed[logical]
            if logical not in quantized:
                w = _hf_tensor(nmap.by_hf[logical], cache, torch.float32, None)
                try:
                    p, sc = quantize_mxfp4(w, where=f"export: {logical}")
                except MXFP4Error as err:
                    raise ConvertError(str(err)) from None
                quantized[logical] = {entry["packed"]: p, entry["scale"]: sc}
                if "shape" in entry:
                    quantized[logical][entry["shape"]] = torch.tensor(list(w.shape),
                                                                      dtype=_DTYPES[layout.dtypes[entry["shape"]]])
            tensors[hf] = quantized[logical].pop(hf)
            if not quantized[logical]:
                del quantized[logical]
        written.append(_save_shard(out / f, tensors, layout.file_metadata.get(f)))
        del tensors
        for name in [n for n in cache if last_use[n] <= i]:
            del cache[name]
    if layout.index is not None:
        weight_map = {n: f for f, names in layout.files for n in names}
        index = {**layout.index, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        written.append(out / INDEX)
    if layout.config is not None:
        (out / "config.json").write_text(layout.config)
        written.append(out / "config.json")
    return written


def _hf_tensor(entry, cache: dict[str, torch.Tensor], dtype: torch.dtype,
               hf_shape: Sequence[int] | None) -> torch.Tensor:
    rule, slot = entry
    t = cache[rule.ms]
    if isinstance(rule, Direct):
        shape = tuple(hf_shape) if hf_shape is not None else rule.hf_shape
        if rule.pad and _numel(shape) > t.numel():  # zero-padded HF layout (Kimi K3's A_log)
            t = torch.cat([t.reshape(-1), t.new_zeros(_numel(shape) - t.numel())])
        t = t.reshape(shape)
    else:
        j, rows = rule.slot(*slot)
        t = t[j, rows]
    return t.to(dtype=dtype, copy=True).contiguous()


def _save_shard(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> Path:
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, path)
    return path
