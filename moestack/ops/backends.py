"""Backends of the hot ops as small classes, one registry per op, and the build-time resolution of a KernelSpec.

Per op: the reference (pure torch, the spec, always available), the default fast path, and at most one
alternative chosen by capability inside it (each op's README names it). A backend says whether it can run on a
device at all (`unavailable`), whether it takes one call's inputs (`verify`), and whether "auto" may pick it for
them (`picks`: the Triton kernels also run on CPU tensors under TRITON_INTERPRET=1, but only when named).

"auto" resolves per call from the inputs alone (device, dtype, shape) and the `moestack tune` cache: no environment
variable is read here. `resolve_kernels(spec, device)` runs once when the model is built: it checks every named
backend can run on the device (ConfigError otherwise) and records what each op will run, for
`<out_dir>/kernels.json`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from moestack.config.base import ConfigError
from moestack.config.kernel_spec import AUTO, KernelSpec, kernel_fields
from moestack.ops import tuned


class Backend:
    """One implementation of one op. Subclasses set `name` and `fn` and override the checks they need."""

    name: ClassVar[str]
    fn: Callable

    def unavailable(self, device: torch.device) -> str | None:
        """Why this backend cannot run on `device` at all (not installed, wrong GPU); None = it can."""
        return None

    def verify(self, lead: torch.Tensor) -> str | None:
        """Why it cannot take a call whose first tensor is `lead` (dtype, shape); None = it can."""
        return self.unavailable(lead.device)

    def prefers(self, device: torch.device) -> bool:
        """May "auto" choose it on this device? Fast paths: CUDA only (the interpreter is for tests)."""
        return device.type == "cuda"

    def picks(self, lead: torch.Tensor) -> bool:
        """May "auto" choose it for this call (after verify passed)?"""
        return self.prefers(lead.device)


class ReferenceBackend(Backend):
    """Pure PyTorch, the spec: every device and dtype, always picked last."""

    name = "reference"

    def __init__(self, fn: Callable):
        self.fn = fn

    def prefers(self, device: torch.device) -> bool:
        return True


class Registry:
    """The backends of one op, in the order "auto" tries them (the reference last)."""

    def __init__(self, op: str, tuned_op: str | None = None):
        self.op, self.tuned_op = op, tuned_op
        self._backends: dict[str, Backend] = {}

    def register(self, backend: Backend, first: bool = False) -> None:
        """Add (or replace) a backend; first: try it before the others in "auto"."""
        self._backends.pop(backend.name, None)
        if first:
            self._backends = {backend.name: backend, **self._backends}
        else:
            self._backends[backend.name] = backend
        if "reference" in self._backends:  # the reference stays last
            self._backends["reference"] = self._backends.pop("reference")

    def names(self) -> list[str]:
        return list(self._backends)

    def get(self, name: str) -> Backend:
        if name not in self._backends:
            raise ValueError(f"unknown {self.op} backend {name!r}; registered: {', '.join(self._backends)}")
        return self._backends[name]

    def auto_for_device(self, device: torch.device) -> str:
        """What "auto" picks on `device` for calls its backends take (the run record; per call, inputs that a fast
        path does not take, e.g. fp64, still go to the next one)."""
        for b in self._backends.values():
            if b.unavailable(device) is None and b.prefers(device):
                return b.name
        return "reference"

    def pick(self, name: str | None, lead: torch.Tensor, tuned_key: Callable[[], str] | None = None) -> Backend:
        """The backend that runs this call: `name` (must take the inputs: else ValueError), or for None / "auto"
        a `moestack tune` choice for this shape, else the first that verifies and picks these inputs."""
        if name not in (None, AUTO):
            b = self.get(name)
            why = b.verify(lead)
            if why is not None:
                raise ValueError(f"{self.op} backend {name!r} cannot run this call: {why}")
            return b
        if self.tuned_op is not None and tuned_key is not None:
            choice = tuned.lookup(self.tuned_op, tuned_key(), lead.device)
            b = self._backends.get(choice) if choice else None
            if b is not None and b.verify(lead) is None:
                return b
        for b in self._backends.values():
            if b.verify(lead) is None and b.picks(lead):
                return b
        raise AssertionError(f"{self.op}: the reference backend is always usable")

    def check(self, name: str, device: torch.device, field_name: str) -> str:
        """Build-time check of a named choice; returns the name (ConfigError naming the field otherwise)."""
        try:
            b = self.get(name)
        except ValueError as err:
            raise ConfigError(f"kernels.{field_name}: {err}") from None
        why = b.unavailable(device)
        if why is not None:
            raise ConfigError(f"kernels.{field_name}: {name!r} cannot run on {device}: {why}; use auto or reference")
        return name


@dataclass
class Choice:
    """One op's resolved choice: what was asked (and where from), and what runs."""

    requested: str
    runs: str
    source: str = "spec"  # "spec" (set in the TrainSpec / Plan) or "default"


@dataclass
class ResolvedKernels:
    """A KernelSpec resolved for one device: the (overridden) spec the modules receive, and the record."""

    spec: KernelSpec
    device: str
    choices: dict[str, Choice] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"device": self.device, "kernels": {k: asdict(v) for k, v in self.choices.items()},
                "tuned_hits": tuned.hits()}

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1, sort_keys=True) + "\n")

    def summary(self) -> str:
        ops = ("kda.backend", "kda.layer_ops", "dsa.backend", "moe.routing", "moe.gemm", "adamw.backend")
        return f"kernels on {self.device}: " + ", ".join(f"{k} {self.choices[k].runs.split(' ')[0]}" for k in ops
                                                         if k in self.choices)


def _registries() -> dict[str, Registry]:
    """KernelSpec field -> the registry that serves it (imported here: ops packages register on import)."""
    from moestack.ops import dsa, kda, moe
    from moestack.ops.moe import routing

    return {"kda.backend": kda.REGISTRY, "dsa.backend": dsa.REGISTRIES["sparse_mqa_attention"],
            "moe.routing": routing.REGISTRY, "moe.gemm": moe.REGISTRY}


def resolve_kernels(spec: KernelSpec | None, device: torch.device | str) -> ResolvedKernels:
    """Check every named backend can run on `device` and record the choices."""
    from moestack.ops.launch import set_autotune

    device = torch.device(device)
    spec = spec if spec is not None else KernelSpec()
    default = kernel_fields(KernelSpec())
    out = ResolvedKernels(spec, str(device))
    registries = _registries()
    for name, value in kernel_fields(spec).items():
        source = "spec" if value != default[name] else "default"
        if name in registries:
            reg = registries[name]
            runs = reg.auto_for_device(device) if value == AUTO else reg.check(str(value), device, name)
            if value == AUTO and reg.tuned_op and device.type == "cuda":
                runs += " (or the tune cache's choice per shape)"
            out.choices[name] = Choice(str(value), runs, source)
        elif name == "adamw.backend":
            from moestack.ops.adamw import triton_unavailable

            why = triton_unavailable(device) if device.type == "cuda" else "the Triton AdamW runs on CUDA only"
            if value == "triton" and why is not None:
                raise ConfigError(f"kernels.adamw.backend: 'triton' cannot run on {device}: {why}; use auto or torch")
            runs = ("triton" if why is None else "torch") if value == AUTO else str(value)
            out.choices[name] = Choice(str(value), runs, source)
        elif name == "kda.layer_ops":
            runs = ("triton" if device.type == "cuda" else "torch") if value == AUTO else str(value)
            if value == "triton":
                why = registries["kda.backend"].get("triton").unavailable(device)
                if why is not None:
                    raise ConfigError(f"kernels.kda.layer_ops: 'triton' cannot run on {device}: {why}; use auto")
            out.choices[name] = Choice(str(value), runs, source)
        else:
            out.choices[name] = Choice(str(value), str(value), source)
    if spec.moe.crossover is not None and not Path(spec.moe.crossover).is_file():
        raise ConfigError(f"kernels.moe.crossover: {spec.moe.crossover}: file not found (write one with "
                          "benchmarks/grouped_gemm.py --write-crossover)")
    set_autotune(spec.autotune)
    return out
