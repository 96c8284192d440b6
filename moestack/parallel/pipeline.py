"""Pipeline parallelism: cost-balanced stages and `torch.distributed.pipelining` schedules chosen by the Plan.

    costs, embed, head = stage_costs(spec, seq_len)              # train FLOPs per token: layers, embedding, head
    layers = split_stages(model, pp, vpp, costs, embed, head)      # pp * vpp contiguous layer ranges
    ids = stage_ids_for_rank(plan.schedule, pp, vpp, pp_rank)      # the stages (chunks) this rank runs
    parts = [build_stage_modules(model, layers[s], s == 0, s == pp * vpp - 1) for s in ids]
    # then per part: apply_tp(part, tp_mesh, sp), expert parallelism, FSDP (moestack.parallel.parallelize)
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
so each stage's backward reaches its own; the runner sets their scale to 1 / n_microbatches because
each micro-batch's aux loss is a mean over that micro-batch's sequences (the scale is a process-wide setting:
the runner restores the caller's value when the step ends).

Tied embeddings (model.tie_word_embeddings), Megatron's way: the last stage's LM head is its own copy of the first
stage's embedding (`build_stage_modules`; per-part TP / FSDP would replace a shared parameter anyway). The runner
makes the copies equal on its first step and after every backward sets both gradients to their sum (README.md,
"Launch"), so both take the same optimizer step; the head copy is marked (`TIED_COPY_ATTR`) so that
`comm.global_grad_norm` counts the tied gradient once.

FSDP under the split-backward schedules (zbv, dualpipev): the stage module is made the FSDP root, so that torch's
schedule runs the backwards without gradient reduction and reduces once per step, and ZeRO-3 does not reshard
after forward during the step (`stage_module`; without both the weight passes fail or silently drop gradients).

Attention Residuals (spec.attn_res_block_size): the state between stages is every completed block representation
plus the partial sum, stacked [n + 1, B, T, D] (moestack.model.transformer); n grows with depth, so later boundaries
send more (n + 1 times a plain hidden state). Every stage sends the whole stack: no cross-stage caching of blocks
an earlier send already delivered (the paper's optimisation for interleaved schedules).

Not supported under PP: packed documents (cu_seqlens).

Legend: L layers, S = pp * vpp stages, B batch (sequences), T tokens, D hidden.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor

from moestack.config.model_spec import ModelSpec
from moestack.config.plan import V_SHAPE, Plan
from moestack.model.aux_loss import aux_loss_scale
from moestack.model.loss import IGNORE_INDEX
from moestack.model.transformer import Transformer
from moestack.parallel.comm import TIED_COPY_ATTR
from moestack.parallel.tensor import _trackers_in, finish_tp_grad_reduce, lm_head_loss_sum
from moestack.planner.profile import profile_model

SCHEDULES: dict[str, type] = {
    "1f1b": Schedule1F1B,
    "gpipe": ScheduleGPipe,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}
SINGLE_STAGE = ("1f1b", "gpipe")  # one stage per rank; the others take a list of stages

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
    A tied model (lm_head.weight is embed.weight) is untied in place by the first call for a partial stage: the
    head gets its own copy of the weight, whose gradient `PipelineStepRunner` sums with the embedding's.
    """
    if not (is_first and is_last):
        _untie_head(model)
    stage = Transformer.__new__(Transformer)  # an empty container: __init__ would allocate a whole model
    nn.Module.__init__(stage)
    stage.spec = model.spec
    stage.embed = model.embed if is_first else None
    stage.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in stage_layer_ids})
    stage.out_res = getattr(model, "out_res", None) if is_last else None  # Attention Residuals' output aggregation
    stage.norm = model.norm if is_last else None
    stage.lm_head = model.lm_head if is_last else None
    return stage


def stage_state_blocks(part: Transformer) -> tuple[int, int]:
    """Completed Attention-Residual blocks in the state a stage takes and passes on (the stacked state holds them
    and the partial sum: [n + 1, B, T, D]); (-1, -1) without Attention Residuals (a plain [B, T, D] hidden)."""
    spec = part.spec
    if spec.attn_res_block_size is None:
        return -1, -1
    ids = [int(k) for k in part.layers]
    return spec.attn_res_blocks_before(min(ids)), spec.attn_res_blocks_before(max(ids) + 1)


def _untie_head(model: Transformer) -> None:
    """Give a tied LM head its own copy of the embedding weight (same values, requires_grad and tags)."""
    if model.embed is None or model.lm_head is None or model.lm_head.weight is not model.embed.weight:
        return
    weight = model.embed.weight
    copy = nn.Parameter(weight.detach().clone(), requires_grad=weight.requires_grad)
    if getattr(weight, "_no_weight_decay", False):
        copy._no_weight_decay = True
    model.lm_head.weight = copy


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


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


def _fsdp_mesh(part: nn.Module):
    """The mesh of some FSDP parameter group under `part`; None when `part` holds no FSDP module."""
    for module in part.modules():
        if isinstance(module, FSDPModule):
            for group in fully_shard.state(module)._fsdp_param_groups:
                return group.mesh_info.mesh
    return None


def stage_module(part: Transformer, split_backward: bool) -> nn.Module:
    """The module a PipelineStage runs for `part` (a stage Transformer, parallelised): `_StageForward(part)`.

    split_backward (zbv, dualpipev: each micro-batch's backward runs as an input pass, then a weight pass) with an
    FSDP-sharded part (the trainer always applies FSDP, on a one-rank data-parallel mesh too): the wrapper is made
    the FSDP root (it holds no parameters), because torch.distributed.pipelining drives FSDP only when the stage's
    module IS an FSDPModule. Why: behind a plain wrapper FSDP reshards the part after the input pass, and the weight
    pass cannot find the input pass's AccumulateGrad nodes among the sharded parameters (KeyError). As the root the
    stage runs every backward without reduction or resharding, reduces once per step (REDUCE_GRAD) and gathers
    through its UNSHARD / RESHARD actions. ZeRO-3's reshard after forward is off too: `stage_backward_input` reads
    `submod.parameters()` before its autograd call regathers them, so a block resharded by its forward would
    silently get no gradient. So under zbv / dualpipev a stage's parameters stay gathered and its gradients
    unsharded (one reduce-scatter per step, not per micro-batch) from its first forward to the end of the step.
    Other schedules keep the plain wrapper: FSDP reduces (and reshards) after every micro-batch's full backward.
    """
    module = _StageForward(part)
    mesh = _fsdp_mesh(part) if split_backward else None
    if mesh is None:
        return module
    if "hidden_states" not in vars(part):  # not registered yet (an instance attribute once it is)
        register_fsdp_forward_method(part, "hidden_states")  # the stage runs hidden_states, not forward
    part.set_reshard_after_forward(False)  # every FSDP module under the part (ZeRO-3: see above)
    fully_shard(module, mesh=mesh, reshard_after_forward=False)
    return module


def build_schedule(stages: list[PipelineStage], plan: Plan, loss_fn: Callable, n_microbatches: int):
    """The torch.distributed.pipelining schedule for plan.schedule over this rank's `stages` (ordered as
    `stage_ids_for_rank`). Gradients are not rescaled (scale_grads=False): `loss_fn` carries the scaling."""
    cls = SCHEDULES[plan.schedule]
    if plan.schedule in SINGLE_STAGE:
        assert len(stages) == 1
        return cls(stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=False)
    schedule = cls(stages, n_microbatches, loss_fn=loss_fn, scale_grads=False)
    if plan.ep_comm_overlap:  # DualPipeV's OVERLAP_F_B actions (moestack/config/support.py allows no other)
        from moestack.parallel.overlap_fb import install

        install(schedule)
    return schedule


class PipelineStepRunner:
    """Runs one forward + backward of a local batch through the pipeline; the trainer's replacement for
    `model(inputs, targets).backward()` when plan.pp > 1.

    parts: this rank's stage modules (from `build_stage_modules`, order of `stage_ids`); stage_ids: their stage
    indices; pp_group: the pipeline process group (ranks ordered by pipeline rank). Each `forward_backward` call
    splits the local batch along dim 0 into plan.num_microbatches micro-batches.
    Stage inputs / outputs have static shapes: [plan.micro_batch_size, plan.seq_len] token ids into stage 0,
    hidden states [micro_batch_size, seq_len / seq_shards, D] of `hidden_dtype` between stages (seq_shards = tp
    with sequence parallelism; the residual stream stays fp32 under bf16 autocast because the parameters are fp32);
    with Attention Residuals the stacked block state [n + 1, micro_batch_size, seq_len / seq_shards, D], n the
    completed blocks at that boundary (`stage_state_blocks`).
    `model_parts` is what the optimizer, gradient clipping and checkpointing see. Construct it after parallelising
    the parts (TP, FSDP): it keeps the final parameters of a tied embedding / head pair (module docstring).
    """

    def __init__(
        self,
        parts: list[Transformer],
        stage_ids: list[int],
        plan: Plan,
        pp_group: dist.ProcessGroup | None,
        device: torch.device | str,
        seq_shards: int = 1,
        hidden_dtype: torch.dtype = torch.float32,
    ):
        self.model_parts = parts
        self.stage_ids = stage_ids
        self.plan = plan
        self.group = pp_group
        self.n_microbatches = plan.num_microbatches
        self.num_stages = plan.pp * plan.vpp
        device = torch.device(device)
        self.device = device
        # Static shapes: without them the stages infer shapes by running an extra real forward on the first step,
        # which would count that micro-batch twice in the routers' load counts (and cost a step's time).
        mb, D = plan.micro_batch_size, parts[0].spec.hidden_size
        T_local = plan.seq_len // seq_shards
        tokens = torch.empty(mb, plan.seq_len, dtype=torch.long, device="meta")
        split_backward = plan.schedule in V_SHAPE  # separate input and weight passes (zero bubble)

        def hidden(n: int) -> torch.Tensor:  # n blocks: [n + 1, mb, T, D] with Attention Residuals, else [mb, T, D]
            shape = (mb, T_local, D) if n < 0 else (n + 1, mb, T_local, D)
            return torch.empty(shape, dtype=hidden_dtype, device="meta", requires_grad=True)

        self._stages = []
        for part, sid in zip(parts, stage_ids):
            n_in, n_out = stage_state_blocks(part)
            self._stages.append(PipelineStage(
                stage_module(part, split_backward), sid, self.num_stages, device, group=pp_group,
                input_args=tokens if sid == 0 else hidden(n_in),
                output_args=hidden(n_out if sid < self.num_stages - 1 else -1)))
        self._last = next((p for p, s in zip(parts, stage_ids) if s == self.num_stages - 1), None)
        self._first = any(s == 0 for s in stage_ids)
        self._count: torch.Tensor | None = None  # counted targets of the whole local batch (set per call)
        self.schedule = build_schedule(self._stages, plan, self._loss_fn, self.n_microbatches)
        # the rank holding the last stage broadcasts the loss (rank 0 for V-shapes, pp-1 otherwise)
        last_pp_rank = 0 if plan.schedule in V_SHAPE else plan.pp - 1
        self._loss_src = self._global_rank(last_pp_rank)
        self._init_tie(last_pp_rank)

    def _global_rank(self, pp_rank: int) -> int:
        return dist.get_global_rank(self.group, pp_rank) if self.group is not None else pp_rank

    def _init_tie(self, last_pp_rank: int) -> None:
        """Find this rank's copies of a tied embedding / head (first stage: embed.weight, last: lm_head.weight)."""
        embed = next((p.embed.weight for p, s in zip(self.model_parts, self.stage_ids) if s == 0), None)
        head = self._last.lm_head.weight if self._last is not None else None
        self._tie: list[nn.Parameter] = []  # this rank's copies: [embed], [head] or [embed, head]
        self._tie_parts = [p for p, s in zip(self.model_parts, self.stage_ids) if s in (0, self.num_stages - 1)]
        self._tie_peer: int | None = None  # global rank of the pipeline rank holding the other copy
        self._tie_synced = False
        if not self.model_parts[0].spec.tie_word_embeddings or embed is head:  # untied, or still one object
            return
        self._tie = [w for w in (embed, head) if w is not None]
        if head is not None:
            setattr(head, TIED_COPY_ATTR, True)  # the norm counts the tied gradient once, through the embedding
        if len(self._tie) == 1:
            self._tie_peer = self._global_rank(last_pp_rank if embed is not None else 0)

    def _exchange(self, mine: torch.Tensor) -> torch.Tensor:
        """The peer copy holder's tensor of the same shape (both pipeline ranks send and receive)."""
        theirs = torch.empty_like(mine)
        ops = [dist.P2POp(dist.isend, mine.contiguous(), self._tie_peer, self.group),
               dist.P2POp(dist.irecv, theirs, self._tie_peer, self.group)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        return theirs

    @torch.no_grad()
    def _sync_tied_weights(self) -> None:
        """Make the head copy equal to the embedding (once: covers meta initialisation, which skips a tied head)."""
        if len(self._tie) == 2:
            _local(self._tie[1]).copy_(_local(self._tie[0]))
        elif self._last is not None:  # the head holder receives the embedding
            head = _local(self._tie[0])
            theirs = torch.empty_like(head)
            dist.recv(theirs, src=self._tie_peer, group=self.group)
            head.copy_(theirs)
        else:
            dist.send(_local(self._tie[0]).contiguous(), dst=self._tie_peer, group=self.group)
        self._tie_synced = True

    @torch.no_grad()
    def loaded_tie_mismatch(self, optimizer: torch.optim.Optimizer | None) -> list[str]:
        """After a checkpoint load: what differs between this rank's tied copy and the other copy (weight, then the
        optimizer's state tensors by name); [] when equal, or untied, or this rank holds no copy. Equal copies are
        marked synced, so the first step does not copy the embedding into the head: that copy would mend an
        unequal weight but not the head's optimizer state, a silent divergence (callers refuse a non-empty list).
        Collective between the copies' holders (pipeline ranks 0 and pp-1 of one data-parallel coordinate)."""
        if not self._tie:
            return []

        def tensors(w: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
            state = optimizer.state.get(w, {}) if optimizer is not None else {}
            return [("weight", _local(w))] + [(k, _local(v).to(self.device)) for k, v in sorted(state.items())
                                              if isinstance(v, torch.Tensor)]

        mine = tensors(self._tie[0])
        if len(self._tie) == 2:
            theirs = tensors(self._tie[1])
        else:  # names first (a different count would misalign the tensor exchanges), then each tensor
            count = self._exchange(torch.tensor([len(mine)], device=self.device))
            if int(count) != len(mine):
                return [f"optimizer state ({len(mine) - 1} vs {int(count) - 1} tensors)"]
            theirs = [(k, self._exchange(t)) for k, t in mine]
        bad = [k for (k, a), (_, b) in zip(mine, theirs, strict=True) if a.shape != b.shape or not torch.equal(a, b)]
        self._tie_synced = not bad
        return bad

    @torch.no_grad()
    def _sum_tied_grads(self, before: list[torch.Tensor | None]) -> None:
        """Both copies' gradients := what they held before this step + the sum of both copies' increments."""
        for part in self._tie_parts:
            finish_tp_grad_reduce(part)  # a deferred TP sum of the head must come first (no-op when eager)
        deltas = []
        for w, b in zip(self._tie, before):
            if w.grad is None:
                w.grad = torch.zeros_like(w)
            g = _local(w.grad)
            deltas.append(g if b is None else g - b)  # `total` below is a new tensor: no clone needed
        # a + b == b + a bitwise: both copies end up with identical gradients, hence identical optimizer steps
        total = deltas[0] + (deltas[1] if len(deltas) == 2 else self._exchange(deltas[0]))
        for w, b in zip(self._tie, before):
            _local(w.grad).copy_(total if b is None else b + total)

    def _loss_fn(self, h_BTD: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        """This micro-batch's share of the batch mean: summed token losses / counted targets of the whole batch."""
        loss_sum = lm_head_loss_sum(self._last, h_BTD, targets_BT)
        # the factor in fp64, then the loss's dtype: float / int64 tensor would be fp32 (2^-24 off under fp64)
        return loss_sum * (1.0 / self._count.clamp(min=1).double()).to(loss_sum.dtype)

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """inputs, targets [B, T] (the local batch, B = n_microbatches * plan.micro_batch_size; every pipeline rank
        passes the same tensors, only the first / last stage read them). Backpropagates the mean token loss into the
        stage parameters' .grad (accumulating) and returns it, the same on every pipeline rank. The aux-loss scale
        is 1 / n_microbatches during the step and the caller's value again after.
        With tied embeddings the call ends with the tied gradient sum, so it also runs the deferred TP sums
        (tp_grad_reduce "deferred") of the parts holding the copies: accumulating over several calls before one
        optimizer step stays exact for eager TP sums, and raises under deferred ones (call once per step there).
        """
        mbs = self.plan.micro_batch_size
        assert inputs.shape[0] == self.n_microbatches * mbs, (
            f"batch of {inputs.shape[0]} is not {self.n_microbatches} micro-batches of {mbs} sequences")
        self._count = (targets != IGNORE_INDEX).sum().to(self.device)
        if self._tie and not self._tie_synced:
            self._sync_tied_weights()
        before = [None if w.grad is None else _local(w.grad).clone() for w in self._tie]  # accumulation
        if any(b is not None for b in before) and any(_trackers_in(p) for p in self._tie_parts):
            # the previous call finished those parts' deferred TP sums; a second finish would sum them again
            raise RuntimeError("PipelineStepRunner: with tied embeddings and plan.tp_grad_reduce 'deferred', call "
                               "forward_backward once per optimizer step (zero_grad(set_to_none=True) in between)")
        losses: list[torch.Tensor] = []
        args = (inputs.to(self.device),) if self._first else ()
        target = targets.to(self.device) if self._last is not None else None
        with aux_loss_scale(1.0 / self.n_microbatches):  # each micro-batch's aux loss is a mean over it
            self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
        if self._tie and self._tie[0].requires_grad:  # frozen (DSA dense warm-up) on both sides alike: no sum
            self._sum_tied_grads(before)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        if self._last is not None:
            total += sum(float(loss.detach()) for loss in losses)
        if self.group is not None:
            dist.broadcast(total, src=self._loss_src, group=self.group)
        return float(total)
