"""2. Terms, device compute: GEMM time (calibrated efficiency, FP8 recipes and their casts), elementwise time (HBM
roofline), the MoE load imbalance, the DSA head-block and KDA scan-widening factors, Muon's FLOPs."""

from __future__ import annotations

import math
from dataclasses import dataclass

from moestack.config.cluster import ClusterSpec
from moestack.config.model_spec import ModelSpec
from moestack.config.plan import Plan
from moestack.planner.calibration import Calibration
from moestack.planner.cost.work import BF16, FP32, Gemm


def gemm_time(g: Gemm, rows: float, rows_per_gemm: float, tp: int, etp: int, precision: str,
              cluster: ClusterSpec, cal: Calibration) -> float:
    """Forward seconds of one Gemm on one device: `rows` token rows in total through this weight (routed copies
    on this device for experts), `rows_per_gemm` rows per single GEMM (tokens per local expert when grouped).

    Tensor parallelism splits n ("col") or k ("row"); experts split by etp. Backward = dgrad + wgrad = 2x these
    FLOPs at the same efficiency (Megatron's 3x rule, arXiv:2104.04473 App. A). Efficiency:
    Calibration.gemm_efficiency (fitted to measured H200 GEMMs, or measured by `moestack tune`).
    """
    n, k = g.n, g.k
    div = etp if g.expert else tp
    if g.split == "col":
        n = max(1, n // div)
    elif g.split == "row":
        k = max(1, k // div)
    peaks = cluster.device.peak_tflops
    if g.fp32:
        dtype = "tf32" if "tf32" in peaks else "fp32"
        eff = cal.gemm_efficiency(rows_per_gemm, n, k, "bf16", grouped=g.expert)
    else:
        recipe = gemm_recipe(precision, cluster) if g.fp8 else None
        if recipe is None:
            dtype, eff = "bf16", cal.gemm_efficiency(rows_per_gemm, n, k, "bf16", grouped=g.expert)
        elif recipe.scaling == "blockwise":  # moestack's recipe: its measured factor (Calibration.fp8_gemm_factor)
            dtype, eff = "fp8", cal.gemm_efficiency(rows_per_gemm, n, k, "fp8", grouped=g.expert)
        else:
            dtype = recipe.dtype
            factor = cal.lowp_native_grouped_factor if g.expert else cal.lowp_native_gemm_factor
            eff = cal.gemm_efficiency(rows_per_gemm, n, k, "bf16", grouped=g.expert) * factor
    return 2.0 * rows * n * k / (cluster.device.peak_flops(dtype) * eff)


@dataclass(frozen=True)
class GemmRecipe:
    """A low-precision GEMM recipe (Plan.precision) as the cost model prices it.

    dtype: the ClusterSpec peak its GEMMs run at; elem_bytes: one quantised element; scale_bytes: scale bytes per
    element; scaling: "blockwise" (moestack's recipe: software-scaled 1x128 / 128x128 blocks, priced by its measured
    Calibration.fp8_gemm_factor) or "native" (one scale per tensor, or block scales the tensor cores apply:
    MXFP8 / NVFP4 on Blackwell, priced at the bf16 efficiency x Calibration.lowp_native_gemm_factor)."""

    dtype: str
    elem_bytes: float
    scale_bytes: float
    scaling: str


GEMM_RECIPES = {
    "fp8": GemmRecipe("fp8", 1.0, FP32 / 128, "blockwise"),
    "fp8_tensorwise": GemmRecipe("fp8", 1.0, 0.0, "native"),
    "mxfp8": GemmRecipe("fp8", 1.0, 1.0 / 32, "native"),  # e8m0 scale per 32 elements (OCP MX)
    "nvfp4": GemmRecipe("fp4", 0.5, 1.0 / 16, "native"),  # e4m3 scale per 16 elements (+ one fp32 per tensor)
}


def gemm_recipe(precision: str, cluster: ClusterSpec) -> GemmRecipe | None:
    """The low-precision recipe a plan of this precision runs on this cluster; None for bf16 or a device without
    the recipe's units (its GEMMs are then priced in bf16)."""
    recipe = GEMM_RECIPES.get(precision)
    if recipe is None or recipe.dtype not in cluster.device.peak_tflops:
        return None
    return recipe


def fp8_recipe_runs(precision: str, cluster: ClusterSpec) -> bool:
    """Whether a plan of this precision runs a low-precision GEMM recipe on this cluster (GEMM_RECIPES)."""
    return gemm_recipe(precision, cluster) is not None


def recipe_cast_bytes(g: Gemm, rows: float, tp: int, etp: int, recipe: GemmRecipe, microbatches: int
                      ) -> tuple[float, float]:
    """HBM bytes of quantisation around one GEMM under a native-scaled recipe (Transformer Engine's): forward reads
    the bf16 input [rows, k] once and writes both layouts (row-wise for the forward GEMM, column-wise for wgrad);
    backward does the same for the output gradient [rows, n]. One scale per tensor (current scaling) needs the
    tensor's amax first: one more bf16 read. The weight is quantised once per optimizer step (its cast is cached
    across micro-batches), both layouts, amortised over the step's micro-batches."""
    div = etp if g.expert else tp
    n = g.n / div if g.split == "col" else g.n
    k = g.k / div if g.split == "row" else g.k
    q = 2 * (recipe.elem_bytes + recipe.scale_bytes)  # two layouts written per element read
    read = 2 * BF16 if recipe.scale_bytes == 0 else BF16  # per-tensor scales: an amax pass before the cast
    w = n * k * (read + q) / max(1, microbatches)
    return rows * k * (read + q) + w, rows * n * (read + q)


def moe_time_imbalance(plan: Plan, spec: ModelSpec) -> float:
    """Busiest EP rank's routed rows over the mean (Plan.moe_load_imbalance), with plan.ep_replicas slots per EP
    rank what hot-expert replication leaves of it (moestack/planner/eplb.py), capped by the capacity factor when
    tokens beyond it are dropped (ModelSpec moe.capacity_factor: no expert takes more than factor x mean)."""
    imbalance = plan.moe_load_imbalance
    if plan.ep_replicas and plan.ep > 1 and spec.moe is not None:
        from moestack.planner.eplb import replicated_imbalance

        imbalance = replicated_imbalance(imbalance, spec.moe.num_experts, plan.ep, plan.ep_replicas)
    cap = spec.moe.capacity_factor if spec.moe is not None else None
    return min(imbalance, cap) if cap is not None else imbalance


def fp8_cast_bytes(g: Gemm, rows: float, tp: int, etp: int) -> tuple[float, float]:
    """HBM bytes of FP8 quantisation around one GEMM (read bf16 2 B + write fp8 1 B per element): forward casts the
    input [rows, k] and the weight; backward casts the output gradient [rows, n] and re-casts the input transposed
    for wgrad (Transformer Engine's delayed/current scaling recipes)."""
    div = etp if g.expert else tp
    n = g.n / div if g.split == "col" else g.n
    k = g.k / div if g.split == "row" else g.k
    w = n * k * 3
    return rows * k * 3 + w, rows * (n + k) * 3


def elementwise_time(nbytes: float, cluster: ClusterSpec, cal: Calibration) -> float:
    """Memory-bound kernels: bytes / (HBM bandwidth * achievable fraction) (roofline; MEASURED.md copy 4.24 of
    4.8 TB/s on H200)."""
    return nbytes / (cluster.device.hbm_bandwidth_gb_s * 1e9 * cal.hbm_eff)


def muon_flops(n: int, k: int) -> float:
    """Newton-Schulz orthogonalisation of one [n, k] update, 5 iterations of X <- aX + (bA + cA^2)X with A = XX^T
    over the smaller dim m (Jordan et al. 2024; Kimi K2 report's MuonClip): ~5 (4 m^2 M + 2 m^3) FLOPs."""
    m, big = min(n, k), max(n, k)
    return 5.0 * (4.0 * m * m * big + 2.0 * m**3)


# DSA sparse MQA attention kernels (moestack/ops/dsa/triton_attn_*.py) put up to 64 heads of one token in one program
# (forward BLOCK_H <= 64, backward heads padded to DS_HEAD_PAD = 64) over the token's gathered top-k latent rows:
# the time per token is that of ceil(H / 64) head blocks, however few heads a block holds.
DSA_HEAD_BLOCK = 64


def dsa_head_block_factor(heads: int, tp: int, cal_heads: int | None) -> float:
    """Time of the DSA sparse attention with heads / tp local heads, relative to `sparse_attn_flops` (all heads)
    priced at the calibrated efficiency, which was measured at `cal_heads` heads (None: all `heads`, tp = 1).
    The kernels pay per block of DSA_HEAD_BLOCK heads, so below 64 heads TP does not shorten them."""
    if heads <= 0:
        return 1.0 / tp
    ref = cal_heads or heads
    local = max(1, heads // tp)
    blocks = lambda n: math.ceil(n / DSA_HEAD_BLOCK)  # noqa: E731
    return (ref / heads) * blocks(local) / blocks(ref)


def kda_scan_widen_factor(head_dim: int, chunk: int) -> float:
    """KDA core FLOPs with the value width doubled (the scan's [0 | v] pass) over the plain pass. Per head and
    token the core is 6 d^2 + 3 C d + C^2 (kda_work); the V-proportional part -- the three state products
    (6 d V) and the intra-chunk value products U = M V, P D (~C V of the 3 C d) -- doubles."""
    d, C = head_dim, chunk
    return 1.0 + (6 * d * d + C * d) / (6 * d * d + 3 * C * d + C * C)
