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

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # as the kernel modules were built
_AUTOTUNE = [True]  # KernelSpec.autotune, set when a model's kernels are resolved


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
# Each is an upper bound of what Triton 3.6 allocates for sm_90, fitted to the compiled kernels' metadata config by
# config at every preset's and tests/data/hf_configs' widths, bf16 and fp32, with and without 16-byte alignment
# (benchmarks/tools/launch_fit_check.py prints both columns; rerun it after a Triton upgrade or a new config), and
# within ~5% of it at the production widths so that no config that fits there is dropped. SLACK covers barriers
# and small scratch. "buffers": how many copies of a pipelined operand the compiler keeps (measured: gathered
# loads are double-buffered at 2 and at 3 stages).
SLACK = 1024


def _smem_dsa_fwd(kw: dict, warps: int, stages: int, a: dict) -> int:
    """Sparse attention forward: the gathered key rows [BK, VP + RP] (and the value slice when the value dims are
    split), double-buffered; the resident query tile [BH, VP + RP] and P [BH, BK]."""
    e = _elt(a, "Q")
    VP, RP, BH, BK, BV = a["VP"], a["RP"], kw["BLOCK_H"], kw["BLOCK_K"], min(kw["BLOCK_V"], a["VP"])
    per_buffer = BK * (VP + RP) + (BK * BV if BV < VP else 0)
    return e * (min(stages, 2) * per_buffer + BH * (VP + RP) + BH * BK) + SLACK


def _smem_dsa_dkv(kw: dict, warps: int, stages: int, a: dict) -> int:
    """Backward pass 1: per stage the key / query / dO column chunks [BK + 2 BH, BC], the key and query rope rows,
    [BH + BK, BC] of conversion tiles. At value widths below one column chunk (the tiny preset, the V16 / V32 HF
    configs) the atomic form also stages its dS / P products (measured: up to 4.1 e x stages x BH x BK more; at V16
    up to 12% under the compiled size, where both are far below or both above the H200's limit), the rows form
    one [BK, BLOCK_C] tile more."""
    e = _elt(a, "Q")
    VP, RP, BH, BK = a["VP"], a["RP"], kw["BLOCK_H"], kw["BLOCK_K"]
    BC = min(kw["BLOCK_C"], VP)
    base = e * (stages * (BK * BC + 2 * BH * BC) + (BK + BH) * RP + (BH + BK) * BC) + SLACK
    if VP < kw["BLOCK_C"]:  # value widths below one column chunk (docstring)
        if a.get("DKV_OUT", "atomic") == "atomic":
            base += 17 * e * stages * BH * BK // 4
        else:
            base += e * BK * kw["BLOCK_C"]
    return base


def _smem_dsa_dq(kw: dict, warps: int, stages: int, a: dict) -> int:
    """Backward pass 2: the gathered key rows [BK, VP + RP], double-buffered; the dS tile [BH, BK] twice."""
    e = _elt(a, "KV")
    VP, RP, BH, BK = a["VP"], a["RP"], kw["BLOCK_H"], kw["BLOCK_K"]
    return e * (min(stages, 2) * BK * (VP + RP) + 2 * BH * BK) + SLACK


def _smem_indexer(kw: dict, warps: int, stages: int, a: dict) -> int:
    """Indexer scoring: the key tile [BS, DP] and a head's query tile [BT, DP]; the fp32 score tile [BT, BS]."""
    e = _elt(a, "Q", _elt(a, "KI"))
    DP, BT, BS = a["DP"], kw["BLOCK_T"], kw["BLOCK_S"]
    return e * (BS + BT) * DP + 4 * BT * BS + SLACK


def _smem_dsa_target(kw: dict, warps: int, stages: int, a: dict) -> int:
    """Sparse-stage KL target: the gathered key rows [BK, VP + RP] once, a head block's query rows [BH, VP + RP]
    per stage at 8 warps and once at 4 (measured: the 4-warp config keeps one copy at every width; counting two
    had pruned it at fp32 V512, 221184 B compiled), the score tile."""
    e = _elt(a, "Q")
    VP, RP, BH, BK = a["VP"], a["RP"], kw["BLOCK_H"], kw["BLOCK_K"]
    q_copies = 1 if warps <= 4 else stages
    return e * (BK * (VP + RP) + q_copies * BH * (VP + RP) + BH * BK) + SLACK


def _smem_kda_recurrence(kw: dict, warps: int, stages: int, a: dict) -> int:
    """KDA state recurrences: per chunk (stages deep) the [BT, BK] operand tiles (W, Kd, Qp), U / dO [BT, BV] and
    Aqk [BT, BT]; the state's operand copy [BK, BV] (equal to the compiled size at K = 32..256)."""
    e = _elt(a, "w", 2)
    BK, BV, BT = a["BK"], kw["BV"], a["BT"]
    return e * (stages * (3 * BT * BK + 2 * BT * BV + BT * BT) + BK * BV)


def _smem_gg_swap(kw: dict, warps: int, stages: int, a: dict) -> int:
    """bf16 grouped GEMM, swap-AB (pointer or TMA loads): per stage a weight tile [BF, BK] and a token tile
    [BT, BK] (the compiled size at aligned widths; unaligned ones stage less)."""
    e = _elt(a, "x", _elt(a, "y"))
    BF, BK, BT = kw["BF"], kw["BK"], kw.get("BT", a.get("BT", 128))
    return e * stages * (BF + BT) * BK + SLACK


def _smem_gg_wgrad(kw: dict, warps: int, stages: int, a: dict) -> int:
    """bf16 grouped weight gradient: a row chunk of both operands [rows, BA + BB] (double-buffered at most: the
    masked loads are not pipelined deeper; measured: one copy), the output tile's conversion [BA, BB] in the
    output's dtype (fp32 for fp32 parameters)."""
    e = _elt(a, "p")
    rows = a.get("BT", a.get("RMAX", 64))
    return e * min(stages, 2) * rows * (kw["BA"] + kw["BB"]) + _elt(a, "out", e) * kw["BA"] * kw["BB"] + SLACK


def _smem_fp8_mm(kw: dict, warps: int, stages: int, a: dict) -> int:
    """FP8 grouped GEMM forward (persistent): per stage the token tile [BM, BK] and weight tile [BK, BN] in fp8
    (an upper bound: the compiler stages one)."""
    e = _elt(a, "qx", 1)
    BM, BN, BK = kw["BM"], kw["BN"], a.get("BK", 128)
    return e * stages * (BM + BN) * BK + SLACK


def _smem_fp8_swap(kw: dict, warps: int, stages: int, a: dict) -> int:
    """FP8 grouped GEMM forward, swap-AB: per stage a weight tile [BF, BK] and a token tile [BK, BT]."""
    e = _elt(a, "qx", 1)
    BF, BT, BK = kw["BF"], a.get("BT", 64), a.get("BK", 128)
    return e * stages * (BF + BT) * BK + SLACK


def _smem_fp8_wgrad(kw: dict, warps: int, stages: int, a: dict) -> int:
    """FP8 grouped weight gradient: per stage the [BD, G] and [BF, G] fp8 tiles; the fp32 tile's conversion."""
    e = _elt(a, "qxT", 1)
    BD, BF, G = kw["BD"], kw["BF"], a.get("G", 128)
    return e * stages * (BD + BF) * G + 4 * BD * BF + SLACK


def _smem_tile(kw: dict, warps: int, stages: int, a: dict) -> int:
    """Elementwise / row-reduction kernels (no dots): at most one fp32 copy of the [rows, cols] tile for a layout
    conversion or a cross-warp reduction. rows, cols: the config's (or launch's) tile constexprs."""
    rows = next((v for k in ("BR", "BT", "BN") if (v := kw.get(k, a.get(k))) is not None), 1)
    cols = next((v for k in ("BV", "BC", "BI", "BD") if (v := kw.get(k, a.get(k))) is not None), 1)
    return 4 * rows * cols + 4 * a.get("BT", 0) * a.get("KP", 0) + SLACK


SMEM: dict[str, Callable[[dict, int, int, dict], int]] = {
    "dsa": _smem_dsa_fwd,
    "dsa_dkv": _smem_dsa_dkv,
    "dsa_dq": _smem_dsa_dq,
    "dsa_target": _smem_dsa_target,
    "indexer": _smem_indexer,
    "kda_recurrence": _smem_kda_recurrence,
    "gg_swap": _smem_gg_swap,
    "gg_tma_fwd": _smem_gg_swap,
    "gg_wgrad": _smem_gg_wgrad,
    "fp8_mm": _smem_fp8_mm,
    "fp8_swap": _smem_fp8_swap,
    "fp8_wgrad": _smem_fp8_wgrad,
    "tile": _smem_tile,
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


def fit_configs(configs: list, args: dict, family: str, limits: DeviceLimits | None = None,
                fallback: list = ()) -> list:
    """`fit` for an autotuned kernel's prune hook: args are its launch arguments (tensors and constexprs), the
    limits those of the tensors' device (none under the interpreter or for CPU tensors). `fallback`: configs
    tried only when none of `configs` fits (smaller tiles or fewer stages for shapes the tuned set cannot take),
    so they never change the candidates where the tuned set runs."""
    if limits is None:
        device = _device_of(args)
        if device is None or device.type != "cuda" or INTERPRET:
            return configs if autotune_enabled() else configs[:1]
        limits = device_limits(device.index if device.index is not None else torch.cuda.current_device())
    estimates = [smem_estimate(family, c, args) for c in configs]
    if fallback and not any(config_fits(c, e, limits) for c, e in zip(configs, estimates)):
        configs, estimates = list(fallback), [smem_estimate(family, c, args) for c in fallback]
    return fit(configs, estimates, limits)


def pruner(family: str, extra: Callable[[list, dict], list] | None = None, fallback: list = ()):
    """An `early_config_prune` hook: `extra(configs, args)` (optional, a kernel's own rule) then fit_configs."""

    def prune(configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        return fit_configs(extra(configs, args) if extra else configs, args, family, fallback=fallback)

    return prune


def _recurrence_fallback() -> list:
    try:
        import triton
    except ImportError:  # the kernels need Triton anyway
        return []
    # one stage (no chunk prefetch): the K = 256 head dims, where every two-stage config needs 236-272 KB
    return [triton.Config({"BV": 32}, num_warps=w, num_stages=1) for w in (4, 8)]


prune_recurrence = pruner("kda_recurrence", fallback=_recurrence_fallback())


def fits(smem: int, device: torch.device, warps: int = 4) -> bool:
    """Whether a fixed-config kernel needing `smem` bytes at `warps` warps runs on `device` (always off CUDA)."""
    if device.type != "cuda" or INTERPRET:
        return True
    limits = device_limits(device.index if device.index is not None else torch.cuda.current_device())
    return smem <= limits.smem and 32 * warps <= limits.threads
