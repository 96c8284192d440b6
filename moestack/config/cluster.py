"""ClusterSpec: the hardware a plan runs on (devices, memory, network tiers).

Units (in every field name): peak compute in TFLOP/s (1e12), HBM and host memory in GiB (2**30 bytes, what
`nvidia-smi` / `torch.cuda.mem_get_info` report), bandwidths in GB/s (1e9 bytes/s, per device, one direction),
latencies in microseconds. Presets live in `presets/cluster-<name>.yaml` with their sources in comments; a
cluster spec can also be any user YAML of the same shape.

Network tiers are ordered from the innermost (fastest, smallest domain) outward. A tier's `domain_size` is the
number of devices that reach each other through that tier (8 for an NVLink node, 72 for an NVL72 rack, 384 for
a CloudMatrix384 UB domain). The last tier spans the whole cluster; its `domain_size` may be left unset.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from moestack.config.base import ConfigError, StrictModel, read_yaml, validate

PRESET_DIR = Path(__file__).parent / "presets"
CLUSTER_PREFIX = "cluster-"

Dtype = Literal["fp32", "tf32", "bf16", "fp16", "fp8", "fp4"]  # fp4: NVFP4 / MXFP4 tensor cores (Blackwell)
GIB = 2**30


class DeviceSpec(StrictModel):
    """One accelerator: dense (non-sparse) peak compute per dtype, memory and host attachment."""

    name: str
    peak_tflops: dict[Dtype, float]  # dense peak per dtype; a missing dtype is unsupported (e.g. fp8 on A100)
    hbm_gib: float = Field(gt=0)
    hbm_bandwidth_gb_s: float = Field(gt=0)
    host_memory_gib: float = Field(default=0.0, ge=0)  # host DRAM available to this device (node DRAM / devices)
    host_link_gb_s: float = Field(default=0.0, ge=0)  # device <-> host, one direction (PCIe / C2C / UB)

    @model_validator(mode="after")
    def _check(self) -> DeviceSpec:
        if "bf16" not in self.peak_tflops:
            raise ValueError("peak_tflops must list bf16 (the dtype MFU is reported against)")
        bad = {k: v for k, v in self.peak_tflops.items() if v <= 0}
        if bad:
            raise ValueError(f"peak_tflops values must be > 0, got {bad}")
        return self

    def peak_flops(self, dtype: str) -> float:
        """Dense peak in FLOP/s for `dtype`; ConfigError naming the dtype if the device lacks it."""
        if dtype not in self.peak_tflops:
            raise ConfigError(f"device {self.name}: no {dtype} peak (has {', '.join(self.peak_tflops)})")
        return self.peak_tflops[dtype] * 1e12

    @property
    def hbm_bytes(self) -> float:
        return self.hbm_gib * GIB

    @property
    def host_memory_bytes(self) -> float:
        return self.host_memory_gib * GIB


class NetworkTier(StrictModel):
    """One level of the network: `domain_size` devices connected at `bandwidth_gb_s` per device each way."""

    name: str
    domain_size: int | None = Field(default=None, gt=0)  # None: the whole cluster (outermost tier only)
    bandwidth_gb_s: float = Field(gt=0)  # per device, one direction
    latency_us: float = Field(default=5.0, ge=0)
    efficiency: float = Field(default=0.8, gt=0, le=1)  # achievable fraction of bandwidth for large collectives


class ClusterSpec(StrictModel):
    name: str
    num_devices: int = Field(gt=0)
    device: DeviceSpec
    tiers: list[NetworkTier] = []  # innermost first; empty for a single device

    @model_validator(mode="after")
    def _check(self) -> ClusterSpec:
        sizes = [t.domain_size for t in self.tiers]
        for i, size in enumerate(sizes[:-1]):
            if size is None:
                raise ValueError(f"tiers[{i}].domain_size: only the outermost tier may leave it unset")
        known = [s for s in sizes if s is not None]
        for a, b in zip(known, known[1:]):
            if b <= a or b % a:
                raise ValueError(f"tier domain sizes must grow and each divide the next, got {known}")
        if self.num_devices > 1 and not self.tiers:
            raise ValueError(f"num_devices is {self.num_devices} but no network tiers are listed")
        if self.tiers and sizes[-1] is not None and sizes[-1] < self.num_devices:
            raise ValueError(
                f"the outermost tier's domain_size ({sizes[-1]}) is smaller than num_devices ({self.num_devices});"
                " add a tier or leave its domain_size unset"
            )
        return self

    def tier_domain(self, i: int) -> int:
        """Devices in one domain of tier i (the outermost tier: the whole cluster)."""
        size = self.tiers[i].domain_size
        return self.num_devices if size is None else min(size, self.num_devices)

    def with_devices(self, n: int) -> ClusterSpec:
        """The same hardware with `n` devices (`--devices N`); n must fill whole domains of the inner tiers."""
        if n <= 0:
            raise ConfigError(f"devices: must be > 0 (got {n})")
        for t in self.tiers[:-1]:
            assert t.domain_size is not None
            if n > t.domain_size and n % t.domain_size:
                raise ConfigError(
                    f"devices: {n} is not a multiple of the {t.name} domain ({t.domain_size} devices)"
                )
        last = self.tiers[-1] if self.tiers else None
        if last is not None and last.domain_size is not None and n > last.domain_size:
            raise ConfigError(f"devices: {n} exceeds the {last.name} domain ({last.domain_size}) of {self.name}")
        if not self.tiers and n > 1:
            raise ConfigError(f"devices: cluster {self.name} is a single device (got {n})")
        return self.model_copy(update={"num_devices": n})


def list_cluster_presets() -> list[str]:
    return sorted(p.stem[len(CLUSTER_PREFIX) :] for p in PRESET_DIR.glob(f"{CLUSTER_PREFIX}*.yaml"))


def load_cluster_spec(name_or_path: str | Path) -> ClusterSpec:
    """A cluster preset name (`cloudmatrix384`, `h200-cluster`, ...) or a path to a ClusterSpec YAML."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        return validate(ClusterSpec, read_yaml(p), str(p))
    preset = PRESET_DIR / f"{CLUSTER_PREFIX}{name_or_path}.yaml"
    if not preset.is_file():
        raise ConfigError(
            f"cluster: '{name_or_path}' is neither a preset ({', '.join(list_cluster_presets())}) nor a YAML file"
        )
    return validate(ClusterSpec, read_yaml(preset), f"cluster preset {name_or_path}")
