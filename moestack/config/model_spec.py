"""ModelSpec: the single source of truth for model shapes (MODEL.md).

A model is `num_layers` blocks. Each block has a token mixer and a feed-forward part:
  mixer: the full-attention kind (`attention`: "mla" = Gated MLA/DSA, "gqa" = softmax GQA) at the 1-based
         positions in `full_attention_layers`, the linear-attention kind (`linear_attention`: "kda") elsewhere;
  ffn:   a dense GLU MLP at the 1-based positions in `dense_layers` (or everywhere when `moe` is None),
         the (Latent)MoE elsewhere.
Alternatively `layer_pattern` (Nemotron-H style, one character per layer) gives single-sublayer blocks:
  "M" Mamba-2 mixer, "*" full-attention mixer (`attention`), "E" MoE, "-" dense MLP; such a block has one norm.
Some sections describe architectures that the profiler counts but the model builder cannot build yet
(`ModelSpec.build_support_errors()` lists them; `check_buildable()` raises).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from moestack.config.base import ConfigError, StrictModel, read_yaml, validate

PRESET_DIR = Path(__file__).parent / "presets"

class RopeScalingSpec(StrictModel):
    """RoPE context extension (HF `rope_scaling`), applied where rope is used."""

    type: Literal["yarn", "linear", "dynamic", "llama3"]
    factor: float = Field(gt=0)
    original_max_position_embeddings: int | None = Field(default=None, gt=0)
    beta_fast: float | None = None  # yarn
    beta_slow: float | None = None  # yarn
    mscale: float | None = None  # yarn (DeepSeek)
    mscale_all_dim: float | None = None  # yarn (DeepSeek)
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3


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
    # Gated DeltaNet (Qwen3-Next) has more value heads than q/k heads (q, k shared by num_v_heads // num_heads
    # value heads); None = num_heads. Only with decay "head".
    num_v_heads: int | None = Field(default=None, gt=0)
    output_gate_act: Literal["sigmoid", "silu"] = "sigmoid"  # KDA: sigmoid(g_proj x); Gated DeltaNet: silu(z)

    @model_validator(mode="after")
    def _check(self) -> KDASpec:
        if self.chunk_size & (self.chunk_size - 1):
            raise ValueError(f"chunk_size must be a power of two, got {self.chunk_size}")
        hv = self.value_heads
        if hv != self.num_heads:
            if self.decay != "head":
                raise ValueError(f"num_v_heads ({hv}) != num_heads ({self.num_heads}) needs decay 'head'")
            if hv % self.num_heads:
                raise ValueError(f"num_v_heads ({hv}) must be a multiple of num_heads ({self.num_heads})")
        return self

    @property
    def value_heads(self) -> int:
        return self.num_v_heads or self.num_heads


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
    rope_scaling: RopeScalingSpec | None = None
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
    rope_fraction: float = Field(default=1.0, gt=0, le=1)  # partial rotary: rotate this fraction of head_dim
    rope_scaling: RopeScalingSpec | None = None

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
    # how the selection bias moves once per optimizer step: "sign" (DeepSeek-V3, the rate above) or "quantile"
    # (Kimi K3's quantile balancing: set to the bias that balances the step's tokens, solved from a histogram of
    # quantile_bins bins per expert; moestack/ops/moe/quantile.py)
    bias_update: Literal["sign", "quantile"] = "sign"
    quantile_bins: int = Field(default=1000, ge=8)
    # "step": the bias solved from the whole last step routes this one (Kimi K3); "batch": each training micro-batch
    # also solves its own bias before routing, quantile_iterations coordinate steps over the stage's ranks (no lag
    # behind a fast-moving router; the step's mean solved bias becomes the model's, used by evaluation, inference and
    # the next step's first coordinate step)
    quantile_scope: Literal["step", "batch"] = "batch"
    # 4: on a router with saturated scores the coordinate steps reach max/mean 1.11 after 2, 1.02 after 4
    # (tests/ops/test_moe_quantile.py::test_batch_bias_resolves_saturated_scores_like_the_exact_steps)
    quantile_iterations: int = Field(default=4, ge=1)
    # where batch scope's coordinate steps start: "bias" (the router's bias: the last step's solves), "zero", or
    # "best" (both, the one with the lower routed max load; moestack/ops/moe/quantile.py::solve_batch_bias)
    quantile_start: Literal["bias", "zero", "best"] = "best"
    # beta of batch scope's extrapolation: each coordinate step after the second starts from y + beta * (y - y_prev)
    # (the last read and its change), from y alone after a step that reversed the previous change; 0 = plain steps
    # (moestack/ops/moe/quantile.py::extrapolate; benchmarks/RESULTS.md, "Expert balance")
    quantile_momentum: float = Field(default=0.0, ge=0, lt=1)
    # eps of the selection jitter: eps * U[0, 1) per (token, expert), a hash of the slot and the step, added to the
    # scores that choose experts in training forwards (never to the routing weights). A per-expert bias cannot split
    # tokens with (near) equal scores, e.g. the many alike tokens of byte-level text; the jitter makes them distinct.
    # 0 = off (moestack/ops/moe/reference.py::selection_jitter; benchmarks/RESULTS.md, "Expert balance")
    selection_jitter: float = Field(default=0.0, ge=0, le=1)
    # Qwen3's global-batch balance loss: coef * E * sum_i f_i P_i with f_i the load fraction of the whole step's
    # batch (all micro-batches so far, all data-parallel ranks), P_i the mean normalised score of this micro-batch
    global_aux_loss_coef: float = Field(default=0.0, ge=0)
    z_loss_coef: float = Field(default=0.0, ge=0)  # router z-loss (ST-MoE): coef * mean_t logsumexp(logits_t)^2
    # multiplier of the optimizer's learning rate for the router weight (its own parameter group): Adam moves every
    # element by ~lr per step whatever the gradient's size, which shifts router logits by up to lr * hidden per step
    # and makes a bias solved on the last step stale (benchmarks/RESULTS.md, "Expert balance")
    lr_scale: float = Field(default=1.0, gt=0)

    @model_validator(mode="after")
    def _check(self) -> RouterSpec:
        if self.selection_jitter > 0 and not self.selection_bias:
            raise ValueError("router.selection_jitter only helps the selection bias split alike tokens; set "
                             "selection_bias: true or selection_jitter: 0")
        return self


class MoESpec(StrictModel):
    num_experts: int = Field(gt=0)
    top_k: int = Field(gt=0)
    expert_intermediate_size: int = Field(gt=0)
    latent_size: int | None = Field(default=None, gt=0)  # LatentMoE width; None = experts on the full hidden
    latent_norm: bool = True  # RMSNorm on the combined latent ("stable" LatentMoE)
    num_shared_experts: int = Field(default=0, ge=0)
    shared_intermediate_size: int = Field(default=0, ge=0)  # total width of the fused shared experts
    shared_expert_gate: bool = False  # shared(x) * sigmoid(w . x), w [d] (Qwen2-MoE / Qwen3-Next)
    router: RouterSpec = RouterSpec()
    # static-capacity, sync-free token layout: rows per expert = ceil(factor * T*K / E); overflow dropped by
    # routing weight (counted in MoE.last_dropped). None = dropless (default).
    capacity_factor: float | None = Field(default=None, gt=0)

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
        if r.bias_update == "quantile":
            if not r.selection_bias:
                raise ValueError("router.bias_update 'quantile' moves the selection bias: set router.selection_bias "
                                 "true, or use bias_update 'sign' with bias_update_rate 0")
            if r.num_groups > 1:
                raise ValueError(f"router.bias_update 'quantile' does not model group-limited routing (num_groups "
                                 f"{r.num_groups}); use bias_update 'sign' or num_groups 1")
            if self.top_k >= self.num_experts:
                raise ValueError(f"router.bias_update 'quantile' needs top_k ({self.top_k}) < num_experts "
                                 f"({self.num_experts})")
        if r.quantile_momentum > 0 and (r.bias_update, r.quantile_scope) != ("quantile", "batch"):
            raise ValueError(f"router.quantile_momentum ({r.quantile_momentum}) extrapolates batch scope's solves: "
                             f"set bias_update 'quantile' with quantile_scope 'batch', or quantile_momentum 0")
        if (self.num_shared_experts > 0) != (self.shared_intermediate_size > 0):
            raise ValueError("num_shared_experts and shared_intermediate_size must both be 0 or both > 0")
        if self.shared_expert_gate and self.num_shared_experts == 0:
            raise ValueError("shared_expert_gate needs shared experts (num_shared_experts > 0)")
        return self


class DenseMLPSpec(StrictModel):
    intermediate_size: int = Field(gt=0)


class Mamba2Spec(StrictModel):
    """Mamba-2 (SSD) mixer as in Nemotron-H: in_proj d -> [z, x, B, C, dt], causal conv on [x, B, C], selective
    scan, gated RMSNorm, out_proj. Profiled only: the model builder does not build Mamba layers."""

    num_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)  # d_inner = num_heads * head_dim
    state_size: int = Field(gt=0)
    num_groups: int = Field(default=1, gt=0)  # B, C groups
    conv_kernel_size: int = Field(default=4, ge=1)
    conv_bias: bool = True
    proj_bias: bool = False
    chunk_size: int = Field(default=128, gt=0)
    time_step_min: float = Field(default=1e-3, gt=0)
    time_step_max: float = Field(default=1e-1, gt=0)
    time_step_floor: float = Field(default=1e-4, ge=0)

    @property
    def inner_size(self) -> int:
        return self.num_heads * self.head_dim


# layer_pattern character -> (mixer, ffn); "attention" stands for ModelSpec.attention
LAYER_PATTERN_CHARS = {
    "M": ("mamba2", "none"),
    "*": ("attention", "none"),
    "E": ("none", "moe"),
    "-": ("none", "dense"),
}


@dataclass(frozen=True)
class LayerKind:
    # "mamba2" and "none" occur only with `layer_pattern` (single-sublayer blocks, Nemotron-H)
    mixer: Literal["kda", "mla", "gqa", "mamba2", "none"]
    ffn: Literal["dense", "moe", "none"]
    window: int | None = None  # sliding-window attention: keys per query (GQA layers in sliding_window_layers)


class ModelSpec(StrictModel):
    name: str = "custom"
    family: str | None = None  # source family tag, e.g. the HF model_type ("kimi_k3", "deepseek_v3", ...)
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
    mamba2: Mamba2Spec | None = None
    layer_pattern: str | None = None  # Nemotron-H style per-layer string (module docstring); overrides the lists
    # relu2 / gelu: non-gated one-matrix-up MLPs (relu(x)^2; GPT-2/3's tanh GeLU)
    activation: Literal["situ_glu", "swiglu", "relu2", "gelu"] = "situ_glu"
    situ_beta: float = Field(default=4.0, gt=0)  # act(g,u) = b*tanh(g/b)*sigmoid(g) * c*tanh(u/c)
    situ_linear_beta: float = Field(default=25.0, gt=0)
    norm_eps: float = Field(default=1e-5, gt=0)
    tie_word_embeddings: bool = False
    init_std: float = Field(default=0.02, gt=0)
    mtp_layers: int = Field(default=0, ge=0)  # next-n prediction layers: counted by the profiler, not trained
    # blocks of one MTP module in layer_pattern notation; None: one block like a full-attention layer + FFN
    mtp_pattern: str | None = None
    attn_res_block_size: int | None = Field(default=None, gt=0)  # Attention Residuals (arXiv:2603.15031)
    # GPT-2/3-style parts (profiled and priced; the model builder does not build them: build_support_errors)
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"  # layernorm: weight and bias per norm, saves mean and rstd
    learned_positions: bool = False  # a [max_seq_len, hidden] position table added to the token embedding
    linear_bias: bool = False  # biases on the attention output projection and the MLP / expert layers
    # sliding-window attention (GPT-OSS, Mistral): GQA layers listed here attend to the last `sliding_window` keys
    sliding_window: int | None = Field(default=None, gt=0)
    sliding_window_layers: list[int] = []  # 1-based

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
        for field in ("layer_pattern", "mtp_pattern"):
            pattern = getattr(self, field)
            bad_chars = sorted(set(pattern or "") - set(LAYER_PATTERN_CHARS))
            if bad_chars:
                raise ValueError(f"{field} may only use {''.join(LAYER_PATTERN_CHARS)}, got {bad_chars}")
        if self.layer_pattern is not None:
            if len(self.layer_pattern) != n:
                raise ValueError(f"layer_pattern has {len(self.layer_pattern)} layers but num_layers is {n}")
            if self.full_attention_layers or self.dense_layers:
                raise ValueError("layer_pattern replaces full_attention_layers and dense_layers; leave them empty")
        kinds = self.layer_kinds()
        mixers = {k.mixer for k in kinds} - {"none"}
        ffns = {k.ffn for k in kinds}
        for mixer in mixers:
            if getattr(self, mixer) is None:
                raise ValueError(f"layers use mixer '{mixer}' but the '{mixer}' section is missing")
        if "dense" in ffns and self.dense_mlp is None:
            raise ValueError("some layers use a dense MLP but the 'dense_mlp' section is missing")
        if "moe" in ffns and self.moe is None:
            raise ValueError("some layers use a MoE but the 'moe' section is missing")
        if self.moe is not None and self.moe.latent_size is not None and self.moe.latent_size > self.hidden_size:
            raise ValueError(
                f"moe.latent_size ({self.moe.latent_size}) must be <= hidden_size ({self.hidden_size})"
            )
        self._check_sliding_window()
        if self.gqa is not None and self.gqa.head_dim is None and self.hidden_size % self.gqa.num_heads:
            raise ValueError(
                f"gqa.head_dim is unset and hidden_size ({self.hidden_size}) is not divisible by "
                f"gqa.num_heads ({self.gqa.num_heads}); set gqa.head_dim"
            )
        return self

    def _check_sliding_window(self) -> None:
        ids = self.sliding_window_layers
        if not ids:
            return
        if self.sliding_window is None:
            raise ValueError("sliding_window_layers is set but sliding_window (keys per query) is not")
        bad = [i for i in ids if not 1 <= i <= self.num_layers]
        if bad or len(set(ids)) != len(ids):
            raise ValueError(f"sliding_window_layers must be distinct 1-based layer numbers in 1..{self.num_layers}")
        if self.layer_pattern is not None or self.attention != "gqa":
            raise ValueError("sliding_window_layers applies to GQA full-attention layers (attention: gqa, no "
                             "layer_pattern)")
        linear = sorted(set(ids) - set(self.full_attention_layers))
        if linear:
            raise ValueError(f"sliding_window_layers {linear} are not in full_attention_layers")

    @property
    def gated_mlp(self) -> bool:
        """GLU MLPs (gate and up matrices) unless the activation is a one-matrix relu2 / gelu."""
        return self.activation not in ("relu2", "gelu")

    def layer_kinds(self) -> list[LayerKind]:
        if self.layer_pattern is not None:
            return [self._pattern_kind(c) for c in self.layer_pattern]
        full = set(self.full_attention_layers)
        dense = set(self.dense_layers)
        window = set(self.sliding_window_layers)
        out = []
        for i in range(1, self.num_layers + 1):
            mixer = self.attention if i in full else self.linear_attention
            ffn = "dense" if (self.moe is None or i in dense) else "moe"
            out.append(LayerKind(mixer, ffn, self.sliding_window if i in window else None))
        return out

    def _pattern_kind(self, char: str) -> LayerKind:
        mixer, ffn = LAYER_PATTERN_CHARS[char]
        return LayerKind(self.attention if mixer == "attention" else mixer, ffn)

    def attn_res_blocks_before(self, layer: int) -> int:
        """Completed Attention-Residual blocks entering 0-based `layer` (the embedding is the first; a block is
        completed at each layer whose index is a multiple of attn_res_block_size): ceil(layer / block size).
        0 without Attention Residuals. `layer` = num_layers gives what the output aggregation reads."""
        size = self.attn_res_block_size
        return 0 if size is None else -(-layer // size)

    def attn_res_sources(self, layer: int) -> tuple[int, int]:
        """Sources of 0-based `layer`'s two Attention-Residual mixes (before the mixer, before the FFN): the
        completed blocks, plus the current block's partial sum unless the layer starts a block (mixer)."""
        n = self.attn_res_blocks_before(layer + 1)  # completed blocks during the layer (incl. one it closes)
        starts = layer % self.attn_res_block_size == 0
        return n + (0 if starts else 1), n + 1

    def mtp_block_kinds(self) -> list[LayerKind]:
        """Blocks of one MTP (next-n prediction) module; [] when mtp_layers is 0."""
        if self.mtp_layers == 0:
            return []
        if self.mtp_pattern is not None:
            return [self._pattern_kind(c) for c in self.mtp_pattern]
        return [LayerKind(self.attention, "dense" if self.moe is None else "moe")]

    def build_support_errors(self) -> list[str]:
        """Features in this spec that moestack.model cannot build yet (the profiler still counts them)."""
        errors = []
        kinds = self.layer_kinds()
        mamba = [i for i, k in enumerate(kinds, 1) if k.mixer == "mamba2"]
        if mamba:
            errors.append(f"not supported: mamba layers (layers {_short_list(mamba)})")
        elif self.layer_pattern is not None:
            errors.append("not supported: single-sublayer blocks (layer_pattern)")
        if not self.gated_mlp:
            errors.append(f"not supported: {self.activation} (non-gated) MLPs")
        if self.norm != "rmsnorm":
            errors.append(f"not supported: {self.norm}")
        if self.learned_positions:
            errors.append("not supported: learned position embeddings")
        if self.linear_bias:
            errors.append("not supported: linear_bias")
        if self.sliding_window_layers:
            errors.append("not supported: sliding-window attention (sliding_window_layers)")
        if self.moe is not None and self.moe.shared_expert_gate:
            errors.append("not supported: moe.shared_expert_gate")
        for name in ("mla", "gqa"):
            sec = getattr(self, name)
            if sec is not None and sec.rope_scaling is not None and (name, sec.rope_scaling.type) != ("mla", "yarn"):
                errors.append(f"not supported: {name}.rope_scaling ({sec.rope_scaling.type})")
        return errors

    def check_buildable(self) -> None:
        """Raise ConfigError naming every feature the model builder does not support (see build_support_errors)."""
        errors = self.build_support_errors()
        if errors:
            raise ConfigError(f"model '{self.name}': " + "; ".join(errors) + " (`moestack profile` can still count it)")

    @property
    def gqa_head_dim(self) -> int:
        assert self.gqa is not None
        return self.gqa.head_dim or self.hidden_size // self.gqa.num_heads


def _short_list(ids: list[int], limit: int = 8) -> str:
    head = ", ".join(str(i) for i in ids[:limit])
    return head + (f", ... ({len(ids)} in all)" if len(ids) > limit else "")


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
