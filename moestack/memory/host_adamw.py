"""Fast AdamW on host (CPU) tensors: what the optimizer offload and host-resident experts step with.

Why: the CPU paths of moestack.memory.adamw step one tensor at a time with torch's single-tensor AdamW (~10
elementwise passes over 4-byte arrays) or, for bf16 states, with `adamw_bf16_update`, whose stochastic rounding
draws its noise with `torch.randint` (serial on the CPU): several times slower than one fused pass (README.md has
the numbers). Here:

- fp32 states: `torch._fused_adamw_` (one multi-threaded pass; the same math as torch.optim.AdamW, not bitwise
  the single-tensor result: fused and single-tensor AdamW round differently in the last bit).
- bf16 states (stochastic rounding, as AdamWBF16): in chunks of `CHUNK` elements (cache-sized): the chunk's m, v are
  widened to fp32 scratch, `torch._fused_adamw_` updates the fp32 master and the scratch, and the scratch is
  rounded back with noise read from a fixed table of uniform 16-bit integers at a random offset per chunk and
  state. Each element's noise is uniform on [0, 2^16) whatever the offset, so the rounding stays unbiased
  (E[round(x)] = x, what the EMA increments need); noise of neighbouring elements is correlated across calls,
  which unbiasedness does not need. The table is drawn once from the optimizer's seed.

`HostOffloadAdamW` is CPUOffloadAdamW (same state layout, checkpoints, side-stream gradient copies) with these
kernels; `build_host_aware_optimizer` (moestack/train/optimizers.py) picks it for Plan.offload.optimizer, and torch's
AdamW with `fused=True` (CPU and CUDA both supported) when some parameters live on the host (expert offload) without
optimizer offload.

Resume. With bf16 states `HostOffloadAdamW.state_dict()` carries the noise source's state (`RoundingNoise.state()`:
the table's seed and the offset RNG's state, one per rank) through RoundingStateMixin, as AdamWBF16 does (where and
why: moestack.memory.adamw, module docstring).
"""

from __future__ import annotations

import random

import torch
from torch.autograd.graph import increment_version

from moestack.memory.adamw import CPUOffloadAdamW, adamw_bf16_update

CHUNK = 1 << 19  # elements per bf16-state chunk: fp32 master + grad + m, v scratch + noise ~ 10 MB
NOISE = 1 << 22  # entries of the rounding-noise table (16 MiB)


def fused_adamw_(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: torch.Tensor, lr: float,
                 b1: float, b2: float, eps: float, wd: float) -> None:
    """One AdamW update in place with torch's fused kernel (p, g, m, v of one dtype; `step` already counted).
    The fused kernel does not bump `p`'s version counter: done here, because ExpertOffload refreshes its bf16
    transfer shadows when a weight's version changes."""
    torch._fused_adamw_([p], [g], [m], [v], [], [step], lr=lr, beta1=b1, beta2=b2, weight_decay=wd, eps=eps,
                        amsgrad=False, maximize=False)
    increment_version(p)


class FusedAdamW(torch.optim.AdamW):
    """torch.optim.AdamW(fused=True) that bumps the version counter of every parameter it stepped (torch's fused
    kernels do not; ExpertOffload's bf16 shadows of host-resident experts are refreshed on a version change)."""

    def __init__(self, params, **kwargs):
        super().__init__(params, fused=True, **kwargs)

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        stepped = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        if stepped:
            increment_version(stepped)
        return loss


class RoundingNoise:
    """A table of uniform 16-bit integers (int32) and random offsets into it (module docstring)."""

    def __init__(self, seed: int, size: int = NOISE, chunk: int = CHUNK):
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randint(0, 1 << 16, (size + chunk,), dtype=torch.int32, generator=g)
        self.seed, self.size, self.chunk, self.rng = seed, size, chunk, random.Random(seed)

    def state(self) -> tuple:
        """("table", seed, size, chunk, offset RNG state): what decides every later draw."""
        return ("table", self.seed, self.size, self.chunk, self.rng.getstate())

    def set_state(self, state: tuple) -> None:
        _, seed, size, chunk, rng_state = state
        if (seed, size, chunk) != (self.seed, self.size, self.chunk):
            self.__init__(seed, size, chunk)  # the saved run's table
        version, internal, gauss = rng_state  # tuples again, whatever container a checkpoint gave back
        self.rng.setstate((version, tuple(internal), gauss))

    def take(self, n: int) -> torch.Tensor:
        if n > self.table.numel():
            raise ValueError(f"noise for {n} elements from a table of {self.table.numel()}")
        o = self.rng.randrange(self.table.numel() - n + 1)
        return self.table[o:o + n]


def _round_into(dst_bf16: torch.Tensor, src32: torch.Tensor, noise: torch.Tensor) -> None:
    """dst = stochastic bf16 rounding of src (src is overwritten): ((bits + noise) & ~0xffff), then an exact cast."""
    src32.view(torch.int32).add_(noise).bitwise_and_(-65536)
    dst_bf16.copy_(src32)


class _Scratch:
    def __init__(self):
        self.m32 = self.v32 = None

    def get(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.m32 is None or self.m32.numel() < n:
            self.m32, self.v32 = torch.empty(n), torch.empty(n)
        return self.m32[:n], self.v32[:n]


def adamw_bf16_states_(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: torch.Tensor,
                       lr: float, b1: float, b2: float, eps: float, wd: float, noise: RoundingNoise,
                       scratch: _Scratch | None = None, chunk: int = CHUNK) -> None:
    """AdamW on fp32 master `p` (CPU) with bf16 m, v (stochastic rounding), chunk by chunk (module docstring)."""
    if not (p.is_contiguous() and g.is_contiguous() and m.is_contiguous() and v.is_contiguous()):
        adamw_bf16_update(p, g, m, v, int(step), lr, b1, b2, eps, wd,
                           torch.Generator().manual_seed(noise.rng.randrange(1 << 62)))
        return
    pf, gf, mf, vf = p.view(-1), g.view(-1).to(p.dtype), m.view(-1), v.view(-1)
    scratch = scratch or _Scratch()
    n_all = pf.numel()
    for a in range(0, n_all, chunk):
        b = min(a + chunk, n_all)
        m32, v32 = scratch.get(chunk)
        m32, v32 = m32[:b - a], v32[:b - a]
        m32.copy_(mf[a:b])
        v32.copy_(vf[a:b])
        fused_adamw_(pf[a:b], gf[a:b], m32, v32, step, lr, b1, b2, eps, wd)
        _round_into(mf[a:b], m32, noise.take(b - a))
        _round_into(vf[a:b], v32, noise.take(b - a))


class HostOffloadAdamW(CPUOffloadAdamW):
    """CPUOffloadAdamW (moestack.memory.adamw: masters and states in host memory, gradients copied on a side
    stream, weights copied back while the CPU moves on) stepping with the fast host kernels of this module. Only
    what is copied is pinned (the masters; the gradient staging): m and v never leave the host, so they are plain
    memory (pinning is slow, and torch's pinned allocator rounds every tensor up to a power of two)."""

    pin_moments = False  # m and v never leave the host

    def __init__(self, *args, seed: int = 0, **kwargs):
        super().__init__(*args, seed=seed, **kwargs)
        self._noise = RoundingNoise(seed) if self.state_dtype == torch.bfloat16 else None
        self._scratch = _Scratch()

    # -- resume: the rounding noise (module docstring; state_dict / load_state_dict: RoundingStateMixin) -----
    def _rounding_state(self):
        return self._noise.state() if self._noise is not None else None

    def _set_rounding_state(self, state) -> None:
        self._noise.set_state(state)

    def _update(self, master: torch.Tensor, host_grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, state: dict,
                group: dict) -> None:
        """CPUOffloadAdamW's update with torch's fused CPU AdamW kernel (bf16 states: by chunks, table noise)."""
        b1, b2 = group["betas"]
        state["step"] += 1
        hp = (group["lr"], b1, b2, group["eps"], group["weight_decay"])
        if self.state_dtype == torch.bfloat16:
            adamw_bf16_states_(master, host_grad, m, v, state["step"], *hp, self._noise, self._scratch)
        else:
            fused_adamw_(master, host_grad.to(master.dtype), m, v, state["step"], *hp)
