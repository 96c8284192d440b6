"""KernelSpec: which implementation runs each hot op (a field of TrainSpec and of Plan, recorded in the run directory).

Per op one backend and the few choices that change a run; everything else is fixed in the op (its README says what
and why). Every backend field defaults to "auto": chosen by capability, once, when the model is built
(moestack/ops/backends.py): CUDA with Triton -> the fast path, anything else -> the reference; a `moestack tune`
cache entry for the op and shape (moestack/ops/tuned.py) may replace an "auto" choice per shape. A named backend
that cannot run on the device is a one-line ConfigError at build time. The resolved choices land in
`<out_dir>/kernels.json` beside train.yaml.

    kda.backend      the chunked delta-rule recurrence (moestack/ops/kda): triton | reference | fla (benchmark anchor)
    kda.layer_ops    short conv + SiLU and gated RMSNorm around it: triton (fused kernels) | torch
    dsa.backend      sparse MQA attention, indexer top-k, indexer scores / KL target (moestack/ops/dsa)
    moe.routing      router top-k, dispatch, gather, combine, GLU activation (moestack/ops/moe/routing.py)
    moe.gemm         the bf16 expert GEMM: crossover (Triton up to the measured rows per expert, then torch's
                     grouped GEMM) | torch | triton | reference. FP8 experts come from `precision: fp8`, not here.
    moe.crossover    a crossover JSON (benchmarks/grouped_gemm.py --write-crossover) for moe.gemm crossover
    moe.solve_graph  batch-scope quantile balancing's per-micro-batch solve as one CUDA graph replay (default on)
    adamw.backend    the single-device AdamW step (moestack/ops/adamw): triton (one pass per parameter that also
                     writes the bf16 compute copy) | torch (torch's fused AdamW)
    fp8.weight_cache FP8 expert / projection weights quantised once per optimizer step: on | step | off
    fp8.cublas_min_rows  mean rows per expert from which FP8 GEMMs run per-expert cuBLAS instead of Triton (0:
                     wherever the widths allow it)
    autotune         False: the first launch config of every autotuned kernel (quick GPU checks: fewer compiles)
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationError, field_validator

from moestack.config.base import StrictModel, format_validation_error

AUTO = "auto"


class KDAKernels(StrictModel):
    backend: Literal["auto", "triton", "reference", "fla"] = "auto"
    layer_ops: Literal["auto", "triton", "torch"] = "auto"


class DSAKernels(StrictModel):
    backend: Literal["auto", "triton", "reference"] = "auto"


class MoEKernels(StrictModel):
    routing: Literal["auto", "triton", "reference"] = "auto"
    gemm: Literal["auto", "crossover", "torch", "triton", "reference"] = "auto"
    crossover: str | None = None  # path of a crossover JSON; None = the table measured on the H200 (gemm_select.py)
    # batch-scope quantile balancing's solve replayed as one CUDA graph per shape (CUDA, single-rank balance group;
    # bitwise the eager solve, one replay for its ~50 launches per layer and micro-batch: moestack/ops/graphed.py)
    solve_graph: bool = True


class AdamWKernels(StrictModel):
    backend: Literal["auto", "triton", "torch"] = "auto"


class FP8Kernels(StrictModel):
    weight_cache: Literal["on", "step", "off"] = "on"
    cublas_min_rows: int = Field(default=512, ge=0)  # 0: cuBLAS wherever the widths allow it

    @field_validator("weight_cache", mode="before")
    @classmethod
    def _yaml_bool(cls, v):
        """YAML reads a bare on / off as a bool (`--set kernels.fp8.weight_cache=off`)."""
        return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v


class KernelSpec(StrictModel):
    kda: KDAKernels = KDAKernels()
    dsa: DSAKernels = DSAKernels()
    moe: MoEKernels = MoEKernels()
    adamw: AdamWKernels = AdamWKernels()
    fp8: FP8Kernels = FP8Kernels()
    autotune: bool = True


def kernel_fields(spec: KernelSpec) -> dict[str, object]:
    """{"kda.backend": "auto", ...}: every leaf as a dotted name."""
    out: dict[str, object] = {}
    for name, value in spec:
        if isinstance(value, StrictModel):
            out.update({f"{name}.{k}": v for k, v in value})
        else:
            out[name] = value
    return out


def with_fields(spec: KernelSpec, fields: dict[str, object]) -> KernelSpec:
    """A copy of spec with dotted fields replaced ({"kda.backend": "reference"}), validated (ValueError naming the
    field on a bad value or an unknown name)."""
    data = spec.model_dump()
    for key, value in fields.items():
        *parents, leaf = key.split(".")
        node = data
        for part in parents:
            if not isinstance(node.get(part), dict):
                raise ValueError(f"kernels.{key}: unknown field; fields are {', '.join(kernel_fields(spec))}")
            node = node[part]
        if leaf not in node:
            raise ValueError(f"kernels.{key}: unknown field; fields are {', '.join(kernel_fields(spec))}")
        node[leaf] = value
    try:
        return KernelSpec.model_validate(data)
    except ValidationError as err:
        raise ValueError(format_validation_error(err, "kernels")) from None


def merge(primary: KernelSpec, fallback: KernelSpec) -> KernelSpec:
    """Each field from primary where it differs from the default, else from fallback (a TrainSpec's explicit choice
    wins over the plan's, the plan's over the default)."""
    default = kernel_fields(KernelSpec())
    mine, theirs = kernel_fields(primary), kernel_fields(fallback)
    return with_fields(KernelSpec(), {k: (mine[k] if mine[k] != default[k] else theirs[k]) for k in default})
