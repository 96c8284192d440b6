"""The released Kimi K3 checkpoint layout, end to end on a small K3-shaped checkpoint written here: index.json over
several shards, config.json with the release's quantization_config (compressed-tensors mxfp4-pack-quantized) and
vision_config, routed experts as weight_packed / weight_scale (a scale in another shard than its packed data),
A_log F32 [head_dim] zero-padded past the heads, and vision-tower tensors. Import, export back to the same layout
(MXFP4 re-quantisation), and the round-trip error of a trained model's experts.

Names come from the hand-written naming oracle of test_convert.py (independent of moestack/train/hf_names.py),
changed where the release differs (packed experts, padded A_log, vision tensors)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).parent))
from _k3_small import small_k3_config  # noqa: E402
from test_convert import _expected_experts, _hf_shapes, _ms_name  # noqa: E402

from moestack.config.hf import hf_config_to_spec  # noqa: E402
from moestack.model.transformer import build_model
from moestack.ops.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from moestack.train.convert import (
    CheckpointSource,
    ConvertError,
    describe_skipped,
    export_hf,
    hf_to_checkpoint,
    hf_to_state_dict,
    read_hf_layout,
)
from moestack.train.hf_names import build_name_map

VISION = {  # a few tensors of the vision tower and projector, top-level names as the release has them
    "vision_tower.patch_embed.proj.weight": (16, 3, 14, 14),
    "vision_tower.encoder.blocks.0.wqkv.weight": (48, 16),
    "vision_tower.encoder.blocks.0.norm0.weight": (16,),
    "mm_projector.proj.0.weight": (64, 64),
    "mm_projector.pre_norm.bias": (16,),
}


def _spec():
    return hf_config_to_spec(small_k3_config(), "k3-small").spec


def _released_tensors(spec, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors in the release's naming and storage: experts MXFP4-packed, A_log F32 [head_dim] padded."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    H, D = spec.kda.num_heads, spec.kda.head_dim
    for name, shape in _hf_shapes(spec, "kimi_k3").items():
        if name.endswith("A_log"):
            out[name] = torch.cat([torch.randn(H, generator=gen), torch.zeros(D - H)])  # [head_dim], zero tail
        elif ".experts." in name:
            base = name.removesuffix(".weight")
            rows, cols = shape
            out[base + ".weight_packed"] = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=gen)
            out[base + ".weight_scale"] = torch.randint(118, 126, (rows, cols // 32), dtype=torch.uint8,
                                                        generator=gen)
        else:
            fp32 = name.endswith(("dt_bias", "e_score_correction_bias")) or "conv1d" in name or "o_norm" in name
            out[name] = torch.randn(shape, generator=gen).to(torch.float32 if fp32 else torch.bfloat16)
    for name, shape in VISION.items():
        out[name] = torch.randn(shape, generator=gen).to(torch.bfloat16)
    return out


def _write_release(root: Path, tensors: dict[str, torch.Tensor], config: dict, n_files: int = 3) -> None:
    """Shards as the release names them (model-0000i-of-0000n); expert j in shard j % n, its weight_scale in the
    next shard (a packed group spanning shards); other tensors spread in name order."""
    root.mkdir(parents=True)
    names = sorted(tensors)
    plain = [n for n in names if ".experts." not in n]
    file_of = {n: i * n_files // len(plain) for i, n in enumerate(plain)}
    for n in names:
        m = re.search(r"\.experts\.(\d+)\.", n)
        if m:
            file_of[n] = (int(m.group(1)) + n.endswith("weight_scale")) % n_files
    weight_map = {}
    for i in range(n_files):
        f = f"model-{i + 1:05d}-of-{n_files:06d}.safetensors"
        chunk = {n: tensors[n] for n in names if file_of[n] == i}
        save_file(chunk, str(root / f), metadata={"format": "pt"})
        weight_map.update({n: f for n in chunk})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}))
    (root / "config.json").write_text(json.dumps(config, indent=2))


def _dequantized(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Logical .weight of every packed expert (bf16)."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(".weight_packed"):
            base = name.removesuffix("_packed")
            out[base] = dequantize_mxfp4(t, tensors[base + "_scale"], torch.bfloat16)
    return out


@pytest.fixture
def release(tmp_path):
    spec = _spec()
    tensors = _released_tensors(spec)
    _write_release(tmp_path / "k3", tensors, small_k3_config())
    return spec, tensors, tmp_path / "k3"


def test_import_release_layout(release):
    spec, tensors, root = release
    layout = read_hf_layout(root)
    assert len(layout.packed) == 3 * 8 * 3  # 3 MoE layers x 8 experts x w1/w2/w3
    sd = hf_to_state_dict(root, spec)
    model_names = set(build_model(spec, "meta").state_dict())
    assert set(sd) == model_names
    H = spec.kda.num_heads
    for name, t in tensors.items():
        ms = _ms_name(name)
        if ms is None or name in VISION:
            continue
        want = t[:H] if name.endswith("A_log") else t
        assert torch.equal(sd[ms], want), name
    experts = _expected_experts({**tensors, **_dequantized(tensors)}, spec, "kimi_k3")
    for name, want in experts.items():
        assert sd[name].dtype == torch.bfloat16 and torch.equal(sd[name], want), name
    # one expert value by hand: E2M1 code of the low nibble times 2^(scale - 127)
    p = tensors["language_model.model.layers.2.block_sparse_moe.experts.5.w2.weight_packed"]
    sc = tensors["language_model.model.layers.2.block_sparse_moe.experts.5.w2.weight_scale"]
    code = int(p[3, 20]) & 0xF
    mag = [0, 0.5, 1, 1.5, 2, 3, 4, 6][code & 7] * (-1 if code & 8 else 1)
    assert float(sd["layers.2.ffn.experts.w_down"][5, 3, 40]) == mag * 2.0 ** (int(sc[3, 1]) - 127)


def test_vision_skipped_in_one_line(release, tmp_path, capsys):
    spec, tensors, root = release
    path = hf_to_checkpoint(root, tmp_path / "ckpt", spec)
    skipped = CheckpointSource(path).extra["skipped"]
    assert sorted(skipped) == sorted(VISION)
    line = describe_skipped(skipped, build_name_map(spec))
    assert line.startswith("skipped 5 HF tensor(s): ") and "vision_tower.* (3)" in line and "mm_projector.* (2)" \
        in line and "\n" not in line
    from moestack.cli.app import main

    assert main(["convert", str(root), str(tmp_path / "ckpt2")]) == 0
    out = capsys.readouterr().out
    assert "skipped 5 HF tensor(s)" in out and "vision_tower.* (3)" in out


def test_release_layout_errors(tmp_path):
    spec = _spec()
    cfg = small_k3_config()

    def write(name, tensors, config=cfg):
        _write_release(tmp_path / name, tensors, config)
        return tmp_path / name

    t = _released_tensors(spec, seed=1)
    a_log = "language_model.model.layers.1.self_attn.A_log"
    bad = dict(t)
    bad[a_log] = t[a_log].clone()
    bad[a_log][-1] = 0.5
    with pytest.raises(ConvertError, match=r"layers\.1\.self_attn\.A_log has 32 entries for 2 heads and its padding"):
        hf_to_state_dict(write("pad", bad), spec)
    scale = "language_model.model.layers.3.block_sparse_moe.experts.2.w3.weight_scale"
    with pytest.raises(ConvertError, match=r"experts\.2\.w3\.weight_packed: no .*experts\.2\.w3\.weight_scale"):
        read_hf_layout(write("noscale", {k: v for k, v in t.items() if k != scale}))
    plain = {k: v for k, v in cfg.items()}
    plain["text_config"] = {k: v for k, v in cfg["text_config"].items() if k != "quantization_config"}
    with pytest.raises(ConvertError, match="config.json has no quantization_config"):
        read_hf_layout(write("noq", t, plain))
    nv = json.loads(json.dumps(cfg))
    nv["text_config"]["quantization_config"]["format"] = "nvfp4-pack-quantized"
    nv["text_config"]["quantization_config"]["config_groups"]["group_0"]["format"] = "nvfp4-pack-quantized"
    with pytest.raises(ConvertError, match="nvfp4-pack-quantized: moestack reads compressed-tensors "
                                           "mxfp4-pack-quantized only"):
        read_hf_layout(write("nvfp4", t, nv))
    wrong = dict(t)
    wrong[scale] = t[scale][:, :1].clone().repeat(1, 2)  # 2 scales per row where 1 belongs (32 columns)
    with pytest.raises(ConvertError, match=r"w3\.weight: weight_scale \[64, 2\] does not fit weight_packed"):
        read_hf_layout(write("shape", wrong))


def test_export_reproduces_the_release_layout(release, tmp_path):
    """HF (release layout) -> moestack checkpoint -> HF: same files, names, dtypes, shapes; every non-expert tensor
    bit-exact; MXFP4 experts re-quantised to the same values; config.json and the index as they were."""
    spec, tensors, root = release
    path = hf_to_checkpoint(root, tmp_path / "ckpt", spec)
    export_hf(CheckpointSource(path), spec, tmp_path / "back")
    src_files = sorted(p.name for p in root.glob("*.safetensors"))
    assert sorted(p.name for p in (tmp_path / "back").glob("*.safetensors")) == src_files
    for f in src_files:
        a, b = load_file(str(root / f)), load_file(str(tmp_path / "back" / f))
        assert a.keys() - set(VISION) == b.keys(), f
        for name in b:
            if name.endswith(("weight_packed", "weight_scale")):
                assert b[name].dtype == torch.uint8 and b[name].shape == a[name].shape, name
            else:
                assert b[name].dtype == a[name].dtype and torch.equal(a[name], b[name]), name
    back = {}
    for f in src_files:
        back.update(load_file(str(tmp_path / "back" / f)))
    deq_src, deq_back = _dequantized(tensors), _dequantized(back)
    assert deq_src.keys() == deq_back.keys()
    for name in deq_src:
        assert torch.equal(deq_src[name], deq_back[name]), name
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == small_k3_config()
    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors) - set(VISION)


def test_dequantized_export(release, tmp_path):
    """--dequantize: experts as bf16 .weight (the exact MXFP4 values), config.json without quantization_config."""
    spec, tensors, root = release
    path = hf_to_checkpoint(root, tmp_path / "ckpt", spec)
    export_hf(CheckpointSource(path), spec, tmp_path / "plain", dequantize=True)
    back = {}
    for f in (tmp_path / "plain").glob("*.safetensors"):
        back.update(load_file(str(f)))
    assert not any(n.endswith(("weight_packed", "weight_scale")) for n in back)
    for name, want in _dequantized(tensors).items():
        assert back[name].dtype == torch.bfloat16 and torch.equal(back[name], want), name
    cfg = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert "quantization_config" not in cfg["text_config"]
    assert hf_to_state_dict(tmp_path / "plain", spec).keys() == hf_to_state_dict(root, spec).keys()


def test_trained_model_round_trip_error(tmp_path):
    """A model in moestack's own fp32 weights exported in the release layout without a recorded one (routed
    experts MXFP4 because config.json says so, A_log padded to head_dim) and read back: the experts within MXFP4
    quantisation error, every other tensor bf16-rounded (or exact where the release keeps fp32)."""
    spec = _spec()
    model = build_model(spec, "cpu", seed=3)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    export_hf(sd, spec, tmp_path / "out", config=json.dumps(small_k3_config()), max_shard_bytes=40_000)
    layout = read_hf_layout(tmp_path / "out")
    assert len(layout.files) > 2 and len(layout.packed) == 3 * 8 * 3
    assert layout.shapes["language_model.model.layers.0.self_attn.A_log"] == (spec.kda.head_dim,)
    assert layout.dtypes["language_model.model.layers.0.self_attn.A_log"] == "F32"
    again = hf_to_state_dict(tmp_path / "out", spec, mxfp4_dtype=torch.float32)
    for name, t in sd.items():
        got = again[name].float()
        if ".experts." in name:
            q = dequantize_mxfp4(*quantize_mxfp4(t), torch.float32)
            assert torch.equal(got, q), name  # exactly the MXFP4 quantisation of the fp32 weights
            rel = float((got - t).norm() / t.norm())
            assert 0.02 < rel < 0.2, (name, rel)
        elif name.endswith(("A_log", "dt_bias", "selection_bias")) or "conv" in name or "o_norm" in name:
            assert torch.equal(got, t), name
        else:
            assert torch.equal(got, t.to(torch.bfloat16).float()), name
