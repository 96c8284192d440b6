"""Per-family tensor names: moestack state-dict names <-> Hugging Face checkpoint names.

A name map is built from the model itself (a `Transformer` on the meta device): every tensor of its state dict
gets exactly one rule, so a moestack tensor without an HF name is an error here, never a silent drop. Rules:
  Direct       one moestack tensor <-> one HF tensor, same values; the HF shape may differ by a reshape (Kimi
               Linear stores A_log as [1, 1, H, 1], moestack as [H]) or by zero padding (`pad`: Kimi K3 stores
               A_log as [head_dim] = [128] for 96 heads, the tail zero; import checks the tail is zero).
  ExpertStack  one fused moestack tensor <-> E (or 2E) HF tensors: experts.w_gate_up [E, 2I, L] holds per expert
               cat(gate [I, L], up [I, L]) on dim 0; experts.w_down [E, L, I] holds per expert down [L, I].

Families (HF model_type) and their naming, from the public modeling code / checkpoints:
  kimi_linear  model.layers.{i}.self_attn.{q,k,v}_proj, {q,k,v}_conv1d, f_a_proj, f_b_proj, A_log [1,1,H,1],
               dt_bias, b_proj, g_a_proj / g_b_proj, o_norm, o_proj (KDA); q_proj or q_a_proj / q_a_layernorm /
               q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj (MLA);
               block_sparse_moe.gate.weight, gate.e_score_correction_bias, experts.{j}.w1 / w3 / w2 (gate / up /
               down), shared_experts.{gate,up,down}_proj; dense layers mlp.{gate,up,down}_proj.
  kimi_k3      as kimi_linear under language_model.model.* (lm head language_model.lm_head.weight), A_log
               [max(H, head_dim)] zero-padded (the release: F32 [128] for 96 heads),
               full-rank KDA g_proj, MLA output gate self_attn.g_proj, Stable LatentMoE
               block_sparse_moe.routed_expert_down_proj / routed_expert_norm / routed_expert_up_proj; a DSA indexer
               (K3.1 Pro) as DeepSeek-V3.2 names it. The vision tower (vision_tower.*, mm_projector.*: top-level
               names) is skipped on import (`Family.skip_prefixes`), counted in one line.
  deepseek_v3  (also kimi_k2, deepseek_v32) MLA as above; DSA indexer self_attn.indexer.{wq_b, wk, k_norm,
               weights_proj}; mlp.gate.weight, mlp.gate.e_score_correction_bias, mlp.experts.{j}.{gate,up,down}_proj,
               mlp.shared_experts.{gate,up,down}_proj.
  qwen3_moe    self_attn.{q,k,v,o}_proj, q_norm, k_norm; mlp.gate.weight, mlp.experts.{j}.{gate,up,down}_proj.
  mixtral      self_attn.{q,k,v,o}_proj; block_sparse_moe.gate.weight, block_sparse_moe.experts.{j}.w1 / w3 / w2.
Everywhere: embed_tokens, layers.{i}.input_layernorm / post_attention_layernorm, norm, lm_head (absent when tied).
Attention Residuals (kimi_k3 / kimi_linear with attn_res_block_size): layers.{i}.self_attention_res_norm.weight [D]
and self_attention_res_proj.weight [1, D] (the mix before the mixer), mlp_res_norm / mlp_res_proj (before the FFN),
output_attn_res_norm / output_attn_res_proj next to norm (moestack: attn_res / ffn_res / out_res .norm_weight and
.proj_weight, same shapes).

Quantised tensors (compressed-tensors `weight_packed` / `weight_scale`, e.g. the released K3's MXFP4 routed
experts) are named here by their logical `.weight`; moestack/train/convert.py maps the parts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moestack.config.base import ConfigError
from moestack.config.model_spec import ModelSpec


@dataclass(frozen=True)
class Family:
    """How one HF family names things (module docstring)."""

    prefix: str  # before "embed_tokens", "layers.{i}", "norm"
    head: str  # the LM head's weight
    moe: str  # MoE block: "block_sparse_moe" or "mlp"
    experts: tuple[str, str, str]  # per-expert gate, up, down module names
    a_log_shape: str = "flat"  # "flat" [H], "4d" [1, 1, H, 1] or "padded" [max(H, head_dim)] (zero tail)
    fp32: tuple[str, ...] = ()  # HF tensors kept in fp32 on export without a recorded layout (name suffixes)
    skip_prefixes: tuple[str, ...] = ()  # HF tensors of parts moestack does not train (vision tower): skipped


_KIMI_FP32 = ("A_log", "dt_bias", "conv1d.weight", "o_norm.weight", "e_score_correction_bias")
FAMILIES: dict[str, Family] = {
    "kimi_k3": Family("language_model.model.", "language_model.lm_head.weight", "block_sparse_moe",
                      ("w1", "w3", "w2"), "padded", _KIMI_FP32, ("vision_tower.", "mm_projector.")),
    "kimi_linear": Family("model.", "lm_head.weight", "block_sparse_moe", ("w1", "w3", "w2"), "4d", _KIMI_FP32),
    "deepseek_v3": Family("model.", "lm_head.weight", "mlp", ("gate_proj", "up_proj", "down_proj"),
                          fp32=("e_score_correction_bias",)),
    "qwen3_moe": Family("model.", "lm_head.weight", "mlp", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": Family("model.", "lm_head.weight", "block_sparse_moe", ("w1", "w3", "w2")),
}
ALIASES = {"kimi_k2": "deepseek_v3", "deepseek_v32": "deepseek_v3"}

# moestack attention module path -> HF (the part after "attn." / "self_attn."; unlisted names are the same)
_ATTN_RENAMES = {
    "q_conv": "q_conv1d",
    "k_conv": "k_conv1d",
    "v_conv": "v_conv1d",
    "q_a_norm": "q_a_layernorm",
    "kv_a_proj": "kv_a_proj_with_mqa",
    "kv_a_norm": "kv_a_layernorm",
    "indexer.wq": "indexer.wq_b",
}
# moestack MoE module path -> HF, under the family's MoE block (experts are ExpertStack rules)
_MOE_RENAMES = {
    "router.weight": "gate.weight",
    "router.selection_bias": "gate.e_score_correction_bias",
    "down_proj.weight": "routed_expert_down_proj.weight",
    "latent_norm.weight": "routed_expert_norm.weight",
    "up_proj.weight": "routed_expert_up_proj.weight",
}


# Attention Residual mixes of a block: moestack module -> HF prefix of its norm / proj tensors
_ATTN_RES = {"attn_res": "self_attention_res", "ffn_res": "mlp_res"}


@dataclass(frozen=True)
class Direct:
    ms: str
    hf: str
    ms_shape: tuple[int, ...]
    hf_shape: tuple[int, ...]
    pad: bool = False  # 1-D, the HF tensor may be longer: the moestack values first, then zeros


@dataclass(frozen=True)
class ExpertStack:
    """ms [E, P*R, C] <-> hf[j][p] [R, C] for expert j and part p (P = 2: gate, up; P = 1: down)."""

    ms: str
    hf: tuple[tuple[str, ...], ...]  # [expert][part]
    ms_shape: tuple[int, ...]

    @property
    def part_shape(self) -> tuple[int, int]:
        E, PR, C = self.ms_shape
        return PR // len(self.hf[0]), C

    def slot(self, j: int, p: int) -> tuple[int, slice]:
        """Where HF tensor hf[j][p] lives in the fused tensor: (expert index, row slice)."""
        rows = self.part_shape[0]
        return j, slice(p * rows, (p + 1) * rows)


Rule = Direct | ExpertStack


@dataclass
class NameMap:
    """All rules for one (spec, family); `by_hf` finds the rule (and expert slot) of an HF tensor name."""

    family: str
    model: str  # "model '<name>'", for messages
    rules: list[Rule]
    tied: list[tuple[str, str]]  # (moestack name, the moestack name it is tied to): not stored in HF
    fp32: tuple[str, ...]
    skip_prefixes: tuple[str, ...] = ()
    by_hf: dict[str, tuple[Rule, tuple[int, int] | None]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for rule in self.rules:
            if isinstance(rule, Direct):
                self._add(rule.hf, rule, None)
            else:
                for j, parts in enumerate(rule.hf):
                    for p, name in enumerate(parts):
                        self._add(name, rule, (j, p))

    def _add(self, name: str, rule: Rule, slot: tuple[int, int] | None) -> None:
        assert name not in self.by_hf, f"two moestack tensors map to the HF name {name}"
        self.by_hf[name] = (rule, slot)

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every HF tensor name this map expects, with its shape, in model order."""
        out = {}
        for rule in self.rules:
            if isinstance(rule, Direct):
                out[rule.hf] = rule.hf_shape
            else:
                for parts in rule.hf:
                    for name in parts:
                        out[name] = rule.part_shape
        return out

    def keep_fp32(self, hf_name: str) -> bool:
        return any(hf_name.endswith(s) for s in self.fp32)


def resolve_family(spec: ModelSpec, family: str | None = None) -> str:
    """The family to name tensors by: `family`, else spec.family (the HF model_type it came from)."""
    name = family or spec.family
    if name is None:
        raise ConfigError(
            f"convert: model '{spec.name}' has no family (HF model_type); pass --family, one of "
            f"{', '.join(supported_families())}"
        )
    name = ALIASES.get(name, name)
    if name not in FAMILIES:
        raise ConfigError(f"convert: family '{name}' has no name map; supported: {', '.join(supported_families())}")
    return name


def supported_families() -> list[str]:
    return sorted(set(FAMILIES) | set(ALIASES))


def model_state_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the moestack state dict of `spec` (built on meta: no memory)."""
    from moestack.model.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(spec)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def build_name_map(spec: ModelSpec, family: str | None = None) -> NameMap:
    """Rules for every tensor of `spec`'s moestack state dict in `family`'s naming (module docstring)."""
    fam_name = resolve_family(spec, family)
    fam = FAMILIES[fam_name]
    shapes = model_state_shapes(spec)
    kinds = spec.layer_kinds()
    rules: list[Rule] = []
    tied = []
    unmapped = []
    for ms, shape in shapes.items():
        if ms == "lm_head.weight" and spec.tie_word_embeddings:
            tied.append((ms, "embed.weight"))
            continue
        rule = _rule(ms, shape, fam, kinds, spec)
        if rule is None:
            unmapped.append(ms)
        else:
            rules.append(rule)
    if unmapped:
        raise ConfigError(f"convert: family {fam_name} has no HF name for moestack tensors {', '.join(unmapped)}")
    return NameMap(fam_name, f"model '{spec.name}'", rules, tied, fam.fp32, fam.skip_prefixes)


def _rule(ms: str, shape: tuple[int, ...], fam: Family, kinds, spec: ModelSpec) -> Rule | None:
    P = fam.prefix
    top = {"embed.weight": P + "embed_tokens.weight", "norm.weight": P + "norm.weight", "lm_head.weight": fam.head,
           "out_res.norm_weight": P + "output_attn_res_norm.weight",
           "out_res.proj_weight": P + "output_attn_res_proj.weight"}
    if ms in top:
        return Direct(ms, top[ms], shape, shape)
    parts = ms.split(".")
    if parts[0] != "layers" or len(parts) < 4:
        return None
    i, sub, rest = int(parts[1]), parts[2], ".".join(parts[3:])
    layer = f"{P}layers.{i}."
    if sub == "attn_norm":
        return Direct(ms, layer + "input_layernorm." + rest, shape, shape)
    if sub == "ffn_norm":
        return Direct(ms, layer + "post_attention_layernorm." + rest, shape, shape)
    if sub in _ATTN_RES and rest in ("norm_weight", "proj_weight"):
        return Direct(ms, f"{layer}{_ATTN_RES[sub]}_{rest.removesuffix('_weight')}.weight", shape, shape)
    if sub == "attn":
        module, _, leaf = rest.rpartition(".")
        if not module:  # a bare parameter of the mixer: A_log, dt_bias
            module, leaf = rest, ""
        hf_module = _ATTN_RENAMES.get(module, module)
        hf = layer + "self_attn." + hf_module + (f".{leaf}" if leaf else "")
        hf_shape = shape
        if rest == "A_log" and fam.a_log_shape == "4d":
            hf_shape = (1, 1, shape[0], 1)
        if rest == "A_log" and fam.a_log_shape == "padded":
            return Direct(ms, hf, shape, (max(shape[0], spec.kda.head_dim),), pad=True)
        return Direct(ms, hf, shape, hf_shape)
    if sub == "ffn":
        if kinds[i].ffn == "dense":
            return Direct(ms, layer + "mlp." + rest, shape, shape)
        block = layer + fam.moe + "."
        if rest in _MOE_RENAMES:
            return Direct(ms, block + _MOE_RENAMES[rest], shape, shape)
        if rest.startswith("shared."):
            return Direct(ms, block + "shared_experts." + rest.removeprefix("shared."), shape, shape)
        gate, up, down = fam.experts
        if rest == "experts.w_gate_up":
            names = tuple((f"{block}experts.{j}.{gate}.weight", f"{block}experts.{j}.{up}.weight")
                          for j in range(shape[0]))
            return ExpertStack(ms, names, shape)
        if rest == "experts.w_down":
            return ExpertStack(ms, tuple((f"{block}experts.{j}.{down}.weight",) for j in range(shape[0])), shape)
    return None
