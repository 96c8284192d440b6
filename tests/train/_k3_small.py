"""A scaled-down Kimi K3 config.json: the released file (tests/data/hf_configs/kimi-k3.config.json) with every field
kept (quantization_config, vision_config, ...) and only the widths, depth, experts and vocabulary made small."""

from __future__ import annotations

import copy
import json
from pathlib import Path

RELEASED = Path(__file__).resolve().parents[1] / "data" / "hf_configs" / "kimi-k3.config.json"


def small_k3_config(attn_res: bool = False, layers: int = 4) -> dict:
    """layers >= 2: layer 1 dense, KDA everywhere but every 4th layer and the last (MLA), as the release.
    attn_res: keep attn_res_block_size (2 here); False removes it."""
    cfg = copy.deepcopy(json.loads(RELEASED.read_text()))
    t = cfg["text_config"]
    full = sorted({i for i in range(4, layers + 1, 4)} | {layers})
    t.update(
        hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2,
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        moe_intermediate_size=64, routed_expert_hidden_size=32, num_experts=8, num_experts_per_token=2,
        vocab_size=288, max_position_embeddings=4096,
    )
    t["linear_attn_config"].update(num_heads=2, head_dim=32, full_attn_layers=full,
                                   kda_layers=[i for i in range(1, layers + 1) if i not in full])
    if attn_res:
        t["attn_res_block_size"] = 2
    else:
        t.pop("attn_res_block_size")
    cfg["vision_config"].update(text_hidden_size=64)
    return cfg
