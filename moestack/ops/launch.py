"""Launch-time rules shared by the Triton kernels: interpreter mode, the autotune switch, and configs that fit.

No launch config that cannot run: every autotuned kernel prunes its candidates (`early_config_prune`) against the
device's shared memory per block and its threads / registers per block, from an estimate of each config's shared
memory (`SMEM`: one function per kernel family, from tile sizes, stages and element sizes, checked against the
compiler's own numbers for sm_90 by benchmarks/tools/launch_fit_check.py), and keeps at least one config: the one
with the smallest estimate when none fits (a shape no config can take then fails at launch with Triton's own
OutOfResources, which the GPU sweep test tests/ops/test_launch_fit.py would show). Fixed-config kernels check the
same way through `fits`.

TRITON_INTERPRET=1 (Triton's own variable) must be set before a kernel module is imported: Triton decides how to
build a kernel when it is decorated. `autotune` (KernelSpec.autotune, set when a model's kernels are resolved;
initially from the documented overrides in moestack/config/settings.py) keeps only the first fitting config of each
autotuned kernel when off.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moestack.config.settings import autotune_default

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # as the kernel modules were built
_AUTOTUNE = [autotune_default()]


def interpret() -> bool:
    """TRITON_INTERPRET=1 now (the availability checks read it per call: a test may set it after import)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def set_autotune(on: bool) -> None:
    _AUTOTUNE[0] = bool(on)


def autotune_enabled() -> bool:
    return _AUTOTUNE[0]


@dataclass(frozen=True)
class DeviceLimits:
    """Per-block limits of one GPU (bytes of shared memory with the opt-in, threads, 32-bit registers)."""

    smem: int
    threads: int = 1024
    regs: int = 65536


@functools.cache
def device_limits(index: int) -> DeviceLimits:
    """The limits of CUDA device `index` (Triton's driver query: the numbers its launcher checks)."""
    try:
        import triton

        props = triton.runtime.driver.active.utils.get_device_properties(index)
        return DeviceLimits(int(props["max_shared_mem"]), 1024, int(props["max_num_regs"]))
    except Exception:  # noqa: BLE001 - an older Triton: torch knows the shared memory too
        p = torch.cuda.get_device_properties(index)
        return DeviceLimits(int(getattr(p, "shared_memory_per_block_optin", 0) or p.shared_memory_per_block))


def _device_of(args: dict) -> torch.device | None:
    for v in args.values():
        if isinstance(v, torch.Tensor):
            return v.device
    return None


def _elt(args: dict, name: str, default: int = 2) -> int:
    t = args.get(name)
    return t.element_size() if isinstance(t, torch.Tensor) else default


def _cfg(config) -> tuple[dict, int, int, int | None]:
    return config.kwargs, config.num_warps, config.num_stages, getattr(config, "maxnreg", None)


# ---- shared-memory estimates, per kernel family: (config kwargs, warps, stages, launch args) -> bytes ----------
# Each is an upper bound of what the compiler allocates for sm_90 (operand tiles staged for the MMAs, times the
# pipeline depth, plus the layout-conversion scratch), checked config by config against the compiled kernels'
# metadata at every preset's and tests/data/hf_configs' widths (benchmarks/tools/launch_fit_check.py).


def _smem_dsa_fwd(kw: dict, warps: int, stages: int, a: dict) -> int:
    """Sparse attention forward: per stage the gathered key rows [BK, VP + RP] (and the value slice when the
    value dims are split); the resident query tile, P, and the accumulator's conversion tile."""
    e = _elt(a, "Q")
    VP, RP, BH, BK, BV = a["VP"], a["RP"], kw["BLOCK_H"], kw["BLOCK_K"], min(kw["BLOCK_V"], a["VP"])
    per_stage = BK * (VP + RP) + (BK * BV if BV < VP else 0)
    return e * (stages * per_stage + BH * (VP + RP) + BH * BK) + 4 * BH * BK


def _smem_dsa_dkv(kw: dict, warps: int, stages: int, a: dict) -> int:
    """Backward pass 1: per stage the key / query / dO column chunks and the key rope rows; the transposed score,
    P and dS tiles (fp32 and operand copies)."""
    e = _elt(a, "Q")
    RP, BH, BK, BC = a["RP"], kw["BLOCK_H"], kw["BLOCK_K"], kw["BLOCK_C"]
    return e * (stages * (BK * BC + 2 * BH * BC) + (BK + BH) * RP + 2 * BK * BH) + 8 * BK * BH


def _smem_dsa_dq(kw: dict, warps: int, stages: int, a: dict) -> int:
    """Backward pass 2: per stage the gathered key rows [BK, VP + RP] and the dS tile [BH, BK]."""
    e = _elt(a, "KV")
    VP, RP, BH, BK = a["VP"], a["RP"], kw["BLOCK_H"], kw["BLOCK_K"]
    return e * stages * (BK * (VP + RP) + BH * BK) + 4 * BH * BK


def _smem_indexer(kw: dict, warps: int, stages: int, a: dict) -> int:
    """Indexer scoring: the key tile [BS, DP] and, per stage, a head's query tile [BT, DP]; the fp32 score tile."""
    e = _elt(a, "Q", _elt(a, "KI"))
    DP, BT, BS = a["DP"], kw["BLOCK_T"], kw["BLOCK_S"]
    return e * (BS * DP + stages * BT * DP) + 4 * BT * BS


def _smem_kda_recurrence(kw: dict, warps: int, stages: int, a: dict) -> int:
    """KDA state recurrences: per chunk (stages deep) the [BT, BK] operand tiles (W, Kd, Qp), U / dO [BT, BV] and
    Aqk [BT, BT]; the state's operand copy [BK, BV]."""
    e = _elt(a, "w", 2)
    BK, BV, BT = a["BK"], kw["BV"], a["BT"]
    return e * (stages * (3 * BT * BK + 2 * BT * BV + BT * BT) + BK * BV)


def _smem_gg_swap(kw: dict, warps: int, stages: int, a: dict) -> int:
    """bf16 grouped GEMM, swap-AB (pointer or TMA loads): per stage a weight tile [BF, BK] and a token tile
    [BT, BK]; the [BF, BT] fp32 accumulator's transposing store."""
    e = _elt(a, "x", _elt(a, "y"))
    BF, BK, BT = kw["BF"], kw["BK"], kw.get("BT", a.get("BT", 128))
    return e * stages * (BF + BT) * BK + 4 * BF * BT


def _smem_gg_wgrad(kw: dict, warps: int, stages: int, a: dict) -> int:
    """bf16 grouped weight gradient: per stage a row chunk of both operands [rows, BA + BB]; the fp32 tile."""
    e = _elt(a, "p")
    rows = a.get("BT", a.get("RMAX", 64))
    return e * stages * rows * (kw["BA"] + kw["BB"]) + 4 * kw["BA"] * kw["BB"]


def _smem_fp8_mm(kw: dict, warps: int, stages: int, a: dict) -> int:
    """FP8 grouped GEMM forward (persistent): per stage the token tile [BM, BK] and weight tile [BK, BN] in fp8;
    the fp32 accumulator's conversion tile for the store."""
    e = _elt(a, "qx", 1)
    BM, BN, BK = kw["BM"], kw["BN"], a.get("BK", 128)
    return e * stages * (BM + BN) * BK + 4 * BM * BN


def _smem_fp8_swap(kw: dict, warps: int, stages: int, a: dict) -> int:
    """FP8 grouped GEMM forward, swap-AB: per stage a weight tile [BF, BK] and a token tile [BK, BT]."""
    e = _elt(a, "qx", 1)
    BF, BT, BK = kw["BF"], a.get("BT", 64), a.get("BK", 128)
    return e * stages * (BF + BT) * BK + 4 * BF * BT


def _smem_fp8_wgrad(kw: dict, warps: int, stages: int, a: dict) -> int:
    """FP8 grouped weight gradient: per stage the [BD, G] and [BF, G] fp8 tiles (the second one transposed)."""
    e = _elt(a, "qxT", 1)
    BD, BF, G = kw["BD"], kw["BF"], a.get("G", 128)
    return e * stages * (BD + BF) * G + 4 * BD * BF


SMEM: dict[str, Callable[[dict, int, int, dict], int]] = {
    "dsa": _smem_dsa_fwd,
    "dsa_dkv": _smem_dsa_dkv,
    "dsa_dq": _smem_dsa_dq,
    "indexer": _smem_indexer,
    "kda_recurrence": _smem_kda_recurrence,
    "gg_swap": _smem_gg_swap,
    "gg_tma_fwd": _smem_gg_swap,
    "gg_wgrad": _smem_gg_wgrad,
    "fp8_mm": _smem_fp8_mm,
    "fp8_swap": _smem_fp8_swap,
    "fp8_wgrad": _smem_fp8_wgrad,
}


def smem_estimate(family: str, config, args: dict) -> int:
    kw, warps, stages, _ = _cfg(config)
    return SMEM[family](kw, warps, stages, args)


def config_fits(config, smem: int, limits: DeviceLimits) -> bool:
    """Shared memory and threads within the block limits; with a register cap, registers too."""
    _, warps, _, maxnreg = _cfg(config)
    threads = 32 * warps
    return smem <= limits.smem and threads <= limits.threads and (not maxnreg or maxnreg * threads <= limits.regs)


def fit(configs: list, estimates: list[int], limits: DeviceLimits | None) -> list:
    """The configs that fit `limits` (all of them without limits: the interpreter), order kept; the one with the
    smallest estimate if none does; only the first kept one when autotuning is off. Never empty."""
    if not configs:
        raise ValueError("fit: no configs")
    kept = configs if limits is None else [c for c, s in zip(configs, estimates) if config_fits(c, s, limits)]
    if not kept:
        kept = [min(zip(configs, estimates), key=lambda cs: cs[1])[0]]
    return kept if autotune_enabled() else kept[:1]


def fit_configs(configs: list, args: dict, family: str, limits: DeviceLimits | None = None) -> list:
    """`fit` for an autotuned kernel's prune hook: args are its launch arguments (tensors and constexprs), the
    limits those of the tensors' device (none under the interpreter or for CPU tensors)."""
    if limits is None:
        device = _device_of(args)
        if device is None or device.type != "cuda" or INTERPRET:
            return configs if autotune_enabled() else configs[:1]
        limits = device_limits(device.index if device.index is not None else torch.cuda.current_device())
    return fit(configs, [smem_estimate(family, c, args) for c in configs], limits)


def pruner(family: str, extra: Callable[[list, dict], list] | None = None):
    """An `early_config_prune` hook: `extra(configs, args)` (optional, a kernel's own rule) then fit_configs."""

    def prune(configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        return fit_configs(extra(configs, args) if extra else configs, args, family)

    return prune


prune_recurrence = pruner("kda_recurrence")


def fits(smem: int, device: torch.device, warps: int = 4) -> bool:
    """Whether a fixed-config kernel needing `smem` bytes at `warps` warps runs on `device` (always off CUDA)."""
    if device.type != "cuda" or INTERPRET:
        return True
    limits = device_limits(device.index if device.index is not None else torch.cuda.current_device())
    return smem <= limits.smem and 32 * warps <= limits.threads
