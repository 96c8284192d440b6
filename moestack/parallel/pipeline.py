"""Pipeline parallelism: cost-balanced stages and `torch.distributed.pipelining` schedules chosen by the Plan.

    costs, embed, head = stage_costs(spec, seq_len)              # train FLOPs per token: layers, embedding, head
    layers = split_stages(model, pp, vpp, costs, embed, head)      # pp * vpp contiguous layer ranges
    ids = stage_ids_for_rank(plan.schedule, pp, vpp, pp_rank)      # the stages (chunks) this rank runs
    parts = [build_stage_modules(model, layers[s], s == 0, s == pp * vpp - 1) for s in ids]
    # then per part: apply_tp(part, tp_mesh, sp), expert parallelism, FSDP
    runner = PipelineStepRunner(parts, ids, plan, pp_group, device, seq_shards=tp if sp else 1)
    loss = runner.forward_backward(inputs, targets)               # instead of model(inputs, targets).backward()

Stages are split by cost, not by layer count: a MoE or full-attention layer costs more than a KDA or dense one,
and the first / last stage also carry the embedding / the LM head and loss. Stage modules are `Transformer`s that
keep only their blocks (ModuleDict keys unchanged, so parameter FQNs are those of the whole model and checkpoints
of any layout line up) and set `embed` / `norm` / `lm_head` to None where absent.

Placement of the pp * vpp stages (virtual stages, "chunks") on the pp ranks:
  1f1b, gpipe        vpp = 1, stage r on rank r
  interleaved_1f1b   loop:    rank r holds stages r, r + pp, r + 2 pp, ...
  zbv, dualpipev     V-shape: rank r holds stages r and 2 pp - 1 - r (so rank 0 holds the first and last stage)

Loss and gradient scaling: the runner returns, and backpropagates, the mean token loss over the WHOLE local batch,
exactly as `model(inputs, targets)` on one device: the last stage computes each micro-batch's summed token
cross-entropy (chunked, with the LM-head weight) divided by the number of counted targets in the whole batch, and
the schedule does not rescale (scale_grads=False). Aux losses ride on the activations (moestack.model.aux_loss),
so each stage's backward reaches its own; the runner sets their scale to loss_scale / n_microbatches because
each micro-batch's aux loss is a mean over that micro-batch's sequences.

Not supported under PP: packed documents (cu_seqlens), tied embeddings unless the first and last stage share a
rank (V-shape schedules).

Legend: L layers, S = pp * vpp stages, B batch (sequences), T tokens, D hidden.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)

from moestack.config.model_spec import ModelSpec
from moestack.config.plan import Plan
from moestack.model.aux_loss import set_aux_loss_scale
from moestack.model.loss import IGNORE_INDEX
from moestack.model.transformer import Transformer
from moestack.parallel.tensor import lm_head_loss_sum
from moestack.planner.profile import profile_model

SCHEDULES: dict[str, type] = {
    "1f1b": Schedule1F1B,
    "gpipe": ScheduleGPipe,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}
SINGLE_STAGE = ("1f1b", "gpipe")  # one stage per rank; the others take a list of stages
V_SHAPE = ("zbv", "dualpipev")

# ---------------------------------------------------------------------------------------------------------------
# splitting layers into stages


def stage_costs(spec: ModelSpec, seq_len: int) -> tuple[list[float], float, float]:
    """(per-layer train FLOPs per token [L], embedding cost, LM-head cost) for `split_stages`.

    Layers: 3 x forward FLOPs from moestack.planner.profile (matmuls + attention / KDA terms at seq_len; Megatron's
    train = 3 x forward). LM head: 3 x 2 D V (the head GEMMs; the softmax is small next to them). Embedding: 3 D
    (a row gather and the scatter-add of its gradient: negligible, but it keeps ties away from the first stage).
    """
    profile = profile_model(spec, seq_len)
    d, V = spec.hidden_size, spec.vocab_size
    return [3.0 * lp.fwd_flops_per_token for lp in profile.layers], 3.0 * d, 6.0 * d * V


def split_stages(
    model: Transformer | None,
    pp: int,
    vpp: int,
    layer_costs: list[float],
    embed_cost: float | None = None,
    head_cost: float | None = None,
) -> list[list[int]]:
    """Split the L layers into S = pp * vpp contiguous, non-empty ranges minimising the most expensive stage.

    layer_costs [L]: the cost of each layer (e.g. `stage_costs(spec, seq_len)[0]`); stage 0 also pays `embed_cost`
    and stage S-1 `head_cost` (defaults from model.spec as in `stage_costs`; 0 without a model).
    Returns S lists of 0-based layer indices (ModuleDict keys as ints), in stage order. Exact (dynamic programming
    over split points); among equally good splits it takes the one with the latest split points.
    """
    L, S = len(layer_costs), pp * vpp
    if model is not None:
        assert len(model.layers) == L, f"{L} layer costs for a model with {len(model.layers)} layers"
        d, V = model.spec.hidden_size, model.spec.vocab_size
        embed_cost = 3.0 * d if embed_cost is None else embed_cost
        head_cost = 6.0 * d * V if head_cost is None else head_cost
    embed_cost, head_cost = embed_cost or 0.0, head_cost or 0.0
    if S > L:
        raise ValueError(f"pipeline: {S} stages (pp {pp} x vpp {vpp}) need at least {S} layers, the model has {L}")
    prefix = [0.0]
    for c in layer_costs:
        prefix.append(prefix[-1] + float(c))

    def cost(s: int, i: int, j: int) -> float:  # stage s holding layers i..j-1
        return prefix[j] - prefix[i] + (embed_cost if s == 0 else 0.0) + (head_cost if s == S - 1 else 0.0)

    inf = float("inf")
    # best[s][j]: the smallest possible maximum stage cost putting layers 0..j-1 into stages 0..s
    best = [[inf] * (L + 1) for _ in range(S)]
    cut = [[0] * (L + 1) for _ in range(S)]
    for j in range(1, L + 1):
        best[0][j] = cost(0, 0, j)
    for s in range(1, S):
        for j in range(s + 1, L + 1):
            for i in range(s, j):  # stage s holds layers i..j-1
                value = max(best[s - 1][i], cost(s, i, j))
                if value <= best[s][j]:  # '<=': prefer later split points among ties
                    best[s][j], cut[s][j] = value, i
    bounds, j = [L], L
    for s in range(S - 1, 0, -1):
        j = cut[s][j]
        bounds.append(j)
    bounds.append(0)
    bounds.reverse()
    return [list(range(bounds[s], bounds[s + 1])) for s in range(S)]


def stage_ids_for_rank(schedule: str, pp: int, vpp: int, pp_rank: int) -> list[int]:
    """The stage indices pipeline rank `pp_rank` runs, in ascending order (see the module docstring)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline: unknown schedule {schedule!r}; allowed: {', '.join(SCHEDULES)}")
    if schedule in SINGLE_STAGE:
        assert vpp == 1, f"schedule {schedule} runs one stage per rank (vpp 1), got vpp {vpp}"
        return [pp_rank]
    if schedule in V_SHAPE:
        assert vpp == 2, f"schedule {schedule} runs two stages per rank in a V (vpp 2), got vpp {vpp}"
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + v * pp for v in range(vpp)]


def build_stage_modules(model: Transformer, stage_layer_ids: list[int], is_first: bool, is_last: bool) -> Transformer:
    """A Transformer holding only `stage_layer_ids` (ModuleDict keys, hence FQNs, unchanged), the embedding only if
    is_first, the final norm and LM head only if is_last. It shares its submodules with `model` (nothing is copied:
    works on meta, and several stages of one rank can be cut from one model); drop `model` afterwards.
    Apply tensor parallelism (`apply_tp`) to each stage module, after this: its hooks sit on the stage's root.
    """
    stage = Transformer.__new__(Transformer)  # an empty container: __init__ would allocate a whole model
    nn.Module.__init__(stage)
    stage.spec = model.spec
    stage.embed = model.embed if is_first else None
    stage.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in stage_layer_ids})
    stage.norm = model.norm if is_last else None
    stage.lm_head = model.lm_head if is_last else None
    return stage


# ---------------------------------------------------------------------------------------------------------------
# schedules


class _StageForward(nn.Module):
    """What a PipelineStage runs: token ids (first stage) or hidden [B, T, D] -> hidden [B, T, D] (after the final
    norm on the last stage; the LM head runs in the loss function, chunked)."""

    def __init__(self, part: Transformer):
        super().__init__()
        self.part = part

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.part.hidden_states(x)


def build_schedule(stages: list[PipelineStage], plan: Plan, loss_fn: Callable, n_microbatches: int):
    """The torch.distributed.pipelining schedule for plan.schedule over this rank's `stages` (ordered as
    `stage_ids_for_rank`). Gradients are not rescaled (scale_grads=False): `loss_fn` carries the scaling."""
    cls = SCHEDULES[plan.schedule]
    if plan.schedule in SINGLE_STAGE:
        assert len(stages) == 1
        return cls(stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages, n_microbatches, loss_fn=loss_fn, scale_grads=False)


class PipelineStepRunner:
    """Runs one forward + backward of a local batch through the pipeline; the trainer's replacement for
    `model(inputs, targets).backward()` when plan.pp > 1.

    parts: this rank's stage modules (from `build_stage_modules`, order of `stage_ids`); stage_ids: their stage
    indices; pp_group: the pipeline process group (ranks ordered by pipeline rank); n_microbatches: micro-batches
    per `forward_backward` call (the local batch is split along dim 0; default plan.num_microbatches).
    Stage inputs / outputs have static shapes: [plan.micro_batch_size, plan.seq_len] token ids into stage 0,
    hidden states [micro_batch_size, seq_len / seq_shards, D] of `hidden_dtype` between stages (seq_shards = tp
    with sequence parallelism; the residual stream stays fp32 under bf16 autocast because the parameters are fp32).
    `model_parts` is what the optimizer, gradient clipping and checkpointing see.
    """

    def __init__(
        self,
        parts: list[Transformer],
        stage_ids: list[int],
        plan: Plan,
        pp_group: dist.ProcessGroup | None,
        device: torch.device | str,
        n_microbatches: int | None = None,
        seq_shards: int = 1,
        hidden_dtype: torch.dtype = torch.float32,
    ):
        self.model_parts = parts
        self.stage_ids = stage_ids
        self.plan = plan
        self.group = pp_group
        self.n_microbatches = n_microbatches or plan.num_microbatches
        self.num_stages = plan.pp * plan.vpp
        device = torch.device(device)
        self.device = device
        # Static shapes: without them the stages infer shapes by running an extra real forward on the first step,
        # which would count that micro-batch twice in the routers' load counts (and cost a step's time).
        mb, D = plan.micro_batch_size, parts[0].spec.hidden_size
        T_local = plan.seq_len // seq_shards
        hidden = torch.empty(mb, T_local, D, dtype=hidden_dtype, device="meta", requires_grad=True)
        tokens = torch.empty(mb, plan.seq_len, dtype=torch.long, device="meta")
        self._stages = [
            PipelineStage(_StageForward(part), sid, self.num_stages, device, group=pp_group,
                          input_args=tokens if sid == 0 else hidden, output_args=hidden)
            for part, sid in zip(parts, stage_ids)
        ]
        self._last = next((p for p, s in zip(parts, stage_ids) if s == self.num_stages - 1), None)
        self._first = any(s == 0 for s in stage_ids)
        self._count: torch.Tensor | None = None  # counted targets of the whole local batch (set per call)
        self._scale = 1.0
        self.schedule = build_schedule(self._stages, plan, self._loss_fn, self.n_microbatches)
        # the rank holding the last stage broadcasts the loss (rank 0 for V-shapes, pp-1 otherwise)
        last_pp_rank = 0 if plan.schedule in V_SHAPE else plan.pp - 1
        self._loss_src = dist.get_global_rank(pp_group, last_pp_rank) if pp_group is not None else last_pp_rank

    def _loss_fn(self, h_BTD: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        """This micro-batch's share of the batch mean: summed token losses / counted targets of the whole batch."""
        return lm_head_loss_sum(self._last, h_BTD, targets_BT) * (self._scale / self._count.clamp(min=1))

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor, loss_scale: float = 1.0) -> float:
        """inputs, targets [B, T] (the local batch, B = n_microbatches * plan.micro_batch_size; every pipeline rank
        passes the same tensors, only the first / last stage read them). Backpropagates loss_scale * mean token loss
        into the stage parameters' .grad (accumulating) and returns the unscaled mean loss, the same on every pipeline
        rank. Leaves the aux-loss scale at loss_scale / n_microbatches (callers set it again before other backwards).
        """
        assert loss_scale > 0, f"loss_scale must be > 0, got {loss_scale}"
        mbs = self.plan.micro_batch_size
        assert inputs.shape[0] == self.n_microbatches * mbs, (
            f"batch of {inputs.shape[0]} is not {self.n_microbatches} micro-batches of {mbs} sequences")
        self._count = (targets != IGNORE_INDEX).sum().to(self.device)
        self._scale = loss_scale
        set_aux_loss_scale(loss_scale / self.n_microbatches)  # each micro-batch's aux loss is a mean over it
        losses: list[torch.Tensor] = []
        args = (inputs.to(self.device),) if self._first else ()
        target = targets.to(self.device) if self._last is not None else None
        self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        if self._last is not None:
            total += sum(float(loss.detach()) for loss in losses) / loss_scale
        if self.group is not None:
            dist.broadcast(total, src=self._loss_src, group=self.group)
        return float(total)
