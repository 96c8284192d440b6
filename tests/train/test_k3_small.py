"""The scaled-down released Kimi K3 config (tests/data/hf_configs/kimi-k3-small.config.json: K3's layer pattern,
Attention Residuals in blocks of 2, LatentMoE, the MXFP4 quantization block kept) trains on a CPU from the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from moestack.cli.app import main
from moestack.config.hf import load_hf_config

CONFIG = Path(__file__).parents[1] / "data" / "hf_configs" / "kimi-k3-small.config.json"


def test_small_config_is_k3_shaped():
    imp = load_hf_config(CONFIG)
    spec, big = imp.spec, load_hf_config(CONFIG.with_name("kimi-k3.config.json")).spec
    assert spec.build_support_errors() == []
    assert spec.attn_res_block_size == 2 and spec.attn_res_blocks_before(spec.num_layers) == 3  # + a partial block
    kinds = [(k.mixer, k.ffn) for k in spec.layer_kinds()]
    assert kinds == [(k.mixer, k.ffn) for k in big.layer_kinds()][:4] + [("mla", "moe")]  # ... ending in two MLAs
    assert imp.extras.quantization["format"] == "mxfp4-pack-quantized" and imp.extras.vision_params > 0
    for name in ("kda", "mla", "moe"):  # the released config's switches, at small widths
        small, released = getattr(spec, name).model_dump(), getattr(big, name).model_dump()
        assert {k for k, v in small.items() if v != released[k]} <= {
            "num_heads", "head_dim", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
            "v_head_dim", "num_experts", "top_k", "expert_intermediate_size", "latent_size", "gate_rank",
            "shared_intermediate_size"}, name


@pytest.mark.slow
def test_small_k3_trains_from_the_cli(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", "--model", str(CONFIG), "--steps", "3", "--batch-size", "2", "--seq-len", "32", "--lr", "1e-2",
            "--out", str(out), "-q", "--set", "logging.tensorboard=false", "--set", "eval_every=0",
            "--set", "logging.every=1", "--set", "schedule.warmup_steps=0"]
    assert main(args) == 0, capsys.readouterr().err
    losses = [r["train/loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
              if "train/loss" in r]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.1, losses  # 6.91 -> 6.57 on the dev CPU
    assert "attn_res_block_size: 2" in (out / "model.yaml").read_text()
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(out / "checkpoints" / "step_00000003")).read_metadata().state_dict_metadata
    assert {"model.layers.4.ffn_res.proj_weight", "model.out_res.norm_weight"} <= set(keys)
