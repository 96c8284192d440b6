"""ModelSpec: the single source of truth for model shapes (MODEL.md).

A model is `num_layers` blocks. Each block has a token mixer and a feed-forward part:
  mixer: the full-attention kind (`attention`: "mla" = Gated MLA/DSA, "gqa" = softmax GQA) at the 1-based
         positions in `full_attention_layers`, the linear-attention kind (`linear_attention`: "kda") elsewhere;
  ffn:   a dense GLU MLP at the 1-based positions in `dense_layers` (or everywhere when `moe` is None),
         the (Latent)MoE elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from moestack.config.base import ConfigError, StrictModel, read_yaml, validate

PRESET_DIR = Path(__file__).parent / "presets"

PosInt = Field(gt=0)


class KDASpec(StrictModel):
    """Kimi Delta Attention (gated delta rule with per-channel decay)."""

    num_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0, le=256)  # dk = dv; kernels support up to 256
    conv_kernel_size: int = Field(default=4, ge=1)  # depthwise causal short conv on q, k, v
    # "k3": g = gate_lower_bound * sigmoid(exp(A_log) * (x + dt_bias))   (log-decay in (lower_bound, 0))
    # "kimi_linear": g = -exp(A_log) * softplus(x + dt_bias)
    gate: Literal["k3", "kimi_linear"] = "k3"
    gate_lower_bound: float = Field(default=-5.0, lt=0)
    # decay per key channel (KDA) or one scalar per head (Gated DeltaNet, Qwen3-Next)
    decay: Literal["channel", "head"] = "channel"
    gate_rank: int | None = Field(default=128, gt=0)  # low-rank decay input d -> r -> H*dk; None = direct d -> H*dk
    output_gate_rank: int | None = Field(default=None, gt=0)  # None = full-rank g_proj (K3); r = d -> r -> H*dv
    chunk_size: int = Field(default=64, gt=0)
    l2_eps: float = Field(default=1e-6, gt=0)

    @model_validator(mode="after")
    def _check(self) -> KDASpec:
        if self.chunk_size & (self.chunk_size - 1):
            raise ValueError(f"chunk_size must be a power of two, got {self.chunk_size}")
        return self


class IndexerSpec(StrictModel):
    """DSA lightning indexer: I[t,s] = sum_j w[t,j] * ReLU(q_idx[t,j] . k_idx[s]); keep top_k keys per query."""

    num_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    top_k: int = Field(gt=0)


class MLASpec(StrictModel):
    """Multi-head latent attention (DeepSeek-V2/V3), optional sigmoid output gate and DSA indexer."""

    num_heads: int = Field(gt=0)
    q_lora_rank: int | None = Field(default=None, gt=0)  # None: q = W_q x directly
    kv_lora_rank: int = Field(gt=0)
    qk_nope_head_dim: int = Field(gt=0)
    qk_rope_head_dim: int = Field(ge=0)
    v_head_dim: int = Field(gt=0)
    use_rope: bool = False  # K3 is NoPE: rope dims exist but are never rotated
    rope_theta: float = Field(default=10000.0, gt=0)
    output_gate: bool = True  # attn_out * sigmoid(g_proj(x)) before o_proj
    indexer: IndexerSpec | None = None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim**-0.5


class GQASpec(StrictModel):
    """Softmax grouped-query attention (Llama / Mixtral / Qwen3 families)."""

    num_heads: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int | None = Field(default=None, gt=0)  # None: hidden_size // num_heads
    qk_norm: bool = False
    qkv_bias: bool = False
    output_gate: bool = False
    use_rope: bool = True
    rope_theta: float = Field(default=10000.0, gt=0)

    @model_validator(mode="after")
    def _check(self) -> GQASpec:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        return self


class RouterSpec(StrictModel):
    """Token-choice router (DeepSeek-V3 / K3 style by default)."""

    score: Literal["sigmoid", "softmax"] = "sigmoid"
    num_groups: int = Field(default=1, gt=0)  # group-limited routing: experts split into groups ...
    topk_groups: int = Field(default=1, gt=0)  # ... and only the best `topk_groups` groups are eligible
    renormalize: bool = True
    scaling_factor: float = Field(default=1.0, gt=0)
    selection_bias: bool = True  # aux-loss-free balancing bias, added for selection only
    bias_update_rate: float = Field(default=1e-3, ge=0)  # gamma in bias += gamma * sign(mean_load - load)
    seq_aux_loss_coef: float = Field(default=1e-4, ge=0)  # alpha of the sequence-wise balance loss


class MoESpec(StrictModel):
    num_experts: int = Field(gt=0)
    top_k: int = Field(gt=0)
    expert_intermediate_size: int = Field(gt=0)
    latent_size: int | None = Field(default=None, gt=0)  # LatentMoE width; None = experts on the full hidden
    latent_norm: bool = True  # RMSNorm on the combined latent ("stable" LatentMoE)
    num_shared_experts: int = Field(default=0, ge=0)
    shared_intermediate_size: int = Field(default=0, ge=0)  # total width of the fused shared experts
    router: RouterSpec = RouterSpec()

    @model_validator(mode="after")
    def _check(self) -> MoESpec:
        r = self.router
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must be <= num_experts ({self.num_experts})")
        if self.num_experts % r.num_groups:
            raise ValueError(f"router.num_groups ({r.num_groups}) must divide num_experts ({self.num_experts})")
        if r.topk_groups > r.num_groups:
            raise ValueError(f"router.topk_groups ({r.topk_groups}) must be <= router.num_groups ({r.num_groups})")
        if self.top_k > r.topk_groups * (self.num_experts // r.num_groups):
            raise ValueError(
                f"top_k ({self.top_k}) exceeds the experts in router.topk_groups ({r.topk_groups}) groups"
            )
        if (self.num_shared_experts > 0) != (self.shared_intermediate_size > 0):
            raise ValueError("num_shared_experts and shared_intermediate_size must both be 0 or both > 0")
        return self


class DenseMLPSpec(StrictModel):
    intermediate_size: int = Field(gt=0)


@dataclass(frozen=True)
class LayerKind:
    mixer: Literal["kda", "mla", "gqa"]
    ffn: Literal["dense", "moe"]


class ModelSpec(StrictModel):
    name: str = "custom"
    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    num_layers: int = Field(gt=0)
    max_seq_len: int = Field(default=4096, gt=0)
    full_attention_layers: list[int] = []  # 1-based; the rest use `linear_attention`
    dense_layers: list[int] = []  # 1-based; dense MLP instead of MoE
    attention: Literal["mla", "gqa"] = "mla"
    linear_attention: Literal["kda"] = "kda"
    kda: KDASpec | None = None
    mla: MLASpec | None = None
    gqa: GQASpec | None = None
    moe: MoESpec | None = None
    dense_mlp: DenseMLPSpec | None = None
    activation: Literal["situ_glu", "swiglu"] = "situ_glu"
    situ_beta: float = Field(default=4.0, gt=0)  # act(g,u) = b*tanh(g/b)*sigmoid(g) * c*tanh(u/c)
    situ_linear_beta: float = Field(default=25.0, gt=0)
    norm_eps: float = Field(default=1e-5, gt=0)
    tie_word_embeddings: bool = False
    init_std: float = Field(default=0.02, gt=0)
    mtp_layers: int = Field(default=0, ge=0)  # next-n prediction layers: counted by the profiler, not trained

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        n = self.num_layers
        for field in ("full_attention_layers", "dense_layers"):
            ids = getattr(self, field)
            bad = [i for i in ids if not 1 <= i <= n]
            if bad:
                raise ValueError(f"{field} entries must be 1-based layer numbers in 1..{n}, got {bad}")
            if len(set(ids)) != len(ids):
                raise ValueError(f"{field} has duplicate entries: {ids}")
        kinds = self.layer_kinds()
        mixers = {k.mixer for k in kinds}
        ffns = {k.ffn for k in kinds}
        for mixer in mixers:
            if getattr(self, mixer) is None:
                raise ValueError(f"layers use mixer '{mixer}' but the '{mixer}' section is missing")
        if "dense" in ffns and self.dense_mlp is None:
            raise ValueError("some layers use a dense MLP but the 'dense_mlp' section is missing")
        if self.moe is not None and self.moe.latent_size is not None and self.moe.latent_size > self.hidden_size:
            raise ValueError(
                f"moe.latent_size ({self.moe.latent_size}) must be <= hidden_size ({self.hidden_size})"
            )
        if self.gqa is not None and self.gqa.head_dim is None and self.hidden_size % self.gqa.num_heads:
            raise ValueError(
                f"gqa.head_dim is unset and hidden_size ({self.hidden_size}) is not divisible by "
                f"gqa.num_heads ({self.gqa.num_heads}); set gqa.head_dim"
            )
        return self

    def layer_kinds(self) -> list[LayerKind]:
        full = set(self.full_attention_layers)
        dense = set(self.dense_layers)
        out = []
        for i in range(1, self.num_layers + 1):
            mixer = self.attention if i in full else self.linear_attention
            ffn = "dense" if (self.moe is None or i in dense) else "moe"
            out.append(LayerKind(mixer, ffn))
        return out

    @property
    def gqa_head_dim(self) -> int:
        assert self.gqa is not None
        return self.gqa.head_dim or self.hidden_size // self.gqa.num_heads


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml") if not p.stem.startswith("cluster-"))


def load_model_spec(name_or_path: str | Path) -> ModelSpec:
    """A preset name (`tiny`, `proxy`, `kimi-k3`, `kimi-k3.1-pro`) or a path to a ModelSpec YAML."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        return validate(ModelSpec, read_yaml(p), str(p))
    preset = PRESET_DIR / f"{name_or_path}.yaml"
    if not preset.is_file():
        raise ConfigError(
            f"model: '{name_or_path}' is neither a preset ({', '.join(list_presets())}) nor a YAML file"
        )
    return validate(ModelSpec, read_yaml(preset), f"preset {name_or_path}")
