"""Host (CPU) time per framework: whose Python and kernel launches a plan's step waits for (Plan.host_profile,
`moestack plan --host-profile NAME`).

The device cannot run ahead of the host that launches its kernels, so the cost model (planner/cost/) prices each rank's
forward (backward) pass of a micro-batch at max(device, host) (CostModel.host_times). How long the host takes per layer
belongs to the training code, not to the GPU:

  eager            moestack's eager trainer (the default): Calibration.host, fitted on 2 x H200 runs of the proxy
                   or measured by `moestack tune --measure-host` (calibration.HostCalibration says how).
  blocks           moestack's trainer with compiled blocks (TrainSpec.compile blocks; a plan priced on it runs
                   them): Calibration.host_modes["blocks"], measured by `moestack tune --measure-host` on the GPU.
  megatron         Megatron-LM / Megatron-Bridge without CUDA graphs.
  megatron-graphs  Megatron-Bridge with Transformer Engine CUDA graphs of the attention, router and MoE preprocess.
  megatron-full-graphs  Megatron-Bridge with the whole iteration captured (cuda_graph_impl full_iteration): no host
                   time, and the MoE dispatch runs without a host sync (it must, to be captured).

The compiled modes have no default: their constants exist only where tune measured them (a calibration without them
is refused when the problem is loaded, `check_host_profile`), because a host time guessed for them would make the
planner prefer layouts that only a fast host can feed.
"""

from __future__ import annotations

from moestack.config.base import ConfigError
from moestack.planner.calibration import COMPILED_HOST_MODES, Calibration, HostCalibration

# Megatron's constants are fitted, not measured (no Megatron run can be timed here): least squares in log(predicted /
# published) over the 11 MoE runs of tests/data/planner/published_runs.yaml (Megatron-Bridge 26.04.01 and 25.09
# performance tables; grid layer_s 4 ms, ep_moe_s 2-8 ms, moe_sync_s 0-2 ms), with the FP8 GEMM factor and the memory
# terms fixed first. The dense runs are device-bound (7-37 ms of kernels per layer per micro-batch) and do not
# constrain them; nor do the CUDA-graph runs constrain their ep_moe_s, which is set to the eager profile's (the
# expert path, dispatch to combine, is outside the captured scopes attn / moe_router / moe_preprocess). What the fit
# says: the eager host spends ~4 ms per layer per micro-batch (forward + backward), ~4 ms more in a MoE layer under
# EP, and a dropless MoE layer's token-count sync leaves the device idle ~1.5 ms per forward, graphs or not.
HOST_PROFILES: dict[str, HostCalibration] = {
    "megatron": HostCalibration(layer_s=0.004, ep_moe_s=0.004, tp_layer_s=0.0, fp8_layer_s=0.0, moe_sync_s=0.0015,
                                source="Megatron-LM / Megatron-Bridge without CUDA graphs: fitted on published runs"),
    "megatron-graphs": HostCalibration(layer_s=0.0, ep_moe_s=0.004, tp_layer_s=0.0, fp8_layer_s=0.0, moe_sync_s=0.0015,
                                       source="Megatron-Bridge with TE CUDA graphs: fitted on published runs"),
    "megatron-full-graphs": HostCalibration(layer_s=0.0, ep_moe_s=0.0, tp_layer_s=0.0, fp8_layer_s=0.0,
                                            moe_sync_s=0.0, source="Megatron-Bridge full-iteration CUDA graphs"),
}


# the training code a profile names, for the terms where it saves tensors differently (cost.megatron_saved_delta)
FRAMEWORK = {"eager": "moestack", "blocks": "moestack", "megatron": "megatron", "megatron-graphs": "megatron",
             "megatron-full-graphs": "megatron"}


def framework_of(profile: str) -> str:
    return FRAMEWORK[profile]


def host_calibration(profile: str, cal: Calibration) -> HostCalibration:
    """The host constants of `profile` ("eager": the calibration's own; "blocks": its measured host_modes entry, a
    ConfigError where tune has not measured it)."""
    if profile == "eager":
        return cal.host
    if profile in COMPILED_HOST_MODES:
        check_host_profile(profile, cal)
        return cal.host_modes[profile]
    return HOST_PROFILES[profile]


def check_host_profile(profile: str, cal: Calibration) -> None:
    """One-line ConfigError when `profile` is a compiled mode the calibration has no measured constants for."""
    if profile in COMPILED_HOST_MODES and profile not in cal.host_modes:
        raise ConfigError(f"host-profile {profile}: the calibration ({cal.device}) has no host constants measured for "
                          f"compiled blocks; run `moestack tune --measure-host --out cal.json` on the GPU and plan "
                          f"with --calibration cal.json, or use --host-profile eager (an upper bound)")
