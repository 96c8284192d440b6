"""Measure the host (Python + launch) time of moestack's eager training step on this machine: the floor under the
device time that planner/cost/ prices as `Calibration.host.layer_s` per layer per micro-batch.

What runs is what the single-device trainer runs for one micro-batch (moestack/train/trainer.py `_forward_backward`
with one accumulation step): the whole model (embedding, blocks, norm, chunked loss over the head) in fp32 weights
under bf16 autocast on CUDA (fp32 without autocast on CPU, as `precision: auto` does), `model(inputs, targets)`,
`loss.backward()`, `loss.item()`, gradients set to None between micro-batches as `zero_grad(set_to_none=True)`
leaves them. Not the optimizer step, the clip or the router-bias update: they run once per step, not per
micro-batch, and the cost model prices the optimizer on its own.

Why the device work is negligible: at 1 x 256 tokens every kernel is a few microseconds on a datacenter GPU while
the host spends ~20 ms per layer on Python, autograd and launches (the default fit), so the device idles waiting
for launches and the wall time of the synchronised region is the host's. The check: the same pass at twice the
tokens (batch 2). Host work does not depend on the token count, device work grows with it; a wall time that barely
changes (`growth_2x` near 0) says the step is host-bound. A larger growth says device time leaks in, and the
measured layer_s is then an upper bound (tune says so).

Timing is wall clock (`time.perf_counter`) with `torch.cuda.synchronize()` before and after the region, not CUDA
events: events give the device's time, which here is mostly idle gaps waiting for the host anyway, but wall time
is the quantity the floor stands for. Warm-up runs first (Triton autotuning and compilation at these shapes, the
caching allocator's first allocations), then the median of the timed runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from moestack.config.model_spec import LayerKind, ModelSpec
from moestack.config.train_spec import CompileSpec

BYTES_PER_PARAM = 10.0  # fp32 weight + fp32 gradient + the bf16 autocast copy alive during the pass
MEMORY_FRACTION = 0.6  # of the free device memory the measured model may take


@dataclass
class HostTiming:
    """One host measurement. `layer_s` is what cost/step.py's `host_times` multiplies by the layers of a rank to get
    the host seconds of one micro-batch's forward + backward (tp = ep = 1, no recompute)."""

    wall_s: float  # median wall seconds of one micro-batch forward + backward at `tokens`
    wall_2x_s: float  # the same at twice the tokens (batch 2): the host-bound check
    tail_s: float  # median wall seconds between the host returning from backward and the device finishing
    tokens: int  # tokens of the micro-batch (1 sequence)
    reps: int  # timed runs behind `wall_s`
    layers_built: int  # blocks in the model that ran (fewer than the spec's when the spec does not fit)
    layers_trained: int  # blocks the trainer runs for the spec (spec.num_layers)
    layers_priced: int  # layers the cost model charges layer_s for: decoder + MTP blocks (model_work(spec).layers)

    @property
    def layers(self) -> float:
        """The divisor: `layers_priced` scaled from the built model to the whole one. The cost model multiplies layer_s
        by `layers_priced`, the trainer runs `layers_trained` blocks, of which `layers_built` ran here."""
        return self.layers_priced * self.layers_built / self.layers_trained

    @property
    def layer_s(self) -> float:
        return self.wall_s / self.layers

    @property
    def growth_2x(self) -> float:
        """Relative wall-time growth when the tokens double: ~0 when host-bound."""
        return self.wall_2x_s / self.wall_s - 1.0


def sampled_spec(spec: ModelSpec, n: int) -> ModelSpec:
    """A spec of `n` <= num_layers blocks with the layer kinds in (about) the spec's proportions, at least one of
    each, in the spec's order: for a model too large to build whole on one device. Needs the list form (mixer is
    `attention` or `linear_attention`; layer_pattern specs are not buildable anyway)."""
    kinds = spec.layer_kinds()
    if n >= len(kinds):
        return spec
    counts: dict[LayerKind, int] = {}
    for k in kinds:
        counts[k] = counts.get(k, 0) + 1
    want = {k: max(1, round(c * n / len(kinds))) for k, c in counts.items()}
    chosen: list[LayerKind] = []
    for k in kinds:
        if want[k] > 0:
            chosen.append(k)
            want[k] -= 1
    full = [i for i, k in enumerate(chosen, 1) if k.mixer == spec.attention and k.mixer != spec.linear_attention]
    dense = [i for i, k in enumerate(chosen, 1) if k.ffn == "dense" and spec.moe is not None]
    out = spec.model_copy(update={"num_layers": len(chosen), "full_attention_layers": full, "dense_layers": dense})
    assert out.layer_kinds() == chosen
    return out


def _layers_that_fit(spec: ModelSpec, device: torch.device) -> int:
    """Blocks of `spec` whose weights, gradients and autocast copies fit in MEMORY_FRACTION of the free memory."""
    L = spec.num_layers
    if device.type != "cuda":
        return L
    from moestack.model.transformer import build_model

    meta = build_model(spec, "meta")
    outside = sum(p.numel() for name, p in meta.named_parameters() if not name.startswith("layers."))
    per_layer = (sum(p.numel() for p in meta.parameters()) - outside) / L
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    budget = MEMORY_FRACTION * free / BYTES_PER_PARAM - outside
    return max(1, min(L, int(budget // max(per_layer, 1.0))))


def measure_host(spec: ModelSpec, seq_len: int = 256, ep: int = 1, device: torch.device | str = "cuda",
                 warmup: int = 2, reps: int = 7, budget_s: float = 15.0, seed: int = 0,
                 precision: str = "bf16", compile: CompileSpec | None = None) -> HostTiming:
    """Median wall seconds of one micro-batch forward + backward of `spec`'s model at 1 x seq_len tokens (capped at
    max_seq_len), and at 2 x seq_len tokens as the host-bound check. precision "fp8": the model on the FP8 recipe
    (moestack/ops/fp8/convert.py, as `precision: fp8` trains it; a ConfigError where FP8 cannot run), else bf16
    autocast. compile: the trainer's TrainSpec.compile applied to the blocks (parallel/compile.py); the warm-up
    passes compile them. A mode that cannot run here is a ValueError with the reason (no fallback is timed).

    The experts are one EP rank's (tune/parts.py `local_expert_spec`): the model an ep-way run holds.
    Timed runs stop early (after at least min(3, reps)) once `budget_s` of measuring has passed. Raises what
    building or running raises (out of memory, an unsupported spec); `moestack tune` catches it, keeps the default.
    """
    from moestack.model.aux_loss import set_aux_loss_scale
    from moestack.model.transformer import build_model
    from moestack.planner.cost.work import model_work
    from moestack.tune.parts import local_expert_spec

    device = torch.device(device)
    cuda = device.type == "cuda"
    spec = local_expert_spec(spec, ep)
    seq = min(seq_len, spec.max_seq_len)
    run_spec = sampled_spec(spec, _layers_that_fit(spec, device))
    model = build_model(run_spec, device, seed=seed)
    if precision == "fp8":
        from moestack.ops.fp8.convert import apply_fp8_recipe

        apply_fp8_recipe(model, device)
    elif precision != "bf16":
        raise ValueError(f"measure_host: precision {precision!r}; use bf16 or fp8")
    compiled = None
    if compile is not None and compile.mode != "none":
        from moestack.parallel.compile import resolve_compile

        compiled = resolve_compile(compile, device)
        if compiled.report.runs != compile.mode:
            raise ValueError(f"compile {compile.mode} cannot run here: {compiled.report.fallback}")
        compiled.apply(model)
    model.train()
    set_aux_loss_scale(1.0)  # one accumulation step
    g = torch.Generator(device="cpu").manual_seed(seed)

    def inputs_targets(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, spec.vocab_size, (batch, seq + 1), generator=g).to(device)
        return ids[:, :-1], ids[:, 1:]

    start = time.perf_counter()
    mark_step = compiled.before_forward if compiled is not None else None
    wall, tail, n = _median_pass(model, *inputs_targets(1), warmup, reps, start + budget_s * 2 / 3, mark_step)
    wall_2x, _, _ = _median_pass(model, *inputs_targets(2), warmup, max(1, reps // 2), start + budget_s, mark_step)
    model.zero_grad(set_to_none=True)
    del model
    if cuda:
        torch.cuda.empty_cache()
    return HostTiming(wall_s=wall, wall_2x_s=wall_2x, tail_s=tail, tokens=seq, reps=n,
                      layers_built=run_spec.num_layers, layers_trained=spec.num_layers,
                      layers_priced=len(model_work(spec, seq).layers))


def _median_pass(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, n_warm: int, n_reps: int,
                 deadline: float, before_forward=None) -> tuple[float, float, int]:
    """(median wall seconds, median device tail seconds, timed runs) of the trainer's micro-batch on inputs [B, T];
    timed runs stop once perf_counter passes `deadline` (after at least min(3, n_reps)). before_forward: the
    compiled blocks' per-micro-batch hook, inside the timed region as in the trainer."""
    device = inputs.device
    cuda = device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    walls, tails = [], []
    for i in range(n_warm + n_reps):
        model.zero_grad(set_to_none=True)  # the trainer's zero_grad: backward allocates fresh gradients
        sync()
        t0 = time.perf_counter()
        if before_forward is not None:
            before_forward()
        with torch.autocast(device.type, torch.bfloat16, enabled=cuda):  # trainer: precision auto (fp8: the same)
            loss = model(inputs, targets)
        loss.backward()
        t_issued = time.perf_counter()
        loss.detach().float().item()
        sync()
        t1 = time.perf_counter()
        if i >= n_warm:
            walls.append(t1 - t0)
            tails.append(t1 - t_issued)
            if len(walls) >= min(3, n_reps) and t1 > deadline:
                break
    walls.sort()
    tails.sort()
    return walls[len(walls) // 2], tails[len(tails) // 2], len(walls)
