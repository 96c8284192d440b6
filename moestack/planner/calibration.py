"""Efficiencies the cost model multiplies peak numbers by, and where they come from.

Every op's time is `flops / (peak_flops(dtype) * efficiency)` or `bytes / (bandwidth * efficiency)`. The defaults
(`calibrations/h200-measured.json`) are fitted to the single-H200 measurements in shared/MEASURED.md; they are
applied as *fractions of peak* on other devices (an assumption, stated in every report). `moestack tune` measures
the same quantities on the local GPU at the model's shapes and writes a file of this format, which `--calibration`
(or a cluster-named file beside the default) then replaces the defaults with.

GEMM efficiency model (3 constants, fitted to MEASURED.md's dense and grouped bf16 GEMMs):
    eff(tokens, n, k) = gemm_peak_eff * min(1, tokens / gemm_tokens_sat) * d / (d + gemm_dim_half),  d = min(n, k)
Measured points in `gemm_points` (written by tune) override the formula near their shape.

Collectives (`comm`, optional): measured bus bandwidth and per-call latency of all-reduce / reduce-scatter /
all-gather / all-to-all inside one scale-up domain (network tier 0), written by `moestack tune-comm`
(tune/comm.py, under torchrun) and merged into a calibration file with `--merge-into CAL.json`. When present,
planner/cost/ prices every collective whose group stays inside tier 0 with these numbers instead of the cluster's
datasheet bandwidth x tier efficiency; without it the datasheet path is unchanged.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field

from moestack.config.base import ConfigError, StrictModel

CALIBRATION_DIR = Path(__file__).parent / "calibrations"
DEFAULT_CALIBRATION = CALIBRATION_DIR / "h200-measured.json"


class GemmPoint(StrictModel):
    """One measured GEMM: [tokens, k] @ [k, n] (per expert when grouped) and its fraction of dtype peak."""

    tokens: int = Field(gt=0)
    n: int = Field(gt=0)
    k: int = Field(gt=0)
    dtype: str = "bf16"
    grouped: bool = False
    efficiency: float = Field(gt=0, le=1)


class PartCalibration(StrictModel):
    """One layer part kind (kda, mla, gqa, mamba2, moe, dense) measured whole by `moestack tune`
    (tune/parts.py) at one device's shape, with the backends that ran."""

    tokens: int = Field(gt=0)  # tokens per micro-batch of the (larger) measurement
    # measured - analytic time = fixed + per_token * tokens, fitted on two token counts (each term >= 0)
    fwd_extra_s_per_token: float = Field(ge=0)
    bwd_extra_s_per_token: float = Field(ge=0)
    fwd_fixed_s: float = Field(default=0.0, ge=0)  # per part per micro-batch pass (launch-bound small ops)
    bwd_fixed_s: float = Field(default=0.0, ge=0)
    act_bytes_per_token: float = Field(ge=0)  # saved by autograd under no recompute, autocast weight copies excluded
    backend: str = ""  # what ran (e.g. "kda=reference")


COLLECTIVE_KINDS = ("ar", "rs", "ag", "a2a")


class CollectiveCalibration(StrictModel):
    """One collective kind measured by `moestack tune-comm`: NCCL's bus bandwidth at the largest size measured
    (ar: 2(n-1)/n * bytes / t; rs, ag: (n-1)/n * total bytes / t; a2a: (n-1)/n * bytes per rank / t) and the
    fixed per-call latency of the least-squares fit t = latency + bytes / bandwidth over the sizes."""

    busbw_gb_s: float = Field(gt=0)
    latency_us: float = Field(default=0.0, ge=0)


class CommCalibration(StrictModel):
    """Collective bandwidths measured inside one scale-up domain (network tier 0: e.g. the GPUs of one NVLink
    node), with `world` ranks, by `moestack tune-comm` (tune/comm.py).

    Measured beats datasheet: the datasheet bandwidth times an efficiency is a guess per machine (the 2 x H200
    numbers are in benchmarks/RESULTS.md, "Multi-GPU (issue #10)"). Bus bandwidth is (nearly) independent of the
    group size for ring algorithms, so the numbers measured at `world` ranks are used for any group inside tier 0."""

    source: str = ""  # where the numbers come from (tune-comm file, date)
    world: int = Field(ge=2)  # ranks the measurement ran on (all inside one tier-0 domain)
    tier: Literal[0] = 0  # the network tier measured (only the scale-up domain is supported)
    backend: str = ""  # nccl | gloo
    device: str = ""
    # "ar" all_reduce, "rs" reduce_scatter_tensor, "ag" all_gather_into_tensor, "a2a" all_to_all_single; a kind
    # not listed keeps the datasheet bandwidth
    collectives: dict[Literal["ar", "rs", "ag", "a2a"], CollectiveCalibration]


class HostCalibration(StrictModel):
    """Host (Python + launch) seconds of moestack's eager training step, per layer per micro-batch (forward +
    backward together; planner/cost/step.py `host_times` splits them 1 : 2 like the kernels they launch). The device
    cannot run ahead of the host that launches its kernels, so a rank's forward (backward) of one micro-batch takes at
    least its host share: the cost model prices max(device, host) per rank and micro-batch pass. On one H200 the proxy
    at 4 x 2048 tokens per step is device-bound (0.53 s device vs ~0.39 s host); at 2 x 2048 tokens per GPU, and in
    every 2-GPU layout, the host sets the step.

    The constants belong to moestack's code (op count per layer, Python autograd Functions, hooks), not to the GPU.
    The defaults are fitted on whole 2 x H200 proxy steps (benchmarks/RESULTS.md, "Multi-GPU (issue #10)"; the
    host speed of one machine kind varies by ~15%, more than the planner's 10% bound):
      layer_s     per layer per micro-batch: solved so that the planner gives the 1-GPU weak-scaling step time.
      ep_moe_s    extra per MoE layer per micro-batch when ep > 1 (the flat dispatcher's count exchange, the host
                  sync for the split sizes, the regroup gathers, the FSDP2 hooks, the all-to-all rendezvous):
                  solved on the 2-GPU ep2 run with layer_s fixed.
      tp_layer_s  extra per layer per micro-batch when tp > 1 (DTensor dispatch): the tp2 profile's extra self CPU
                  time over the single-GPU one. Not fitted on the tp2 step time (an upper-ish estimate).
      fp8_layer_s extra per layer per micro-batch under the FP8 recipe: measured by tune/host.py on the proxy, bf16
                  then the recipe ("The FP8 recipe in the planner" in RESULTS.md).
    The published-run validation (Megatron-LM runs: fused, graph-captured steps with their own host costs) is
    evaluated with these set to 0.

    `moestack tune --measure-host` (opt-in) replaces layer_s with the local machine's measurement (tune/host.py):
    the wall time of the whole model's forward + backward of one 256-token micro-batch (host-bound: the device
    idles), divided by the layers the cost model charges, and says how in `source`. It leaves out the optimizer step,
    FSDP2's hooks and DTensor dispatch, which the fitted default absorbs, so it predicts multi-GPU steps too fast.
    On a GPU with FP8 it measures fp8_layer_s too (the recipe's pass minus the bf16 one). ep_moe_s and tp_layer_s
    keep their defaults (they need several GPUs)."""

    layer_s: float = Field(default=0.0208, ge=0)
    ep_moe_s: float = Field(default=0.0067, ge=0)
    tp_layer_s: float = Field(default=0.0088, ge=0)
    # extra per layer under the FP8 recipe: each FP8 GEMM adds quantiser launches, a weight-cache lookup and its own
    # autograd Function (the cost model adds it to every layer of an fp8 plan)
    fp8_layer_s: float = Field(default=0.0084, ge=0)
    # device idle per dropless MoE layer per forward under EP, added to the pass (cost/step.py sync_times): the host
    # sync for the token counts drains the device's queue. 0 for moestack's trainer (its sync is inside the fitted
    # ep_moe_s)
    moe_sync_s: float = Field(default=0.0, ge=0)
    source: str = ""  # where layer_s comes from ("" = the 2 x H200 fit above; tune --measure-host writes device, date)


# a layer kind as Calibration.bwd_ws_factors keys it: "<mixer>/<ffn>" (moestack.config.model_spec.LayerKind)
COMPILED_HOST_MODES = ("blocks",)  # TrainSpec.compile modes a plan can run, with host constants of their own
LAYER_KIND_KEY = r"^(kda|mla|gqa|mamba2|none)/(dense|moe|none)$"


class Calibration(StrictModel):
    source: str  # where the numbers come from (file, device, date)
    device: str  # device they were measured on
    # GEMMs (fraction of the dtype's dense peak)
    gemm_peak_eff: float = Field(gt=0, le=1)
    gemm_tokens_sat: float = Field(gt=0)  # rows (tokens per expert for grouped GEMMs) at which a GEMM saturates
    gemm_dim_half: float = Field(ge=0)  # weight dim at which efficiency is half of its large-dim value
    grouped_gemm_factor: float = Field(gt=0, le=1.5)  # grouped vs dense GEMM at the same per-expert shape
    fp8_gemm_factor: float = Field(gt=0, le=1)  # fp8 efficiency / bf16 efficiency (fraction of each dtype's peak)
    # the same for natively scaled low-precision GEMMs (per-tensor FP8; MXFP8 / NVFP4 block scales applied by the
    # tensor cores), dense and grouped: the H200's row-wise-scaled grouped GEMM at the K3 expert shape (README.md,
    # "Measured"). MXFP8 / NVFP4 are not measured here (assumed the same as FP8)
    lowp_native_gemm_factor: float = Field(default=0.745, gt=0, le=1)
    lowp_native_grouped_factor: float = Field(default=0.745, gt=0, le=1)
    # attention-like kernels (fraction of bf16 peak; FLOPs counted as the hardware does them)
    flash_attn_fwd_eff: float = Field(gt=0, le=1)
    flash_attn_bwd_eff: float = Field(gt=0, le=1)  # bwd FLOPs = 2.5x fwd (FlashAttention recomputes P)
    sparse_attn_fwd_eff: float = Field(gt=0, le=1)  # DSA top-k attention over the shared MQA latent
    sparse_attn_bwd_eff: float = Field(gt=0, le=1)
    sparse_attn_heads: int | None = Field(default=None, gt=0)  # heads the two were measured at (None: the model's)
    kda_fwd_eff: float = Field(gt=0, le=1)  # chunked KDA core, FLOPs per MODEL.md (6 dk^2 + 3 C dk + C^2 per head)
    kda_bwd_eff: float = Field(gt=0, le=1)  # bwd FLOPs = 2x fwd
    topk_elems_per_s: float = Field(gt=0)  # torch.topk throughput (scores examined per second)
    # memory-bound work
    hbm_eff: float = Field(gt=0, le=1)  # fraction of HBM bandwidth elementwise kernels reach
    cpu_adam_params_per_s: float = Field(gt=0)  # CPU optimizer step rate per device (offloaded optimizer)
    # fixed costs
    runtime_reserved_gib: float = Field(ge=0)  # CUDA context, NCCL buffers, allocator slack per device
    kernel_overhead_s: float = Field(ge=0)  # launch/sync cost per layer per micro-batch pass (fwd or bwd)
    # host (CPU) time of moestack's eager trainer, a floor under the device time (HostCalibration says why)
    host: HostCalibration = Field(default_factory=lambda: HostCalibration())
    # the same constants for the trainer's compiled modes (TrainSpec.compile), read by the host profiles of the same
    # names (planner/host_profile.py); written only by `moestack tune --measure-host` (no default: absent = unmeasured)
    host_modes: dict[Literal["blocks"], HostCalibration] = {}
    gemm_points: list[GemmPoint] = []
    parts: dict[str, PartCalibration] = {}  # measured whole parts (tune); empty = analytic terms only
    # measured / modelled saved activations per memory technique (benchmarks/memory.py prints them as "act x" and
    # a suggested act_factors line): multiply the activation term of parts under selective / full recompute, the
    # layers in flight under activation offload, the activations of a plan with FP8 storage; absent = 1
    act_factors: dict[Literal["selective", "full", "activation_offload", "fp8"], Annotated[float, Field(gt=0)]] = {}
    # measured backward working set of one layer / the modelled no-recompute activations of its kind, per layer kind
    # "<mixer>/<ffn>" (e.g. "kda/dense", "kda/moe", "mla/moe"): what a layer's backward holds on top of the rest at
    # its peak, its recomputed activations plus the gradients of them in flight (benchmarks/memory.py --phase-peaks
    # prints them as "bwd ws x"); absent = 1
    bwd_ws_factors: dict[Annotated[str, Field(pattern=LAYER_KIND_KEY)], Annotated[float, Field(gt=0)]] = {}
    # measured collective bus bandwidths / latencies inside tier 0 (`moestack tune-comm --merge-into`); None: the
    # cluster's datasheet bandwidth x tier efficiency (CommCalibration says why measured numbers are preferred)
    comm: CommCalibration | None = None

    def gemm_efficiency(self, tokens: float, n: int, k: int, dtype: str = "bf16", grouped: bool = False) -> float:
        """Fraction of the dtype's peak reached by [tokens, k] @ [k, n] (tokens per expert when grouped): a measured
        point within 25%, for fp8 else a bf16 point x fp8_gemm_factor, else the analytic curve."""
        point = self._nearest_point(tokens, n, k, dtype, grouped)
        if point is not None:
            return point.efficiency
        if dtype == "fp8":  # tune measures bf16 points: the shape's own efficiency, scaled as the recipe's GEMMs are
            point = self._nearest_point(tokens, n, k, "bf16", grouped)
            if point is not None:
                return max(point.efficiency * self.fp8_gemm_factor, 1e-3)
        d = min(n, k)
        eff = self.gemm_peak_eff * min(1.0, tokens / self.gemm_tokens_sat) * d / (d + self.gemm_dim_half)
        if grouped:
            eff *= self.grouped_gemm_factor
        if dtype == "fp8":
            eff *= self.fp8_gemm_factor
        return max(eff, 1e-3)

    def _nearest_point(self, tokens: float, n: int, k: int, dtype: str, grouped: bool) -> GemmPoint | None:
        """A measured point within 25% of this shape in every dim (log distance), if any."""
        best, best_d = None, math.inf
        for p in self.gemm_points:
            if p.dtype != dtype or p.grouped != grouped:
                continue
            dists = [abs(math.log(a / b)) for a, b in ((tokens, p.tokens), (n, p.n), (k, p.k))]
            if max(dists) <= math.log(1.25) and sum(dists) < best_d:
                best, best_d = p, sum(dists)
        return best


def load_calibration(path: str | Path | None = None) -> Calibration:
    """Read a calibration JSON (default: the H200 numbers from shared/MEASURED.md)."""
    p = Path(path) if path is not None else DEFAULT_CALIBRATION
    if not p.is_file():
        raise ConfigError(f"calibration: {p}: file not found")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"calibration: {p}: not valid JSON ({err.msg} at line {err.lineno})") from None
    from moestack.config.base import validate

    return validate(Calibration, data, f"calibration {p}")


def save_calibration(cal: Calibration, path: str | Path) -> None:
    """Write atomically (a temporary file beside it, then renamed over it): a reader never sees half a file."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(cal.model_dump(mode="json"), indent=2) + "\n")
    os.replace(tmp, p)
