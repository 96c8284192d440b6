"""Scale a model down to a proxy of the same family that trains on a memory budget (`moestack adapt`).

One knob, the hidden size d, drives every width; the other sizes follow from the source's own ratios:
  depth    the mixer pattern's repeating unit (K3: KDA, KDA, KDA, MLA) repeated round(R * r) times (R = the source's
           repetitions, r = d / d_source); the leading dense-FFN layers kept (at least one if the source has any).
  KDA      head_dim kept (64 / 128: kernel shapes); heads = round(H * r) (value heads keep their ratio to q/k heads);
           the low-rank gate / output-gate ranks kept.
  MLA      head dims (qk_nope, qk_rope, v) and kv_lora_rank kept (capped at d); heads = round(H * r); q_lora_rank
           scaled with d, at least kv_lora_rank; indexer heads and head_dim kept, top_k capped at seq_len / 2.
  GQA      head_dim kept; kv heads = round(G * r), query heads keep the H / G ratio.
  MoE      latent, expert and shared widths scaled with d (multiples of 64); experts and top-k divided by one common
           factor so that experts / top-k (the sparsity) is the source's; shared-expert count kept; router groups
           kept where they still divide the experts.
  dense    intermediate size scaled with d (a multiple of 128). Vocabulary kept (the tokenizer's).
The proxy is the largest d (a multiple of 128) whose training memory fits the budget:

  memory = 16 B x params                         fp32 weights + fp32 grads + AdamW m, v (what the trainer holds)
         + tokens x activation bytes per token   profile_model's bytes saved for backward (bf16, fused kernels)
           x act_factor                           what moestack's modules really keep (GPU_ACT_FACTOR under bf16
                                                  autocast, CPU_ACT_FACTOR for fp32 reference kernels on a CPU)
         + loss chunk                             min(tokens, 4096) x vocab x LOSS_BYTES_PER_LOGIT (chunked CE)
         + runtime reserve                        CUDA context / Python and torch on a CPU
  fits when memory <= budget x (1 - margin).

Features the model builder cannot build are dropped with a note when the proxy can do without them (RoPE scaling,
the shared-expert gate, MTP modules); anything else (Mamba layers, relu2 MLPs) is an error. Attention Residuals are
kept with the source's number of blocks (the block size scaled with the layer count).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel

from moestack.config.base import ConfigError, validate
from moestack.config.model_spec import LayerKind, ModelSpec
from moestack.planner.profile import ArchProfile, profile_model

GIB = 2**30
ADAM_BYTES_PER_PARAM = 16  # fp32 weight 4 + fp32 grad 4 + AdamW m 4 + v 4
# Saved-activation multipliers over the profile's estimate (bf16, fused kernels). Measured on CPU (fp32, reference
# kernels, saved_tensors_hooks): KDA 3.8x, MoE 3.5x, dense MLP 5x, MLA 1.2x of the fp32 estimate, ~3.4x overall:
# the elementwise SiTU-GLU keeps six fp32 tensors per expert row where a fused kernel keeps three bf16 ones, and
# the reference KDA keeps its chunk intermediates. On a GPU (bf16 autocast, fused KDA) the GLU part remains.
GPU_ACT_FACTOR = 5.5  # measured 4.9 on the proxy, H200, reference KDA/DSA ops (RESULTS.md)
CPU_ACT_FACTOR = 8.0  # 2 (fp32) x ~4 (reference kernels)
LOSS_CHUNK_TOKENS = 4096  # moestack.model.loss.chunked_cross_entropy's default chunk
LOSS_BYTES_PER_LOGIT = 12  # bf16 logits + fp32 copy + fp32 gradient of one chunk, alive together in backward
DEFAULT_MARGIN = 0.10
HIDDEN_STEP = 128


@dataclass(frozen=True)
class FitTarget:
    """A memory budget: one device's memory (HBM or host RAM), bytes."""

    name: str
    memory_bytes: float
    kind: Literal["gpu", "cpu"]
    reserved_bytes: float  # runtime memory the model cannot use (CUDA context + allocator, or Python + torch)
    seq_len: int  # default training shape on this kind of device
    batch: int


# Device name -> (memory GiB as the runtime reports it, kind). GPU numbers match the cluster presets
# (moestack/config/presets/cluster-*.yaml) where one exists; others: vendor capacity as nvidia-smi reports it.
DEVICES: dict[str, tuple[float, str]] = {
    "h200": (140.4, "gpu"),  # 143771 MiB
    "h100": (79.6, "gpu"),  # 81559 MiB
    "h800": (79.6, "gpu"),
    "a100-80g": (79.2, "gpu"),  # 81251 MiB
    "a100-40g": (39.4, "gpu"),  # 40338 MiB
    "b200": (179.1, "gpu"),  # 183359 MiB
    "gb200": (186.0, "gpu"),
    "l40s": (44.5, "gpu"),
    "rtx4090": (23.6, "gpu"),
}
GPU_RESERVED_GIB = 3.0  # moestack/planner/calibrations/h200-measured.json runtime_reserved_gib
CPU_RESERVED_GIB = 1.0
GPU_SHAPE = (4096, 2)  # seq_len, micro-batch
CPU_SHAPE = (512, 2)
_UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_fit(text: str) -> FitTarget:
    """`--fit` value -> FitTarget: a device name (h200, h100, a100-80g, b200, ...), `cpu-<N>g` (a CPU with N GiB),
    or a memory amount ("141GB", "8GiB", "80G": GB/G = 1e9 bytes, GiB = 2**30). Amounts are taken as accelerator
    memory (bf16 training); pass precision fp32 to `adapt_model` for a CPU."""
    key = text.strip().lower()
    if key in DEVICES:
        gib, kind = DEVICES[key]
        return _target(key, gib * GIB, kind)
    m = re.fullmatch(r"cpu-(\d+(?:\.\d+)?)g(?:ib|b)?", key)
    if m:
        return _target(key, float(m.group(1)) * GIB, "cpu")
    nbytes = parse_bytes(text)
    if nbytes is not None and nbytes > 0:
        return _target(text.strip(), nbytes, "gpu")
    raise ConfigError(
        f"--fit: '{text}' is neither a device ({', '.join(sorted(DEVICES))}, cpu-<N>g) nor a memory amount "
        "(e.g. 141GB, 8GiB)"
    )


def parse_bytes(text: str) -> float | None:
    """"141GB" -> 141e9, "8GiB" -> 8 * 2**30, "512MB", "80G" (G = GB = 1e9); None if it is not an amount."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-z]+)", text.strip().lower())
    if m is None or m.group(2) not in _UNITS:
        return None
    return float(m.group(1)) * _UNITS[m.group(2)]


def _target(name: str, nbytes: float, kind: str) -> FitTarget:
    if kind == "cpu":
        return FitTarget(name, nbytes, "cpu", CPU_RESERVED_GIB * GIB, *CPU_SHAPE)
    return FitTarget(name, nbytes, "gpu", GPU_RESERVED_GIB * GIB, *GPU_SHAPE)


# ---------------------------------------------------------------------------------------------- memory model


def training_memory(
    spec: ModelSpec, seq_len: int, batch: int, act_factor: float, reserved_bytes: float,
    prof: ArchProfile | None = None,
) -> dict[str, float]:
    """Bytes one device needs to train `spec` with AdamW at `batch` x `seq_len` tokens, no recompute (module
    docstring): component -> bytes; sum it for the total. act_factor multiplies the profile's activation bytes."""
    prof = prof or profile_model(spec, seq_len)
    tokens = batch * seq_len
    act_per_token = sum(lp.act_bytes_per_token for lp in prof.layers) + prof.head_act_bytes_per_token
    return {
        "weights+grads+adamw": ADAM_BYTES_PER_PARAM * prof.total_params,
        "activations": tokens * act_per_token * act_factor,
        "loss chunk": min(tokens, LOSS_CHUNK_TOKENS) * spec.vocab_size * LOSS_BYTES_PER_LOGIT,
        "runtime reserve": reserved_bytes,
    }


# ---------------------------------------------------------------------------------------------- layer pattern


def _mixer_period(mixers: list[str]) -> int:
    """Length of the smallest unit that, repeated at least twice, reproduces the start of the mixer sequence
    (K3: KDA KDA KDA MLA x 23, then one more MLA -> 4). Falls back to the whole sequence."""
    n = len(mixers)
    for p in range(1, n // 2 + 1):
        body = (n // p) * p
        if all(mixers[i] == mixers[i % p] for i in range(body)):
            return p
    return n


def _scaled_pattern(spec: ModelSpec, r: float) -> tuple[int, list[int], list[int], str]:
    """(num_layers, full_attention_layers, dense_layers, description) of the proxy at width ratio r."""
    kinds: list[LayerKind] = spec.layer_kinds()
    mixers = [k.mixer for k in kinds]
    n_src = len(kinds)
    p = _mixer_period(mixers)
    unit = mixers[:p]
    reps_src = n_src // p
    reps = max(1, min(reps_src, round(reps_src * r)))
    n = reps * p
    full = [i + 1 for i in range(n) if unit[i % p] == spec.attention]
    dense_src = [i for i, k in enumerate(kinds, 1) if k.ffn == "dense"] if spec.moe is not None else []
    if dense_src == list(range(1, len(dense_src) + 1)):  # a leading block of dense layers (K3, DeepSeek)
        k = len(dense_src)
        dense = list(range(1, min(n, max(1 if k else 0, round(k * n / n_src))) + 1))
    else:  # scattered dense layers: the same relative positions
        dense = sorted({min(n, max(1, round(i * n / n_src))) for i in dense_src})
    if len(dense) >= n and spec.moe is not None:
        dense = dense[: n - 1]  # keep at least one MoE layer
    names = {"kda": "KDA", "mla": "MLA", "gqa": "GQA"}
    desc = f"({', '.join(names.get(m, m) for m in unit)}) x {reps}"
    return n, full, dense, desc


# ---------------------------------------------------------------------------------------------- widths


def _round(x: float, step: int, lo: int | None = None) -> int:
    lo = step if lo is None else lo
    return max(lo, int(round(x / step)) * step)


def _expert_factors(E: int, k: int, r: float, top_k: int | None) -> list[int]:
    """Common divisors s of (E, k) to try, best first: the proxy has E/s experts and top-k k/s (experts / top-k is
    the source's). top_k given: only s = k / top_k. Otherwise the divisor whose expert count is nearest (in log) to
    E * r (experts shrink like the width), then ever fewer experts; top-k stays >= 2 when the source routes to
    several experts (with top-1 and renormalised weights the router gets no gradient through the output)."""
    divisors = [s for s in range(1, k + 1) if E % s == 0 and k % s == 0]
    if top_k is not None:
        if top_k <= 0 or k % top_k or E % (k // top_k):
            ok = sorted(k // s for s in divisors)
            raise ConfigError(f"--top-k: {top_k} does not keep experts/top-k = {E}/{k}; choose one of {ok}")
        return [k // top_k]
    if k >= 2:
        divisors = [s for s in divisors if k // s >= 2]
    want = max(E * r, 1.0)
    first = min(divisors, key=lambda s: (abs(math.log(E / s / want)), s))
    return [s for s in divisors if s >= first]


def _router_groups(router: dict[str, Any], E: int, k: int) -> dict[str, Any]:
    g0, tg0 = router["num_groups"], router["topk_groups"]
    g = g0
    while g > 1 and (E % g or E // g < 2):
        g //= 2
    tg = max(1, min(g, round(tg0 * g / g0)))
    if k > tg * (E // g):
        g, tg = 1, 1
    return {**router, "num_groups": g, "topk_groups": tg}


def _scale_spec(src: ModelSpec, d: int, seq_len: int, s: int) -> tuple[dict[str, Any], str]:
    """The proxy's spec data at hidden size d and expert factor s (module docstring), and its layer pattern."""
    r = d / src.hidden_size
    data = src.model_dump(mode="python")
    n, full, dense, desc = _scaled_pattern(src, r)
    data.update(hidden_size=d, num_layers=n, full_attention_layers=full, dense_layers=dense)
    if src.attn_res_block_size is not None:  # Attention Residuals: as many blocks as the source (block size scaled)
        data["attn_res_block_size"] = max(1, round(src.attn_res_block_size * n / src.num_layers))
    data["max_seq_len"] = min(src.max_seq_len, max(seq_len, 8192))
    if src.kda is not None:
        k = data["kda"]
        heads = max(1, round(src.kda.num_heads * r))
        k["num_heads"] = heads
        if src.kda.num_v_heads is not None:
            k["num_v_heads"] = heads * (src.kda.value_heads // src.kda.num_heads)
        for rank in ("gate_rank", "output_gate_rank"):
            if k[rank] is not None:
                k[rank] = min(k[rank], d)
    if src.mla is not None:
        a = data["mla"]
        a["num_heads"] = max(1, round(src.mla.num_heads * r))
        a["kv_lora_rank"] = min(src.mla.kv_lora_rank, d)
        if src.mla.q_lora_rank is not None:
            a["q_lora_rank"] = min(d, max(a["kv_lora_rank"], _round(src.mla.q_lora_rank * r, 64)))
        if src.mla.indexer is not None:
            a["indexer"]["top_k"] = max(1, min(src.mla.indexer.top_k, seq_len // 2))
    if src.gqa is not None:
        g = data["gqa"]
        group = src.gqa.num_heads // src.gqa.num_kv_heads
        kv = max(1, round(src.gqa.num_kv_heads * r))
        g.update(num_kv_heads=kv, num_heads=kv * group, head_dim=src.gqa_head_dim)
    if src.moe is not None:
        m, mo = src.moe, data["moe"]
        mo["num_experts"], mo["top_k"] = m.num_experts // s, m.top_k // s
        inter = _round(m.expert_intermediate_size * r, 64)
        mo["expert_intermediate_size"] = inter
        if m.latent_size is not None:
            mo["latent_size"] = min(d, _round(m.latent_size * r, 64))
        if m.num_shared_experts:  # DeepSeek / Kimi: shared width = count x expert width; keep that relation
            per_expert = m.shared_intermediate_size == m.num_shared_experts * m.expert_intermediate_size
            mo["shared_intermediate_size"] = (
                m.num_shared_experts * inter if per_expert else _round(m.shared_intermediate_size * r, 64)
            )
        mo["router"] = _router_groups(mo["router"], mo["num_experts"], mo["top_k"])
    if src.dense_mlp is not None:
        data["dense_mlp"]["intermediate_size"] = _round(src.dense_mlp.intermediate_size * r, HIDDEN_STEP)
        if not dense and (src.moe is not None):
            data["dense_mlp"] = None  # no dense layer left in the proxy
    return data, desc


# ---------------------------------------------------------------------------------------------- entry point


@dataclass
class AdaptResult:
    spec: ModelSpec  # the proxy (validated, buildable)
    source: ModelSpec  # the source after dropping unbuildable extras (what the proxy scales)
    target: FitTarget
    seq_len: int
    batch: int
    precision: str
    act_factor: float
    memory: dict[str, float]  # the proxy's training memory breakdown, bytes
    usable_bytes: float  # budget x (1 - margin)
    profile: ArchProfile  # the proxy's
    source_profile: ArchProfile
    pattern: str  # the proxy's layer pattern, e.g. "(KDA, KDA, KDA, MLA) x 4"
    notes: list[str] = field(default_factory=list)

    @property
    def memory_total(self) -> float:
        return sum(self.memory.values())


def buildable_source(spec: ModelSpec) -> tuple[ModelSpec, list[str]]:
    """Drop what the proxy can do without and the builder cannot build; raise ConfigError for the rest."""
    data = spec.model_dump(mode="python")
    notes = []
    for name in ("mla", "gqa"):
        sec = getattr(spec, name)
        if sec is not None and sec.rope_scaling is not None:
            data[name]["rope_scaling"] = None
            notes.append(f"dropped {name}.rope_scaling ({sec.rope_scaling.type}): the builder has no RoPE scaling "
                         "and the proxy trains at short context")
    if spec.moe is not None and spec.moe.shared_expert_gate:
        data["moe"]["shared_expert_gate"] = False
        notes.append("dropped moe.shared_expert_gate: not built yet")
    if spec.mtp_layers:
        data["mtp_layers"], data["mtp_pattern"] = 0, None
        notes.append(f"dropped {spec.mtp_layers} MTP module(s): moestack does not train them")
    out = validate(ModelSpec, data, f"model '{spec.name}'")
    errors = out.build_support_errors()
    if errors:
        raise ConfigError(f"adapt: model '{spec.name}' cannot be scaled to a buildable proxy: {'; '.join(errors)}")
    return out, notes


def adapt_model(
    spec: ModelSpec,
    target: FitTarget,
    seq_len: int | None = None,
    batch: int | None = None,
    precision: Literal["auto", "bf16", "fp32"] = "auto",
    act_factor: float | None = None,
    margin: float = DEFAULT_MARGIN,
    top_k: int | None = None,
    name: str | None = None,
) -> AdaptResult:
    """The largest proxy of `spec` (module docstring) that trains within `target`'s memory.

    seq_len / batch: the training shape the budget must hold (defaults: the target kind's, 4096 x 2 on a GPU,
    512 x 2 on a CPU). precision: "auto" = fp32 on a CPU target, bf16 otherwise. act_factor: multiplier on the
    profile's activation bytes (default GPU_ACT_FACTOR for bf16, CPU_ACT_FACTOR for fp32). margin: fraction of
    the budget kept free. top_k: force the proxy's top-k (experts follow from the source's experts/top-k).
    Raises ConfigError when even the narrowest proxy does not fit, or the source has features a proxy cannot drop.
    That the proxy builds with the profile's parameter count is the caller's check (moestack/tune/builds.py
    check_builds; `moestack adapt` runs it): the planner does not build models.
    """
    if seq_len is not None and seq_len <= 1:
        raise ConfigError(f"--seq-len: must be > 1 token per sequence (got {seq_len}); leave it out for "
                          f"{target.seq_len}")
    if batch is not None and batch <= 0:
        raise ConfigError(f"--batch: must be > 0 sequences (got {batch}); leave it out for {target.batch}")
    if act_factor is not None and not act_factor > 0:
        raise ConfigError(f"--act-factor: must be > 0 (got {act_factor})")
    seq_len = seq_len if seq_len is not None else target.seq_len
    batch = batch if batch is not None else target.batch
    if not 0 <= margin < 1:
        raise ConfigError(f"--margin: must be in [0, 1), got {margin}")
    if precision == "auto":
        precision = "fp32" if target.kind == "cpu" else "bf16"
    if act_factor is None:
        act_factor = CPU_ACT_FACTOR if precision == "fp32" else GPU_ACT_FACTOR
    if act_factor <= 0:
        raise ConfigError(f"--act-factor: must be > 0, got {act_factor}")
    source, notes = buildable_source(spec)
    usable = target.memory_bytes * (1 - margin)
    step = HIDDEN_STEP if source.hidden_size >= HIDDEN_STEP else source.hidden_size
    best = smallest = None
    for d in range(step, source.hidden_size + 1, step):  # the widest fit wins; at one width, the most experts
        r = d / source.hidden_size
        m = source.moe
        factors = _expert_factors(m.num_experts, m.top_k, r, top_k) if m is not None else [1]
        for s in factors:
            data, desc = _scale_spec(source, d, seq_len, s)
            data["name"] = name or f"{spec.name}-fit-{target.name}"
            cand = validate(ModelSpec, data, f"proxy of '{spec.name}' at hidden {d}")
            prof = profile_model(cand, seq_len)
            mem = training_memory(cand, seq_len, batch, act_factor, target.reserved_bytes, prof)
            if smallest is None or sum(mem.values()) < smallest[1]:
                smallest = (d, sum(mem.values()))
            if sum(mem.values()) <= usable:
                best = (cand, prof, mem, desc)
                break
    if best is None:
        d, need = smallest
        raise ConfigError(
            f"adapt: no proxy of '{spec.name}' fits {target.name} ({usable / GIB:.1f} GiB usable): the smallest "
            f"(hidden {d}) needs {need / GIB:.1f} GiB at {batch} x {seq_len} tokens; lower --seq-len / --batch"
        )
    cand, prof, mem, desc = best
    ix_src, ix = (source.mla.indexer, cand.mla.indexer) if source.mla is not None else (None, None)
    if ix_src is not None and ix.top_k != ix_src.top_k:
        notes.append(f"indexer top_k {ix_src.top_k} -> {ix.top_k} (at most seq_len / 2: the sparse path runs)")
    if source.mla is not None and cand.mla.kv_lora_rank != source.mla.kv_lora_rank:
        notes.append(f"mla.kv_lora_rank {source.mla.kv_lora_rank} -> {cand.mla.kv_lora_rank} (capped at hidden size)")
    return AdaptResult(
        spec=cand, source=source, target=target, seq_len=seq_len, batch=batch, precision=precision,
        act_factor=act_factor, memory=mem, usable_bytes=usable, profile=prof,
        source_profile=profile_model(source, seq_len), pattern=desc, notes=notes,
    )


def spec_to_yaml(result: AdaptResult) -> str:
    """The proxy as a ModelSpec YAML (what `moestack train --model` reads), with its provenance as comments."""
    import yaml

    s = result.spec
    head = [
        f"# {s.name}: proxy of '{result.source.name}' scaled by `moestack adapt` to fit {result.target.name}",
        f"# ({result.target.memory_bytes / GIB:.1f} GiB; AdamW, {result.batch} x {result.seq_len} tokens, "
        f"{result.precision}; estimated {result.memory_total / GIB:.1f} GiB).",
        f"# layers: {result.pattern}; {result.profile.total_params / 1e9:.3f}B total, "
        f"{result.profile.activated_params / 1e9:.3f}B activated.",
    ]
    head += [f"# note: {n}" for n in result.notes]
    body = yaml.safe_dump(_explicit(s), sort_keys=False, width=120)
    return "\n".join(head) + "\n" + body


def _explicit(model: BaseModel) -> dict[str, Any]:
    """model_dump(mode="json") without the fields that are None by default and None here (absent sections):
    every other value is written out, so the file does not change meaning when a default changes."""
    dumped = model.model_dump(mode="json")
    out = {}
    for key, info in type(model).model_fields.items():
        value = getattr(model, key)
        if value is None and info.default is None:
            continue
        out[key] = _explicit(value) if isinstance(value, BaseModel) else dumped[key]
    return out

