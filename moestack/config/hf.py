"""HuggingFace config.json -> ModelSpec: one small adapter per family, registered by `model_type`.

Families: kimi_k3 (multimodal wrapper; the text model is a nested kimi_linear config), kimi_linear, deepseek_v3 and
kimi_k2 (DeepSeek-V3 layout), deepseek_v32 (V3 + DSA indexer), qwen3_moe, qwen3_next (Gated DeltaNet + gated GQA),
mixtral, nemotron_h (Mamba-2 / attention / LatentMoE hybrid; profile-only).

Every key of the config is accounted for, through a `_Fields` tracker:
  * mapped: read into the spec (shape or math);
  * ignored: listed in `HFImport.ignored` (token ids, dtype, generation settings, bookkeeping, inference-only
    switches); each ignored key is named once, with no effect on the model;
  * rejected: a value moestack cannot express (e.g. attention bias in MLA, a sliding window) -> ConfigError
    naming the field and value;
  * unknown (neither mapped nor known-ignored) -> ConfigError naming it: an unrecognised field could change math.
MTP / next-n layers (spec.mtp_layers), vision towers and quantization blocks (`HFExtras`) are counted and
reported by the profiler even though moestack does not train them.

Public API: `load_hf_config(path) -> HFImport`, `hf_config_to_spec(cfg) -> HFImport`, `is_hf_config(path)`,
`supported_model_types()`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moestack.config.base import ConfigError, validate
from moestack.config.model_spec import ModelSpec

# Keys that never change shapes or math of the trained model, for every family.
COMMON_IGNORED = frozenset(
    {
        # bookkeeping / loading
        "architectures", "auto_map", "transformers_version", "_name_or_path", "torch_dtype", "dtype",
        "use_bfloat16", "torchscript", "_attn_implementation", "attn_implementation", "return_dict",
        "output_attentions", "output_hidden_states", "output_router_logits", "use_cache", "num_logits_to_keep",
        "pruned_heads", "tf_legacy_loss", "problem_type", "finetuning_task", "id2label", "label2id",
        "task_specific_params", "prefix", "is_decoder", "is_encoder_decoder", "add_cross_attention",
        "cross_attention_hidden_size", "tie_encoder_decoder", "chunk_size_feed_forward", "tokenizer_class",
        # token ids
        "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
        "ignore_index", "image_token_id", "video_token_id", "media_placeholder_token_id", "image_placeholder",
        # generation settings
        "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
        "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
        "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
        "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
        "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
        "begin_suppress_tokens",
    }
)


@dataclass
class HFExtras:
    """What the profiler reports beyond the ModelSpec: counted, never trained."""

    vision_params: int = 0  # vision tower + projector (estimate from the vision config; see _moonvit_params)
    vision_note: str = ""
    quantization: dict[str, Any] | None = None  # summary of quantization_config (checkpoint storage format)
    notes: list[str] = field(default_factory=list)


@dataclass
class HFImport:
    spec: ModelSpec
    model_type: str  # the top-level model_type of the config
    mapped: list[str]  # config keys read into the spec (dotted for nested keys)
    ignored: list[str]  # config keys that do not change shapes or math
    extras: HFExtras


class _Fields:
    """Read-tracking view of one config dict: every key must end up mapped, ignored or rejected."""

    def __init__(self, data: dict[str, Any], source: str, prefix: str = ""):
        self.data, self.source, self.prefix = data, source, prefix
        self.mapped: list[str] = []
        self.ignored: list[str] = []

    def _name(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def req(self, key: str) -> Any:
        if self.data.get(key) is None:
            raise ConfigError(f"{self.source}: {self._name(key)}: required field is missing")
        self.mapped.append(self._name(key))
        return self.data[key]

    def get(self, key: str, default: Any = None) -> Any:
        if key in self.data:
            self.mapped.append(self._name(key))
            value = self.data[key]
            return default if value is None else value
        return default

    def ignore(self, *keys: str) -> None:
        self.ignored.extend(self._name(k) for k in keys if k in self.data)

    def reject(self, key: str, why: str) -> ConfigError:
        return ConfigError(f"{self.source}: {self._name(key)}: {why} (got {self.data.get(key)!r})")

    def expect(self, key: str, allowed: tuple, default: Any = None) -> Any:
        """Read `key` (default when absent/null); reject values outside `allowed`."""
        value = self.get(key, default)
        if value not in allowed:
            allowed_s = ", ".join(repr(a) for a in allowed)
            raise self.reject(key, f"not supported; moestack accepts {allowed_s}")
        return value

    def sub(self, key: str) -> _Fields:
        data = self.req(key)
        if not isinstance(data, dict):
            raise self.reject(key, "expected a mapping")
        return _Fields(data, self.source, f"{self._name(key)}.")

    def finish(self, *children: _Fields) -> None:
        for child in children:
            self.mapped.extend(child.mapped)
            self.ignored.extend(child.ignored)
        self.ignore(*(k for k in self.data if k in COMMON_IGNORED))
        seen = {n.removeprefix(self.prefix).split(".")[0] for n in self.mapped + self.ignored}
        unknown = sorted(k for k in self.data if k not in seen)
        if unknown:
            names = ", ".join(self._name(k) for k in unknown)
            raise ConfigError(
                f"{self.source}: unknown field(s) {names}: not mapped by this adapter and not known to leave the math "
                "unchanged; extend moestack/config/hf.py"
            )


Adapter = Callable[[_Fields, HFExtras], dict[str, Any]]
_ADAPTERS: dict[str, Adapter] = {}
_ARCHITECTURES: dict[str, str] = {}  # architecture class name -> model_type


def register(model_types: tuple[str, ...], architectures: tuple[str, ...] = ()) -> Callable[[Adapter], Adapter]:
    def deco(fn: Adapter) -> Adapter:
        for mt in model_types:
            _ADAPTERS[mt] = fn
        for arch in architectures:
            _ARCHITECTURES.setdefault(arch, model_types[0])
        return fn

    return deco


def supported_model_types() -> list[str]:
    return sorted(_ADAPTERS)


# ---------------------------------------------------------------------------------------------- shared pieces


def _activation(f: _Fields, key: str = "hidden_act") -> dict[str, Any]:
    act = f.req(key)
    if act in ("silu", "swish"):
        return {"activation": "swiglu"}
    if act == "situ":
        return {
            "activation": "situ_glu",
            "situ_beta": float(f.get("activation_situ_beta", 4.0)),
            "situ_linear_beta": float(f.get("activation_situ_linear_beta", 25.0)),
        }
    if act == "relu2":
        return {"activation": "relu2"}
    raise f.reject(key, "activation not supported; moestack accepts 'silu' (SwiGLU), 'situ' (SiTU-GLU), 'relu2'")


_ROPE_KEYS = {
    "factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
    "low_freq_factor", "high_freq_factor",
}


def _rope_scaling(f: _Fields) -> dict[str, Any] | None:
    rs = f.get("rope_scaling")
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "default":
        return None
    unknown = sorted(set(rs) - _ROPE_KEYS - {"type", "rope_type"})
    if unknown:
        raise f.reject("rope_scaling", f"unknown rope_scaling keys {unknown}")
    if kind not in ("yarn", "linear", "dynamic", "llama3"):
        raise f.reject("rope_scaling", "rope_scaling type not supported (yarn, linear, dynamic, llama3)")
    out = {k: rs[k] for k in _ROPE_KEYS if rs.get(k) is not None}
    out["type"] = kind
    return out


def _zero(f: _Fields, *keys: str) -> None:
    """Dropout-like fields: 0 is accepted (and ignored), anything else is rejected (no dropout in moestack)."""
    for key in keys:
        if key in f.data:
            if f.data[key] not in (0, 0.0, None):
                raise f.reject(key, "must be 0: moestack trains without dropout / jitter")
            f.ignore(key)


def _base(f: _Fields, name: str) -> dict[str, Any]:
    out = {
        "name": name,
        "vocab_size": f.req("vocab_size"),
        "hidden_size": f.req("hidden_size"),
        "num_layers": f.req("num_hidden_layers"),
        "tie_word_embeddings": bool(f.get("tie_word_embeddings", False)),
        "init_std": float(f.get("initializer_range", 0.02)),
    }
    for key in ("max_position_embeddings", "model_max_length"):  # the first present one; the other is a duplicate
        if f.has(key) and "max_seq_len" not in out:
            out["max_seq_len"] = int(f.get(key))
        else:
            f.ignore(key)
    return out


def _dense_first(first_k: int) -> list[int]:
    return list(range(1, first_k + 1))


def _quantization(f: _Fields, extras: HFExtras) -> None:
    q = f.get("quantization_config")
    if not q:
        return
    method = q.get("quant_method", "unknown")
    summary: dict[str, Any] = {"method": method, "format": q.get("format") or q.get("fmt")}
    if method == "fp8":
        summary.update(bits=8, block=q.get("weight_block_size"), ignore=[])
    elif method == "compressed-tensors":
        weights = next(iter(q.get("config_groups", {}).values()), {}).get("weights", {})
        summary.update(
            bits=weights.get("num_bits"), group_size=weights.get("group_size"), ignore=list(q.get("ignore", []))
        )
    extras.quantization = summary
    extras.notes.append(
        f"quantization_config ({method}, {summary.get('format')}): checkpoint storage format; moestack trains "
        "bf16/fp32 weights, counts are of unquantized parameters"
    )


# Canonical HF module names per profile category, for deciding which groups a quantization_config covers.
_QUANT_PROBES = {
    "attention": ("model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.o_proj"),
    "dense_mlp": ("model.layers.0.mlp.gate_proj",),
    "routed_experts": ("model.layers.1.mlp.experts.0.gate_proj", "model.layers.1.block_sparse_moe.experts.0.w1"),
    "shared_experts": (
        "model.layers.1.mlp.shared_experts.gate_proj",
        "model.layers.1.block_sparse_moe.shared_experts.gate_proj",
    ),
    "lm_head": ("lm_head",),
}


def quantized_categories(quant: dict[str, Any]) -> set[str]:
    """Profile categories whose Linear weights the quantization block stores quantized.

    fp8 block quantization (DeepSeek): every Linear except the LM head. compressed-tensors: every Linear whose
    canonical HF name no `ignore` entry matches ("re:" entries are regexes, others exact names).
    """
    if quant.get("method") == "fp8":
        return {"attention", "dense_mlp", "routed_experts", "shared_experts"}
    patterns = quant.get("ignore") or []

    def ignored(name: str) -> bool:
        for p in patterns:
            if p.startswith("re:") and re.match(p[3:], name):
                return True
            if name == p or name.endswith("." + p):
                return True
        return False

    return {cat for cat, names in _QUANT_PROBES.items() if not any(ignored(n) for n in names)}


# ---------------------------------------------------------------------------------------------- adapters


@register(("deepseek_v3", "kimi_k2", "deepseek_v32"), ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM"))
def _deepseek(f: _Fields, extras: HFExtras) -> dict[str, Any]:
    """DeepSeek-V3 / Kimi K2 (same layout) and DeepSeek-V3.2 (plus the DSA lightning indexer)."""
    out = _base(f, "hf")
    out.update(_activation(f))
    heads = f.req("num_attention_heads")
    if f.get("num_key_value_heads", heads) != heads:
        raise f.reject("num_key_value_heads", "MLA has no KV-head grouping; must equal num_attention_heads")
    if f.get("attention_bias", False):
        raise f.reject("attention_bias", "MLA projections have no bias in moestack")
    _zero(f, "attention_dropout")
    if f.get("pretraining_tp", 1) != 1:
        raise f.reject("pretraining_tp", "only 1 (no split-linear emulation)")
    if f.get("moe_layer_freq", 1) != 1:
        raise f.reject("moe_layer_freq", "only 1 (every layer after first_k_dense_replace is MoE)")
    f.ignore("ep_size")
    mla = {
        "num_heads": heads,
        "q_lora_rank": f.get("q_lora_rank"),
        "kv_lora_rank": f.req("kv_lora_rank"),
        "qk_nope_head_dim": f.req("qk_nope_head_dim"),
        "qk_rope_head_dim": f.req("qk_rope_head_dim"),
        "v_head_dim": f.req("v_head_dim"),
        "use_rope": True,
        "rope_theta": float(f.get("rope_theta", 10000.0)),
        "rope_scaling": _rope_scaling(f),
        "output_gate": False,
    }
    if f.has("index_topk"):
        mla["indexer"] = {
            "num_heads": f.req("index_n_heads"),
            "head_dim": f.req("index_head_dim"),
            "top_k": f.req("index_topk"),
        }
    n_shared = f.get("n_shared_experts", 0)
    moe_inter = f.req("moe_intermediate_size")
    topk_method = f.expect("topk_method", ("noaux_tc", "greedy", "group_limited_greedy"), "greedy")
    router = {
        "score": f.expect("scoring_func", ("sigmoid", "softmax"), "softmax"),
        "num_groups": f.get("n_group", 1),
        "topk_groups": f.get("topk_group", 1),
        "renormalize": bool(f.get("norm_topk_prob", False)),
        "scaling_factor": float(f.get("routed_scaling_factor", 1.0)),
        "selection_bias": topk_method == "noaux_tc",
    }
    if topk_method == "greedy":
        router["num_groups"] = router["topk_groups"] = 1  # greedy ignores the groups
    router["bias_update"] = _bias_update(router)
    if not f.get("seq_aux", True):
        raise f.reject("seq_aux", "only the sequence-wise balance loss is implemented")
    if f.has("aux_loss_alpha"):
        router["seq_aux_loss_coef"] = float(f.get("aux_loss_alpha"))
    out.update(
        mla=mla,
        attention="mla",
        full_attention_layers=list(range(1, out["num_layers"] + 1)),
        dense_layers=_dense_first(f.get("first_k_dense_replace", 0)),
        dense_mlp={"intermediate_size": f.req("intermediate_size")},
        moe={
            "num_experts": f.req("n_routed_experts"),
            "top_k": f.req("num_experts_per_tok"),
            "expert_intermediate_size": moe_inter,
            "num_shared_experts": n_shared,
            "shared_intermediate_size": n_shared * moe_inter,
            "router": router,
        },
        norm_eps=float(f.req("rms_norm_eps")),
        mtp_layers=f.get("num_nextn_predict_layers", 0),
    )
    _quantization(f, extras)
    return out


@register(("kimi_linear",), ("KimiLinearForCausalLM",))
def _kimi_linear(f: _Fields, extras: HFExtras) -> dict[str, Any]:
    """Kimi Linear (KDA + MLA) and the Kimi K3 text model (K3 adds the SiTU-GLU, full-rank output gate, safe gate
    lower bound, gated MLA, Stable LatentMoE and Attention Residuals)."""
    out = _base(f, "hf")
    out.update(_activation(f))
    heads = f.req("num_attention_heads")
    if f.get("num_key_value_heads", heads) != heads:
        raise f.reject("num_key_value_heads", "MLA has no KV-head grouping; must equal num_attention_heads")
    f.ignore("head_dim")  # d / heads; unused by MLA (which uses qk_nope/qk_rope/v head dims)
    la = f.sub("linear_attn_config")
    n = out["num_layers"]
    full = list(la.req("full_attn_layers"))
    kda_layers = la.get("kda_layers")
    if kda_layers is not None and sorted(set(kda_layers) | set(full)) != list(range(1, n + 1)):
        raise la.reject("kda_layers", "kda_layers and full_attn_layers must partition layers 1..num_hidden_layers")
    if kda_layers is not None and set(kda_layers) & set(full):
        raise la.reject("kda_layers", "a layer is listed as both KDA and full attention")
    kda_dim = la.req("head_dim")
    lower = la.get("gate_lower_bound")
    kda = {
        "num_heads": la.req("num_heads"),
        "head_dim": kda_dim,
        "conv_kernel_size": la.get("short_conv_kernel_size", 4),
        "gate": "k3" if lower is not None else "kimi_linear",
        "gate_rank": kda_dim,  # f_a: d -> head_dim -> f_b: -> H * head_dim
        "output_gate_rank": None if la.get("use_full_rank_gate", False) else kda_dim,
    }
    if lower is not None:
        kda["gate_lower_bound"] = float(lower)
    mla = {
        "num_heads": heads,
        "q_lora_rank": f.get("q_lora_rank"),
        "kv_lora_rank": f.req("kv_lora_rank"),
        "qk_nope_head_dim": f.req("qk_nope_head_dim"),
        "qk_rope_head_dim": f.req("qk_rope_head_dim"),
        "v_head_dim": f.req("v_head_dim"),
        "use_rope": not f.get("mla_use_nope", False),
        "rope_theta": float(f.get("rope_theta", 10000.0)),
        "rope_scaling": _rope_scaling(f),
        "output_gate": bool(f.get("mla_use_output_gate", False)),
    }
    if f.has("index_topk"):  # K3.1 Pro style DSA indexer, if the config carries one
        mla["indexer"] = {
            "num_heads": f.req("index_n_heads"),
            "head_dim": f.req("index_head_dim"),
            "top_k": f.req("index_topk"),
        }
    if f.get("moe_layer_freq", 1) != 1:
        raise f.reject("moe_layer_freq", "only 1 (every layer after first_k_dense_replace is MoE)")
    n_shared = f.get("num_shared_experts", 0)
    moe_inter = f.req("moe_intermediate_size")
    grouped = f.get("use_grouped_topk", False)
    topk_method = f.expect("topk_method", ("noaux_tc",), "noaux_tc")  # the gate always has a correction bias
    router = {
        "score": f.expect("moe_router_activation_func", ("sigmoid", "softmax"), "sigmoid"),
        "num_groups": f.get("num_expert_group", 1) if grouped else 1,
        "topk_groups": f.get("topk_group", 1) if grouped else 1,
        "renormalize": bool(f.get("moe_renormalize", True)),
        "scaling_factor": float(f.get("routed_scaling_factor", 1.0)),
        "selection_bias": topk_method == "noaux_tc",
    }
    router["bias_update"] = _bias_update(router)
    moe = {
        "num_experts": f.req("num_experts"),
        "top_k": f.req("num_experts_per_token"),
        "expert_intermediate_size": moe_inter,
        "num_shared_experts": n_shared,
        "shared_intermediate_size": n_shared * moe_inter,
        "router": router,
    }
    if f.has("routed_expert_hidden_size"):
        moe["latent_size"] = f.get("routed_expert_hidden_size")
        moe["latent_norm"] = bool(f.get("latent_moe_use_norm", True))
    elif f.has("latent_moe_use_norm"):
        f.ignore("latent_moe_use_norm")  # no latent, nothing to normalise
    out.update(
        full_attention_layers=full,
        dense_layers=_dense_first(f.get("first_k_dense_replace", 0)),
        attention="mla",
        linear_attention="kda",
        kda=kda,
        mla=mla,
        moe=moe,
        dense_mlp={"intermediate_size": f.req("intermediate_size")},
        norm_eps=float(f.req("rms_norm_eps")),
        mtp_layers=f.get("num_nextn_predict_layers", 0),
        attn_res_block_size=f.get("attn_res_block_size"),
    )
    _quantization(f, extras)
    la.finish()
    f.mapped.extend(la.mapped)
    f.ignored.extend(la.ignored)
    return out


def _moonvit_params(v: dict[str, Any], text_hidden: int) -> int:
    """Parameters of the MoonViT-style tower + patch-merger projector in the Kimi K3 vision_config (estimate).

    patch_embed: Conv2d(3, vt, p, p) (+bias); per layer: 2 RMSNorm(vt), wqkv vt -> 3*qkv (+bias), wo qkv -> vt
    (+bias), MLP vt -> inter -> vt (+bias); final RMSNorm(vt); positional embedding "divided_fixed" has no
    parameters; projector (patchmergerv2): LayerNorm(mm) (weight+bias), Linear(mm*k, mm*k)+bias, Linear(mm*k,
    text)+bias with k = merge_kernel area. Uncertain details (biases, projector widths) are from the config names,
    so the count is reported as an estimate.
    """
    vt, inter, layers = v["vt_hidden_size"], v["vt_intermediate_size"], v["vt_num_hidden_layers"]
    qkv = v.get("qkv_hidden_size", vt)
    p = v["patch_size"]
    lb, ab = int(bool(v.get("linear_bias"))), int(bool(v.get("attn_bias")))
    patch = 3 * p * p * vt + (vt if v.get("patch_embed_proj_bias") else 0)
    layer = 2 * vt + vt * 3 * qkv + ab * 3 * qkv + qkv * vt + ab * vt + vt * inter + lb * inter + inter * vt + lb * vt
    mm = v.get("mm_hidden_size", vt)
    k = 1
    for m in v.get("merge_kernel_size", [2, 2]):
        k *= m
    proj = 2 * mm + (mm * k) * (mm * k) + mm * k + (mm * k) * text_hidden + text_hidden
    return patch + layers * layer + vt + proj


@register(("kimi_k3",), ("KimiK3ForConditionalGeneration",))
def _kimi_k3(f: _Fields, extras: HFExtras) -> dict[str, Any]:
    """Kimi K3 / K3.1 Pro multimodal wrapper: text_config is a kimi_linear config; the vision tower is counted."""
    text = f.sub("text_config")
    text.expect("model_type", ("kimi_linear",))
    text.ignore("architectures", "auto_map")
    out = _kimi_linear(text, extras)
    text.finish()
    f.mapped.extend(text.mapped)
    f.ignored.extend(text.ignored)
    if f.has("tie_word_embeddings") and bool(f.get("tie_word_embeddings")) != out["tie_word_embeddings"]:
        raise f.reject("tie_word_embeddings", "disagrees with text_config.tie_word_embeddings")
    if f.has("vision_config"):
        vision = f.get("vision_config")
        f.ignored.extend(f"vision_config.{k}" for k in vision)  # counted below, not trained
        extras.vision_params = _moonvit_params(vision, out["hidden_size"])
        extras.vision_note = (
            f"vision tower ({vision.get('vt_num_hidden_layers')} layers x {vision.get('vt_hidden_size')}) + "
            "projector, estimated from vision_config; counted, not trained"
        )
    return out


def _bias_update(router: dict[str, Any]) -> str:
    """Quantile balancing (moestack/ops/moe/quantile.py) wherever it applies: a selection bias and no group-limited
    routing; the sign rule otherwise (it does not model the group choice)."""
    return "quantile" if router.get("selection_bias") and router.get("num_groups", 1) == 1 else "sign"


def _softmax_router(f: _Fields, renorm_key: str | None, default_renorm: bool, global_batch: bool = False
                    ) -> dict[str, Any]:
    """Softmax top-k without a selection bias. router_aux_loss_coef is the balance loss's weight: the global-batch
    loss for the Qwen3 families (trained with it: arXiv:2501.11873), the sequence-wise loss otherwise."""
    router = {
        "score": "softmax",
        "renormalize": bool(f.get(renorm_key, default_renorm)) if renorm_key else default_renorm,
        "scaling_factor": 1.0,
        "selection_bias": False,
    }
    if f.has("router_aux_loss_coef"):
        coef = float(f.get("router_aux_loss_coef"))
        if global_batch:
            router.update(global_aux_loss_coef=coef, seq_aux_loss_coef=0.0)
        else:
            router["seq_aux_loss_coef"] = coef
    return router


def _no_sliding_window(f: _Fields) -> None:
    if f.get("use_sliding_window", False):
        raise f.reject("use_sliding_window", "sliding-window attention is not supported")
    if f.get("sliding_window") is not None and "use_sliding_window" not in f.data:
        raise f.reject("sliding_window", "sliding-window attention is not supported")
    f.ignore("max_window_layers")


def _gqa(f: _Fields, use_rope: bool = True, **extra: Any) -> dict[str, Any]:
    heads = f.req("num_attention_heads")
    gqa = {
        "num_heads": heads,
        "num_kv_heads": f.get("num_key_value_heads", heads),
        "head_dim": f.get("head_dim"),
        "qkv_bias": bool(f.get("attention_bias", False)),
        "use_rope": use_rope,
    }
    if use_rope:
        gqa.update(rope_theta=float(f.get("rope_theta", 10000.0)), rope_scaling=_rope_scaling(f))
    gqa.update(extra)
    return gqa


def _qwen_moe_layers(f: _Fields, n: int) -> list[int]:
    """1-based dense layers of the Qwen MoE families (mlp_only_layers is 0-based; decoder_sparse_step)."""
    step = f.get("decoder_sparse_step", 1)
    mlp_only = set(f.get("mlp_only_layers", []))
    return [i + 1 for i in range(n) if i in mlp_only or (i + 1) % step != 0]


@register(("qwen3_moe",), ("Qwen3MoeForCausalLM",))
def _qwen3_moe(f: _Fields, extras: HFExtras) -> dict[str, Any]:
    out = _base(f, "hf")
    out.update(_activation(f))
    _zero(f, "attention_dropout")
    _no_sliding_window(f)
    n = out["num_layers"]
    dense = _qwen_moe_layers(f, n)
    out.update(
        attention="gqa",
        gqa=_gqa(f, qk_norm=True),
        full_attention_layers=list(range(1, n + 1)),
        dense_layers=dense,
        moe={
            "num_experts": f.req("num_experts"),
            "top_k": f.req("num_experts_per_tok"),
            "expert_intermediate_size": f.req("moe_intermediate_size"),
            "router": _softmax_router(f, "norm_topk_prob", False, global_batch=True),
        },
        norm_eps=float(f.req("rms_norm_eps")),
    )
    if dense:
        out["dense_mlp"] = {"intermediate_size": f.req("intermediate_size")}
    else:
        f.ignore("intermediate_size")  # only used by dense layers, and there are none
    _quantization(f, extras)
    return out


@register(("qwen3_next",), ("Qwen3NextForCausalLM",))
def _qwen3_next(f: _Fields, extras: HFExtras) -> dict[str, Any]:
    """Qwen3-Next: Gated DeltaNet (KDA with a per-head scalar decay, q/k heads shared by value-head groups, SiLU
    output gate) in 3 of 4 layers, gated GQA (qk-norm, partial rotary) in the rest, MoE with a gated shared expert.
    Its RMSNorm weights are stored zero-centred (y * (1 + w)): same parameter count, import must add 1."""
    out = _base(f, "hf")
    out.update(_activation(f))
    _zero(f, "attention_dropout")
    _no_sliding_window(f)
    n = out["num_layers"]
    if f.has("layer_types"):
        types = f.get("layer_types")
        full = [i + 1 for i, t in enumerate(types) if t == "full_attention"]
        f.ignore("full_attention_interval")
    else:
        interval = f.req("full_attention_interval")
        full = [i for i in range(1, n + 1) if i % interval == 0]
    kdim, vdim = f.req("linear_key_head_dim"), f.req("linear_value_head_dim")
    if kdim != vdim:
        raise f.reject("linear_value_head_dim", f"must equal linear_key_head_dim ({kdim})")
    kda = {
        "num_heads": f.req("linear_num_key_heads"),
        "head_dim": kdim,
        "num_v_heads": f.req("linear_num_value_heads"),
        "conv_kernel_size": f.get("linear_conv_kernel_dim", 4),
        "gate": "kimi_linear",  # g = -exp(A_log) * softplus(a + dt_bias)
        "decay": "head",
        "gate_rank": None,
        "output_gate_rank": None,
        "output_gate_act": "silu",
    }
    shared = f.get("shared_expert_intermediate_size", 0)
    dense = _qwen_moe_layers(f, n)
    out.update(
        attention="gqa",
        linear_attention="kda",
        gqa=_gqa(f, qk_norm=True, output_gate=True, rope_fraction=float(f.get("partial_rotary_factor", 1.0))),
        kda=kda,
        full_attention_layers=full,
        dense_layers=dense,
        moe={
            "num_experts": f.req("num_experts"),
            "top_k": f.req("num_experts_per_tok"),
            "expert_intermediate_size": f.req("moe_intermediate_size"),
            "num_shared_experts": 1 if shared else 0,
            "shared_intermediate_size": shared,
            "shared_expert_gate": bool(shared),
            "router": _softmax_router(f, "norm_topk_prob", False, global_batch=True),
        },
        norm_eps=float(f.req("rms_norm_eps")),
        mtp_layers=f.get("num_nextn_predict_layers", f.get("mtp_num_hidden_layers", 0)),
    )
    if dense:
        out["dense_mlp"] = {"intermediate_size": f.req("intermediate_size")}
    else:
        f.ignore("intermediate_size")
    _quantization(f, extras)
    extras.notes.append("qwen3_next RMSNorm weights are zero-centred in the checkpoint (y * (1 + w))")
    return out


@register(("mixtral",), ("MixtralForCausalLM",))
def _mixtral(f: _Fields, extras: HFExtras) -> dict[str, Any]:
    out = _base(f, "hf")
    out.update(_activation(f))
    _zero(f, "attention_dropout", "router_jitter_noise")
    _no_sliding_window(f)
    n = out["num_layers"]
    out.update(
        attention="gqa",
        gqa=_gqa(f),
        full_attention_layers=list(range(1, n + 1)),
        moe={
            "num_experts": f.req("num_local_experts"),
            "top_k": f.req("num_experts_per_tok"),
            "expert_intermediate_size": f.req("intermediate_size"),
            # softmax over all experts then renormalised over the top-k == softmax over the top-k logits
            "router": _softmax_router(f, None, True),
        },
        norm_eps=float(f.req("rms_norm_eps")),
    )
    _quantization(f, extras)
    return out


@register(("nemotron_h",), ("NemotronHForCausalLM",))
def _nemotron_h(f: _Fields, extras: HFExtras) -> dict[str, Any]:
    """Nemotron-H / Nemotron 3 (Super: LatentMoE). Single-sublayer blocks from hybrid_override_pattern; the
    attention layers are position-free (no RoPE). Mamba-2 layers are profile-only (ModelSpec.check_buildable)."""
    out = _base(f, "hf")
    out.update(_activation(f, "mlp_hidden_act"))
    pattern = f.req("hybrid_override_pattern")
    mamba = {
        "num_heads": f.req("mamba_num_heads"),
        "head_dim": f.req("mamba_head_dim"),
        "state_size": f.req("ssm_state_size"),
        "num_groups": f.get("n_groups", 1),
        "conv_kernel_size": f.get("conv_kernel", 4),
        "conv_bias": bool(f.get("use_conv_bias", True)),
        "proj_bias": bool(f.get("mamba_proj_bias", f.get("use_bias", False))),
        "chunk_size": f.get("chunk_size", 128),
        "time_step_min": float(f.get("time_step_min", 1e-3)),
        "time_step_max": float(f.get("time_step_max", 1e-1)),
        "time_step_floor": float(f.get("time_step_floor", 1e-4)),
    }
    # the mixer's width is mamba_num_heads * mamba_head_dim (the modeling code never reads `expand`; Nemotron 3
    # Nano publishes expand 2 with 64 x 64 = 4096 != 2 * 2688): a leftover of the Mamba-2 config, ignored
    f.ignore("expand")
    limit = f.data.get("time_step_limit")
    if limit is not None:  # a clamp of dt after the softplus; [0, inf] (the published value) clamps nothing
        if not (isinstance(limit, (list, tuple)) and len(limit) == 2 and float(limit[0]) <= 0.0
                and float(limit[1]) == float("inf")):
            raise f.reject("time_step_limit", "a finite dt clamp is not modelled; moestack accepts [0.0, Infinity]")
        f.ignore("time_step_limit")
    f.expect("mamba_hidden_act", ("silu",), "silu")
    if f.get("attention_bias", False) or f.get("mlp_bias", False):
        raise f.reject("attention_bias" if f.get("attention_bias") else "mlp_bias", "biases are not supported")
    _zero(f, "attention_dropout", "hidden_dropout")
    if f.data.get("sliding_window") is not None:
        raise f.reject("sliding_window", "sliding-window attention is not supported")
    f.ignore(
        "rope_theta", "partial_rotary_factor", "rope_scaling",  # NoPE attention: never used
        "mamba_ssm_cache_dtype", "use_mamba_kernels", "moe_shared_expert_overlap", "sliding_window",
        "residual_in_fp32", "rescale_prenorm_residual",  # numerics of the reference kernels / init rescaling
    )
    if "-" not in pattern:
        f.ignore("intermediate_size")  # dense-MLP width; no "-" layers (MoE widths come from moe_*)
    eps = f.get("norm_eps", f.data.get("layer_norm_epsilon", 1e-5))
    f.ignore("layer_norm_epsilon")  # duplicate of norm_eps
    n_shared = f.get("n_shared_experts", 0)
    moe = {
        "num_experts": f.req("n_routed_experts"),
        "top_k": f.req("num_experts_per_tok"),
        "expert_intermediate_size": f.req("moe_intermediate_size"),
        "num_shared_experts": n_shared,
        "shared_intermediate_size": f.get("moe_shared_expert_intermediate_size", 0) if n_shared else 0,
        "router": {
            "score": "sigmoid",
            "num_groups": f.get("n_group", 1),
            "topk_groups": f.get("topk_group", 1),
            "renormalize": bool(f.get("norm_topk_prob", True)),
            "scaling_factor": float(f.get("routed_scaling_factor", 1.0)),
            "selection_bias": True,  # e_score_correction_bias
            "bias_update": "quantile" if f.get("n_group", 1) == 1 else "sign",
        },
    }
    if f.has("moe_latent_size"):
        moe["latent_size"] = f.get("moe_latent_size")
        moe["latent_norm"] = False  # fc1/fc2 latent projections, no norm on the combined latent
    out.update(
        layer_pattern=pattern,
        attention="gqa",
        gqa=_gqa(f, use_rope=False),
        mamba2=mamba,
        moe=moe if "E" in pattern else None,
        norm_eps=float(eps),
        mtp_layers=f.get("num_nextn_predict_layers", 0),
        mtp_pattern=f.get("mtp_hybrid_override_pattern"),
    )
    if "-" in pattern:
        out["dense_mlp"] = {"intermediate_size": f.req("intermediate_size")}
    _quantization(f, extras)
    return out


# ---------------------------------------------------------------------------------------------- entry points


def _model_type(cfg: dict[str, Any], source: str) -> str:
    mt = cfg.get("model_type")
    if mt in _ADAPTERS:
        return mt
    for arch in cfg.get("architectures") or []:
        if arch in _ARCHITECTURES:
            return _ARCHITECTURES[arch]
    raise ConfigError(
        f"{source}: model_type {mt!r} (architectures {cfg.get('architectures')}) is not supported; "
        f"supported: {', '.join(supported_model_types())}"
    )


def hf_config_to_spec(cfg: dict[str, Any], name: str | None = None, source: str = "config.json") -> HFImport:
    """Map a parsed HF config.json to a validated ModelSpec (+ what the profiler reports beside it).

    Raises ConfigError (one line, naming the field) for unsupported values and unknown fields.
    """
    model_type = _model_type(cfg, source)
    f = _Fields(cfg, source)
    f.get("model_type")
    extras = HFExtras()
    data = _ADAPTERS[model_type](f, extras)
    f.finish()
    data["name"] = name or model_type
    data["family"] = model_type
    data = {k: v for k, v in data.items() if v is not None}
    spec = validate(ModelSpec, data, f"{source} (mapped by the {model_type} adapter)")
    ignored = sorted(dict.fromkeys(f.ignored))
    return HFImport(spec, model_type, sorted(dict.fromkeys(f.mapped)), ignored, extras)


def is_hf_config(path: str | Path) -> bool:
    """A .json file whose top level has `model_type` or `architectures`."""
    p = Path(path)
    if p.suffix != ".json" or not p.is_file():
        return False
    try:
        data = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(data, dict) and ("model_type" in data or "architectures" in data)


def load_hf_config(path: str | Path, name: str | None = None) -> HFImport:
    """Read an HF config.json (a file, or a directory holding config.json) and map it (hf_config_to_spec)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ConfigError(f"{p}: file not found")
    try:
        cfg = json.loads(p.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{p}: line {err.lineno} column {err.colno}: not valid JSON ({err.msg}); the file is "
                          "truncated or edited: fetch it again") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{p}: top level must be a JSON object")
    default_name = p.parent.name if p.name == "config.json" else p.name.removesuffix(".json").removesuffix(".config")
    return hf_config_to_spec(cfg, name or default_name, str(p))
