"""Memory-saving AdamW: bf16 states with stochastic rounding (AdamWBF16), the fp32 master and states offloaded to
the host (CPUOffloadAdamW), and the rounding noise's state in the state dict (RoundingStateMixin). Below train/
in the layers: moestack.train.optimizers builds these by name, moestack.memory.host_adamw steps them faster.

AdamWBF16. m and v are stored in bf16 and written back with stochastic rounding: the fp32 result's bit pattern
gets a uniform random 16-bit integer added below the bf16 mantissa before truncation, so E[round(x)] = x and the
many small EMA increments that round-to-nearest would drop (v += (1 - b2) g^2 is often below half a bf16 ulp of
v) survive on average. The arithmetic is AdamW's, in fp32, on the fp32 master weights. Stochastic rounding was
chosen over Kahan compensation because compensation needs a second bf16 buffer per state (back to 8 bytes).
Measured deviation from fp32 AdamW: tests/memory/test_optimizers.py (a few hundred steps on a small regression).

CPUOffloadAdamW (ZeRO-Offload style). Gradients are copied device -> pinned host on a side stream, each
parameter's AdamW update runs on the CPU as soon as its gradient has arrived (while later gradients are still
copying), and the updated fp32 master is copied back to the device parameter on another stream while the CPU
moves on to the next parameter. The math is torch's AdamW (single-tensor path), so on a CPU-only run it matches
torch.optim.AdamW exactly. A pinned host parameter (an offloaded expert) is its own master and is stepped in place.

Resume. With stochastic rounding the noise is part of the trajectory, so the optimizers that draw it (AdamWBF16,
CPUOffloadAdamW with bf16 states, moestack.memory.host_adamw.HostOffloadAdamW) carry the noise source's state in
their state dict (`RoundingStateMixin`): under `param_groups[i]["rounding_rng"]` (i: the first group with
parameters), one entry per rank. It lives in a param group because torch.distributed.checkpoint's get_state_dict /
set_state_dict (moestack.train.checkpoint) keep only "state" and "param_groups" of an optimizer's state dict. A
state dict without it loads with one warning and the noise restarts from the seed.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw as _adamw  # the functional AdamW torch.optim.AdamW runs


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; any other tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t

# ------------------------------------------------------------------------------------------------------------
# stochastic rounding


def stochastic_round_bf16(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """fp32 x -> bf16, rounding each element up or down in magnitude with probability proportional to the
    distance (unbiased). Exact for values representable in bf16."""
    assert x.dtype == torch.float32, x.dtype
    bits = x.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    return ((bits + noise) & -65536).view(torch.float32).to(torch.bfloat16)  # low 16 bits zero: exact cast


class _Generators:
    """One seeded generator per device (stochastic rounding must not consume the model's RNG stream)."""

    def __init__(self, seed: int):
        self.seed, self.table = seed, {}
        self._pending: dict[str, bytes] = {}  # loaded states of generators not created yet (by str(device))

    def __call__(self, device: torch.device) -> torch.Generator:
        if device not in self.table:
            gen = torch.Generator(device=device).manual_seed(self.seed)
            saved = self._pending.pop(str(device), None)
            if saved is not None:
                gen.set_state(torch.frombuffer(bytearray(saved), dtype=torch.uint8))
            self.table[device] = gen
        return self.table[device]

    def state(self) -> tuple:
        """("generator", seed, {device: generator state bytes}): what decides every later draw."""
        states = dict(self._pending)
        states.update({str(d): g.get_state().numpy().tobytes() for d, g in self.table.items()})
        return ("generator", self.seed, states)

    def set_state(self, state: tuple) -> None:
        _, seed, states = state
        self.seed, self.table = seed, {}
        self._pending = {str(d): bytes(b) for d, b in states.items()}  # applied as each device's generator appears


# ------------------------------------------------------------------------------------------------------------
# resume: the rounding noise's state in the state dict (module docstring)

ROUNDING_RNG_KEY = "rounding_rng"
NO_ROUNDING_STATE = "rounding noise restarts: the state dict has no rounding-noise state"  # the warning's text


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class RoundingStateMixin:
    """state_dict / load_state_dict that carry the stochastic-rounding noise source's state of every rank under
    `param_groups[i][ROUNDING_RNG_KEY]` = {"version": 1, "per_rank": [state of rank r, ...]} (i: the first group
    with parameters). Subclasses say what the state is: `_rounding_state()` (a picklable tuple whose first item
    names the kind of noise source, "generator" or "table", or None: no stochastic rounding) and
    `_set_rounding_state(state)`.

    With several ranks state_dict gathers (collective, as checkpoint saves are): DCP keeps one copy of a non-tensor
    entry, so every rank writes the same list and each reads back its own."""

    def _rounding_state(self):
        return None

    def _set_rounding_state(self, state) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict:
        sd = super().state_dict()
        mine = self._rounding_state()
        if mine is None or not sd["param_groups"]:
            return sd
        _, world = _world()
        if world > 1:
            per_rank = [None] * world
            dist.all_gather_object(per_rank, mine)
        else:
            per_rank = [mine]
        groups = sd["param_groups"]
        target = next((g for g in groups if g["params"]), groups[0])
        target[ROUNDING_RNG_KEY] = {"version": 1, "per_rank": per_rank}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        saved = None
        for group in state_dict.get("param_groups", []):
            if ROUNDING_RNG_KEY in group:
                saved = saved or group[ROUNDING_RNG_KEY]
        super().load_state_dict(state_dict)
        for group in self.param_groups:  # torch copied it into the live groups; it is not a hyper-parameter
            group.pop(ROUNDING_RNG_KEY, None)
        mine = self._rounding_state()
        if mine is None:
            return
        name = type(self).__name__
        if saved is None:
            warnings.warn(f"{name}: {NO_ROUNDING_STATE} (saved before it was kept) and restarts from the seed, so "
                          "the resumed run is not bitwise the uninterrupted one", stacklevel=2)
            return
        rank, world = _world()
        per_rank = saved["per_rank"]
        if len(per_rank) != world:
            warnings.warn(f"{name}: rounding-noise state saved by {len(per_rank)} ranks, loading on {world}; "
                          "stochastic-rounding noise restarts from the seed", stacklevel=2)
            return
        state = tuple(per_rank[rank])
        if state[0] != mine[0]:
            warnings.warn(f"{name}: rounding-noise state of another noise source ({state[0]}, this optimizer draws "
                          f"from a {mine[0]}); stochastic-rounding noise restarts from the seed", stacklevel=2)
            return
        self._set_rounding_state(state)


def adamw_bf16_update(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int,
                       lr: float, b1: float, b2: float, eps: float, wd: float, gen: torch.Generator) -> None:
    """One AdamW update of fp32 p with bf16 states m, v (in place), in the order of torch's AdamW."""
    g = g.float()
    m32 = m.float().lerp_(g, 1 - b1)
    v32 = v.float().mul_(b2).addcmul_(g, g, value=1 - b2)
    p.mul_(1 - lr * wd)
    denom = (v32.sqrt() / math.sqrt(1 - b2**step)).add_(eps)
    p.addcdiv_(m32.to(p.dtype), denom.to(p.dtype), value=-lr / (1 - b1**step))
    m.copy_(stochastic_round_bf16(m32, gen))
    v.copy_(stochastic_round_bf16(v32, gen))


class AdamWBF16(RoundingStateMixin, torch.optim.Optimizer):
    """AdamW with m and v stored in bf16 (stochastic rounding; see module docstring). fp32 parameters stay.

    Args as torch.optim.AdamW (lr, betas, eps, weight_decay; param groups may override), plus `seed` for the
    rounding noise. State per parameter: step (int), exp_avg and exp_avg_sq (bf16, the parameter's shape); the
    generators' states in the state dict (RoundingStateMixin).
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, seed: int = 0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self._gen = _Generators(seed)

    def _rounding_state(self):
        return self._gen.state()

    def _set_rounding_state(self, state) -> None:
        self._gen.set_state(state)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16)
                state["step"] += 1
                pl = local_tensor(p)
                adamw_bf16_update(pl, local_tensor(p.grad), local_tensor(state["exp_avg"]),
                                  local_tensor(state["exp_avg_sq"]), state["step"], group["lr"], b1, b2, group["eps"],
                                  group["weight_decay"], self._gen(pl.device))
        return loss


# ------------------------------------------------------------------------------------------------------------
# CPU-offloaded AdamW


class CPUOffloadAdamW(RoundingStateMixin, torch.optim.Optimizer):
    """AdamW whose fp32 master weights and states live in (pinned) host memory; the update runs on the CPU.

    Args as torch.optim.AdamW, plus `state_dtype` (torch.float32, or torch.bfloat16 for bf16 m, v with
    stochastic rounding as AdamWBF16) and `seed` (rounding noise). The device parameters keep their dtype (fp32
    in moestack: the device then holds no optimizer state at all; bf16 device parameters would also halve the
    weights). State per parameter: master (host copy, absent for pinned host parameters), step, exp_avg,
    exp_avg_sq (host); with bf16 states the rounding generator's state in the state dict (RoundingStateMixin).
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, state_dtype: torch.dtype = torch.float32, seed: int = 0):
        if state_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"state_dtype must be float32 or bfloat16, got {state_dtype}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.state_dtype = state_dtype
        self._gen = _Generators(seed)
        self._d2h = self._h2d = None
        self._grad_staging: dict[int, torch.Tensor] = {}
        if torch.cuda.is_available():
            self._d2h, self._h2d = torch.cuda.Stream(), torch.cuda.Stream()

    def _rounding_state(self):
        return self._gen.state() if self.state_dtype == torch.bfloat16 else None

    def _set_rounding_state(self, state) -> None:
        self._gen.set_state(state)

    # -- host state ------------------------------------------------------------------------------------------
    @staticmethod
    def _in_place(p: torch.Tensor) -> bool:
        """A pinned fp32+ host parameter is its own master."""
        local = local_tensor(p)
        return local.device.type == "cpu" and local.is_pinned() and local.dtype != torch.bfloat16

    def _init_state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if state:
            return state
        local = local_tensor(p).detach()
        master_dtype = torch.promote_types(local.dtype, torch.float32)
        moment_dtype = torch.bfloat16 if self.state_dtype == torch.bfloat16 else master_dtype
        if not self._in_place(p):
            state["master"] = self._host_like(p, master_dtype)
            local_tensor(state["master"]).copy_(local)
        state["step"] = torch.zeros((), dtype=torch.float32)
        for key in ("exp_avg", "exp_avg_sq"):
            state[key] = self._host_like(p, moment_dtype, pin=self.pin_moments)
            local_tensor(state[key]).zero_()
        return state

    pin_moments = True  # m, v in pinned memory (subclasses that never copy them may say no)

    def _host_like(self, p: torch.Tensor, dtype: torch.dtype, pin: bool = True) -> torch.Tensor:
        """A host tensor of p's local shape (pinned when `pin` and a GPU is present); a DTensor with p's mesh and
        placements when p is one (so sharded checkpoints see sharded states)."""
        local = local_tensor(p)
        host = torch.empty(local.shape, dtype=dtype, device="cpu", pin_memory=pin and torch.cuda.is_available())
        if isinstance(p, DTensor):
            return DTensor.from_local(host, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                      stride=p.stride())
        return host

    def _master(self, p: torch.Tensor) -> torch.Tensor:
        return local_tensor(self.state[p]["master"]) if "master" in self.state[p] else local_tensor(p).detach()

    # -- step ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        if self._h2d is not None:  # last step's weight copies are done; this step's wait for backward's reads
            self._h2d.synchronize()
            self._h2d.wait_stream(torch.cuda.current_stream())
        work = [(group, p) for group in self.param_groups for p in group["params"] if p.grad is not None]
        grads = self._grads_to_host([p for _, p in work])
        for (group, p), (host_grad, event) in zip(work, grads):
            if event is not None:
                event.synchronize()  # this gradient has arrived; later ones are still copying
            state = self._init_state(p)
            master = self._master(p)
            self._update(master, host_grad, local_tensor(state["exp_avg"]), local_tensor(state["exp_avg_sq"]), state,
                         group)
            if "master" in state:
                self._to_device(p, master)
        if self._h2d is not None:
            torch.cuda.current_stream().wait_stream(self._h2d)  # the next forward reads the new weights
        return loss

    def _update(self, master: torch.Tensor, host_grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, state: dict,
                group: dict) -> None:
        """One AdamW update of the host master and states (counts the step); subclasses swap the kernels."""
        b1, b2 = group["betas"]
        if self.state_dtype == torch.bfloat16:
            state["step"] += 1
            adamw_bf16_update(master, host_grad, m, v, int(state["step"]), group["lr"], b1, b2, group["eps"],
                               group["weight_decay"], self._gen(torch.device("cpu")))
        else:
            _adamw([master], [host_grad.to(master.dtype)], [m], [v], [], [state["step"]], foreach=False,
                   amsgrad=False, beta1=b1, beta2=b2, lr=group["lr"], weight_decay=group["weight_decay"],
                   eps=group["eps"], maximize=False)

    def _grads_to_host(self, params: list[torch.Tensor]) -> list[tuple[torch.Tensor, object]]:
        """Start every gradient's D2H copy (in order, on the side stream); (host grad, event) per parameter."""
        out = []
        for p in params:
            g = local_tensor(p.grad)
            if g.device.type == "cpu":
                out.append((g, None))
                continue
            staging = self._grad_staging.get(id(p))
            if staging is None or staging.shape != g.shape or staging.dtype != g.dtype:
                staging = torch.empty(g.shape, dtype=g.dtype, device="cpu", pin_memory=True)
                self._grad_staging[id(p)] = staging
            self._d2h.wait_stream(torch.cuda.current_stream(g.device))
            with torch.cuda.stream(self._d2h):
                staging.copy_(g, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._d2h)
            out.append((staging, event))
        return out

    def _to_device(self, p: torch.Tensor, master: torch.Tensor) -> None:
        dst = local_tensor(p)
        if dst.device.type == "cpu":
            dst.copy_(master)
            return
        with torch.cuda.stream(self._h2d):
            dst.copy_(master, non_blocking=True)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch moves loaded states to each parameter's device; keep them on the host and resync the params."""
        super().load_state_dict(state_dict)
        for p, state in self.state.items():
            for key in ("master", "exp_avg", "exp_avg_sq"):
                if key in state and local_tensor(state[key]).device.type != "cpu":
                    host = self._host_like(p, state[key].dtype)
                    local_tensor(host).copy_(local_tensor(state[key]))
                    state[key] = host
            if "master" in state:
                local_tensor(p).detach().copy_(local_tensor(state["master"]))
