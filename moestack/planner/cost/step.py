"""3. Assemble a Plan: CostModel evaluates a Plan into a PlanCost (memory breakdown per pipeline rank, time breakdown,
step time, tokens/s, TFLOP/s per device, MFU from the profile's model FLOPs) and its binding constraint."""

from __future__ import annotations

from dataclasses import dataclass, field

from moestack.config.cluster import GIB, ClusterSpec
from moestack.config.model_spec import ModelSpec
from moestack.config.plan import V_SHAPE, Plan, RecomputePolicy
from moestack.planner.adapt import LOSS_BYTES_PER_LOGIT, LOSS_CHUNK_TOKENS  # the chunked loss, as adapt.py prices it
from moestack.planner.calibration import Calibration
from moestack.planner.cost.comm import (
    OVERLAP_RESIDUAL,
    _experts_tp_replicated,
    _overlapped,
    p2p_time,
    ring_time,
    tp_grad_sum_bytes,
)
from moestack.planner.cost.compute import GEMM_RECIPES, elementwise_time, fp8_recipe_runs, gemm_time, muon_flops
from moestack.planner.cost.context import Ctx, PartCost
from moestack.planner.cost.memory import (
    ACT_OFFLOAD_LAYERS,
    MOE_MEMORY_HEADROOM,
    bf16_weight_copy,
    grad_bytes,
    optimizer_bytes_per_param,
    optimizer_step_bytes,
    recompute_mode,
)
from moestack.planner.cost.parts import part_cost
from moestack.planner.cost.pipeline import (
    StageLayout,
    balanced_chunks,
    chunk_ranks,
    inflight_microbatches,
    pipeline_time,
    uniform_chunks,
)
from moestack.planner.cost.work import BF16, FP32, Gemm, LayerWork, PartWork, attn_res_elem_bytes, model_work
from moestack.planner.host_profile import framework_of, host_calibration


@dataclass
class PlanCost:
    """Everything the cost model says about one plan (seconds per step, bytes per device)."""

    plan: Plan
    step_time_s: float
    tokens_per_s: float
    tflops_per_device: float
    mfu: float
    model_flops_per_step: float
    memory: dict[str, float]  # component -> bytes on the busiest device
    hbm_bytes: float
    host_bytes: float  # host memory needed per device (offload)
    host_capacity: float
    time: dict[str, float]  # component -> seconds per step (exposed, on the critical rank)
    binding: str
    layout: StageLayout
    rank_fwd_bwd: list[tuple[float, float, float]]  # per rank per micro-batch: (fwd, bwd + recompute, wgrad)
    notes: list[str] = field(default_factory=list)
    forward_activations: float = 0.0  # busiest rank: what forward leaves for backward (the memory report's term)
    memory_by_pp_rank: list[dict[str, float]] = field(default_factory=list)  # `memory` of every pipeline rank

    @property
    def memory_total(self) -> float:
        return sum(self.memory.values())

    @property
    def memory_fraction(self) -> float:
        return self.memory_total / self.hbm_bytes

    def fits(self, margin: float = 0.05) -> bool:
        return self.memory_total <= self.hbm_bytes * (1 - margin) and self.host_bytes <= self.host_capacity

    def prediction(self):
        from moestack.config.plan import PlanPrediction

        return PlanPrediction(
            step_time_s=round(self.step_time_s, 4),
            tokens_per_s=round(self.tokens_per_s, 1),
            tflops_per_device=round(self.tflops_per_device, 1),
            mfu=round(self.mfu, 4),
            memory_gib={k: round(v / GIB, 2) for k, v in self.memory.items()},
            time_s={k: round(v, 4) for k, v in self.time.items()},
            binding=self.binding,
        )


class CostModel:
    """Evaluates plans for one (model, cluster, calibration, sequence length); caches per-layer work.

    `model_flops_per_token` is the training FLOPs per token used for TFLOP/s and MFU (the profile's
    `train_flops_per_token`, Megatron's definition).
    """

    def __init__(self, spec: ModelSpec, cluster: ClusterSpec, cal: Calibration, seq_len: int,
                 model_flops_per_token: float):
        self.spec, self.cluster, self.cal, self.seq_len = spec, cluster, cal, seq_len
        self.work = model_work(spec, seq_len)
        self.model_flops_per_token = model_flops_per_token
        self._kinds = sorted({id(layer.parts): layer for layer in self.work.layers}.values(), key=lambda x: x.index)
        kind_of = {id(layer.parts): k for k, layer in enumerate(self._kinds)}
        self._layer_kind = [kind_of[id(layer.parts)] for layer in self.work.layers]
        self._kind_cache: dict[tuple, list[PartCost]] = {}
        self._chunk_cache: dict[tuple, list[list[int]]] = {}
        self._param_cache: dict[tuple, tuple[float, float]] = {}
        self._sum_cache: dict[tuple, tuple[float, float, float]] = {}

    # -- per-layer costs ---------------------------------------------------------------------------------------
    def kind_costs(self, plan: Plan) -> tuple[list[PartCost], list[LayerWork], list[int]]:
        """Cost of each distinct layer kind for one micro-batch, a representative layer of each, and the kind index
        of every layer (layers of one kind share their PartWork list)."""
        r = plan.recompute
        key = (plan.tp, plan.cp, plan.ep, plan.etp, plan.micro_batch_size, plan.seq_len, plan.precision,
               r.kda, r.attention, r.moe, r.mlp, plan.dispatcher, plan.tp_comm_overlap,
               plan.cp_kda if plan.cp > 1 else None,
               plan.tp_grad_reduce, plan.sequence_parallel, plan.moe_load_imbalance, plan.host_profile,
               plan.fp8_activation_input, plan.ep_dispatch_dtype, plan.ep_replicas,
               plan.num_microbatches if plan.precision not in ("bf16", "fp8") else 0)  # recipe_cast_bytes amortises
        costs = self._kind_cache.get(key)
        if costs is None:
            ctx = Ctx(plan, self.spec, self.cluster, self.cal, plan.micro_batch_size * plan.seq_len / plan.cp)
            costs = []
            for layer in self._kinds:
                total = PartCost()
                for part in layer.parts:
                    total.add(part_cost(part, ctx))
                costs.append(total)
            self._kind_cache[key] = costs
        return costs, self._kinds, self._layer_kind

    def chunks(self, plan: Plan, kind_cost: list[PartCost], first_extra: float, last_extra: float) -> list[list[int]]:
        """balanced_chunks, cached on the kinds' relative costs (3 significant digits); or the layer-count split of
        plan.pipeline_split (uniform_chunks)."""
        if plan.pipeline_split != "balanced":
            return uniform_chunks(len(self.work.layers), plan.pp * plan.vpp, plan.pipeline_split == "uniform_account")
        scale = max(c.total + c.a2a for c in kind_cost)
        rel = tuple(round((c.total + c.a2a) / scale, 3) for c in kind_cost)
        key = (rel, round(first_extra / scale, 3), round(last_extra / scale, 3), plan.pp * plan.vpp)
        out = self._chunk_cache.get(key)
        if out is None:
            costs = [rel[k] for k in self._layer_kind]
            out = balanced_chunks(costs, plan.pp * plan.vpp, key[1], key[2])
            self._chunk_cache[key] = out
        return out

    def head_cost(self, plan: Plan) -> PartCost:
        """LM head(s) + loss on the last stage (and MTP projections): GEMM T x V/tp x h, fp32 softmax traffic
        ~16 B per logit fwd+bwd, under TP the all-reduce of the replicated head's gradient."""
        T = plan.micro_batch_size * plan.seq_len / plan.cp
        tp, cluster, cal = plan.tp, self.cluster, self.cal
        out = PartCost()
        g = gemm_time(self.work.head, T, T, tp, 1, "bf16", cluster, cal) * self.work.num_heads_out
        mtp = 0.0
        if self.spec.mtp_layers:
            h = self.spec.hidden_size
            mtp = gemm_time(Gemm("mtp.proj", n=h, k=2 * h), T, T, tp, 1, plan.precision, cluster, cal)
            mtp *= self.spec.mtp_layers
        logits = T * self.spec.vocab_size / tp * self.work.num_heads_out
        # Attention Residuals: the output mix over every block before the final norm (token-local, SP-sharded)
        out_mix = 0.0
        if self.spec.attn_res_block_size is not None:
            n = self.spec.attn_res_blocks_before(self.spec.num_layers) + 1
            out_mix = attn_res_elem_bytes(self.spec.hidden_size, n) * T / tp
        loss_f = elementwise_time(logits * 6 + out_mix, cluster, cal)
        loss_b = elementwise_time(logits * 10 + 2 * out_mix, cluster, cal)
        # moestack's TP keeps the head replicated and computes the loss on the rank's sequence shard (no gather of
        # the input); the [V, h] weight gradient is all-reduced over TP in every backward (tensor.py)
        coll = 0.0
        if tp > 1 and plan.tp_grad_reduce != "deferred":  # deferred: once per step (evaluate, "tp_grad_sum")
            grad_b = FP32 if plan.precision == "fp32" else BF16
            coll = ring_time(cluster, self.work.head.params * grad_b, tp, 1, "ar", cal.comm)
        out.fwd = g + mtp + loss_f
        out.bwd = 2 * (g + mtp) + loss_b + coll
        out.wgrad = g + mtp
        out.parts = {"gemm": 3 * (g + mtp), "elementwise": loss_f + loss_b, "tp_comm": coll}
        return out

    def embed_cost(self, plan: Plan) -> PartCost:
        """Embedding gather (fwd) and scatter-add (bwd) on the first stage; vocab-parallel reduce under TP."""
        T = plan.micro_batch_size * plan.seq_len / plan.cp
        h = self.spec.hidden_size
        out = PartCost()
        mem = elementwise_time(T * h * BF16 * 2 / plan.tp, self.cluster, self.cal)
        coll = ring_time(self.cluster, T * h * BF16, plan.tp, 1, "rs", self.cal.comm) if plan.tp > 1 else 0.0
        out.fwd, out.bwd = mem + coll, 2 * mem + coll
        out.parts = {"elementwise": 3 * mem, "tp_comm": 2 * coll}
        return out

    # -- quick lower bound (search pruning) ---------------------------------------------------------------------
    def memory_lower_bound(self, plan: Plan) -> tuple[float, float]:
        """(HBM, host) bytes the busiest rank needs at least: the rank average of weights, gradients, optimizer
        states and saved activations (a rank never holds less than the mean). Cheap: no pipeline partition."""
        kind_cost, kinds, i_kind = self.kind_costs(plan)
        key = (id(kind_cost), plan.tp, plan.ep, plan.etp)
        sums = self._sum_cache.get(key)
        if sums is None:
            dense = expert = act = 0.0
            counts: dict[int, int] = {}
            for k in i_kind:
                counts[k] = counts.get(k, 0) + 1
            for k, n in counts.items():
                for part in kinds[k].parts:
                    d, e = self._part_params_local(part, plan)
                    dense, expert = dense + d * n, expert + e * n
                act += kind_cost[k].act * n
            dense += self.work.embed_params / plan.tp * (1 if self.spec.tie_word_embeddings else 2)
            sums = self._sum_cache[key] = (dense, expert, act)
        dense, expert, act = sums
        p = plan.pp
        dense, expert, act = dense / p, expert / p, act / p
        sd, se = self._shards(plan)
        opt_b = optimizer_bytes_per_param(plan.optimizer)
        e_dev = 0.0 if plan.offload.experts else expert
        held = self._gathered_for_step(plan)  # zbv / dualpipev: gathered params, whole gradients (as _memory)
        w_d, w_e = (sd, se) if plan.zero_stage >= 1 else (1, 1)  # FSDP2 shards the fp32 parameters at every stage
        g_d, g_e = (sd, se) if plan.zero_stage >= 2 and not held else (1, 1)
        host = 0.0
        if plan.offload.optimizer:
            w_b = FP32 if plan.devices == 1 else BF16  # as _memory
            w_d, w_e = (sd, se) if plan.zero_stage == 3 else (1, 1)
            hbm = dense * w_b / w_d + e_dev * w_b / w_e
            host += (dense / sd + e_dev / se) * (FP32 + opt_b)
        else:
            hbm = dense * FP32 / w_d + e_dev * FP32 / w_e + dense * opt_b / sd + e_dev * opt_b / se
        if held and plan.zero_stage == 3:
            hbm += (dense + e_dev) * BF16  # the gathered bf16 copy
        grad_b = grad_bytes(plan)
        grads = dense * grad_b / g_d + e_dev * grad_b / g_e
        if plan.offload.experts:
            host += expert / se * (FP32 + FP32 + opt_b)
        inflight = inflight_microbatches(plan.schedule, p, plan.vpp, plan.num_microbatches)
        if plan.offload.activations:
            host += act * inflight
            act_dev = 0.0
        else:
            act_dev = act * min(inflight, (inflight + 1) / 2)  # ranks hold between 1 and `inflight` micro-batches
        # gradients that build up while activations are freed (_grads_build_up): the larger of the two at least;
        # the embedding's is produced after the first layer's backward, the end's peak (_one_end_of_backward)
        if self._grads_build_up(plan):
            hbm += max(grads - self._late_embedding_grad(plan), act_dev)
        else:
            hbm += grads + act_dev
        return hbm + self.cal.runtime_reserved_gib * GIB, host

    # -- parameters per rank ----------------------------------------------------------------------------------
    def _part_params_local(self, part: PartWork, plan: Plan) -> tuple[float, float]:
        key = (id(part), plan.tp, plan.ep, plan.etp)
        hit = self._param_cache.get(key)
        if hit is not None:
            return hit
        dense = float(part.other_params)
        for g in part.gemms:
            if g.expert:
                continue
            dense += g.params if g.split == "rep" else g.params / plan.tp
        expert = part.expert_params / (plan.ep * plan.etp)
        self._param_cache[key] = (dense, expert)
        return dense, expert

    def evaluate(self, plan: Plan) -> PlanCost:
        """Memory per device, time per step and their breakdowns for `plan` (see module docstring)."""
        spec, cluster = self.spec, self.cluster
        p, v, m = plan.pp, plan.vpp, plan.num_microbatches
        L = len(self.work.layers)
        if p * v > L:
            raise ValueError(f"pp*vpp ({p * v}) exceeds the {L} layers")
        kind_cost, kind_layer, i_kind = self.kind_costs(plan)
        head, embed = self.head_cost(plan), self.embed_cost(plan)
        chunks = self.chunks(plan, kind_cost, embed.total, head.total + head.a2a)
        ranks = chunk_ranks(p, v, plan.schedule)
        layout = StageLayout(chunks, ranks)

        # per rank per micro-batch: count layers of each kind per rank, then scale the kind's cost
        kind_params: dict[int, tuple[float, float]] = {}
        rank_counts: list[dict[int, int]] = [{} for _ in range(p)]
        rank_act_layer_max = [0.0] * p
        for c, layer_ids in enumerate(chunks):
            counts = rank_counts[ranks[c]]
            for i in layer_ids:
                counts[i_kind[i]] = counts.get(i_kind[i], 0) + 1
        rank_cost = [PartCost() for _ in range(p)]
        rank_dense = [0.0] * p
        rank_expert = [0.0] * p
        for r in range(p):
            for k_id, count in rank_counts[r].items():
                kc = kind_cost[k_id]
                rank_cost[r].add(kc, count, breakdown=False)
                rank_act_layer_max[r] = max(rank_act_layer_max[r], kc.act - kc.act_kept)
                if k_id not in kind_params:
                    dd = ee = 0.0
                    for part in kind_layer[k_id].parts:
                        d_, e_ = self._part_params_local(part, plan)
                        dd, ee = dd + d_, ee + e_
                    kind_params[k_id] = (dd, ee)
                rank_dense[r] += kind_params[k_id][0] * count
                rank_expert[r] += kind_params[k_id][1] * count
        rank_cost[ranks[0]].add(embed, breakdown=False)
        rank_cost[ranks[-1]].add(head, breakdown=False)
        rank_dense[ranks[0]] += self.work.embed_params / plan.tp
        mtp_params = self.work.mtp_proj_params * spec.mtp_layers / plan.tp
        if not spec.tie_word_embeddings:
            rank_dense[ranks[-1]] += self.work.head.params / plan.tp + mtp_params
        elif p > 1:  # tied: the last stage keeps its own copy of the embedding as the head
            rank_dense[ranks[-1]] += self.work.embed_params / plan.tp + mtp_params

        # EP all-to-all: exposed unless the plan overlaps it with another micro-batch's compute (plan.ep_comm_overlap:
        # moestack runs it under DualPipeV only, moestack/config/support.py; published Megatron runs also under
        # interleaved 1F1B). No credit from the schedule alone: DualPipeV without the field runs sequentially.
        overlap_ep = plan.ep_comm_overlap
        fwd, bwd, wgr, a2a_exposed = [], [], [], []
        for rc in rank_cost:
            compute = rc.fwd + rc.bwd + rc.recompute
            exp = _overlapped(rc.a2a, compute, overlap_ep)
            a2a_exposed.append(exp)
            share_f = exp * 0.33  # forward: dispatch + combine of 1 of the 3 passes (fwd, bwd x2 volume)
            fwd.append(rc.fwd + share_f)
            bwd.append(rc.bwd + rc.recompute + exp - share_f)
            wgr.append(rc.wgrad)
        # the host launches every kernel: a rank's pass over a micro-batch takes at least its host time
        host_f, host_b = self.host_times(plan, rank_counts, kind_layer)
        sync_f, sync_b = self.sync_times(plan, rank_counts, kind_layer)
        host_bound = [0.0] * p
        for r in range(p):
            f_dev, b_dev = fwd[r], bwd[r]
            fwd[r], bwd[r] = max(f_dev, host_f[r]) + sync_f[r], max(b_dev, host_b[r]) + sync_b[r]
            host_bound[r] = fwd[r] + bwd[r] - f_dev - b_dev
        slow = max(range(p), key=lambda r: fwd[r] + bwd[r])
        t_pipe = pipeline_time(plan.schedule, p, v, m, fwd[slow], bwd[slow], wgr[slow])
        p2p = 0.0
        act_msg = plan.micro_batch_size * plan.seq_len / plan.cp * spec.hidden_size * BF16 / plan.tp
        if p > 1 and spec.attn_res_block_size is None:
            p2p = 2 * (p * v - 1) * p2p_time(cluster, act_msg, plan.devices // p)
        elif p > 1:  # Attention Residuals: a boundary sends its n completed blocks and the partial sum
            p2p = 2 * sum(p2p_time(cluster, act_msg * (self._boundary_blocks(chunks[c][0]) + 1), plan.devices // p)
                          for c in range(1, p * v))
            self._add_boundary_state(rank_cost, chunks, ranks, act_msg)

        # data parallel, optimizer, offload
        dp_time, dp_exposed = self._dp_times(plan, rank_dense[slow], rank_expert[slow], fwd[slow], bwd[slow], m,
                                             max(1, sum(len(chunks[c]) for c in range(len(chunks))
                                                        if ranks[c] == slow)))
        opt_time, off_time, host_bytes = self._optimizer_offload(plan, rank_dense, rank_expert, rank_cost,
                                                                 fwd, bwd, m)
        tp_sum = self._deferred_tp_sum_time(plan, rank_counts[slow], kind_layer, slow == ranks[-1])
        step = t_pipe + p2p + dp_exposed + tp_sum + opt_time + off_time

        # breakdown (critical rank, per step)
        rc = PartCost()
        for k_id, count in rank_counts[slow].items():
            rc.add(kind_cost[k_id], count)
        if slow == ranks[0]:
            rc.add(embed)
        if slow == ranks[-1]:
            rc.add(head)
        time = {k: v_ * m for k, v_ in rc.parts.items()}
        time["ep_comm"] = a2a_exposed[slow] * m
        time["host"] = host_bound[slow] * m  # host time beyond the device's (the floor's share of the step)
        time["pp_bubble"] = max(0.0, t_pipe - m * (fwd[slow] + bwd[slow]))
        time["pp_p2p"] = p2p
        time["dp_comm"] = dp_exposed
        time["tp_grad_sum"] = tp_sum
        time["optimizer"] = opt_time
        time["offload"] = off_time
        time = {k: val for k, val in time.items() if val > 0}

        memory, forward_act, by_rank = self._memory(plan, rank_dense, rank_expert, rank_cost, rank_act_layer_max)
        tokens = plan.tokens_per_step
        flops = self.model_flops_per_token * tokens
        tflops = flops / step / plan.devices / 1e12
        mfu = tflops * 1e12 / cluster.device.peak_flops("bf16")
        cost = PlanCost(plan, step, tokens / step, tflops, mfu, flops, memory, cluster.device.hbm_bytes,
                        host_bytes, cluster.device.host_memory_bytes, time, "", layout,
                        list(zip(fwd, bwd, wgr)))
        cost.binding = binding_constraint(cost)
        cost.forward_activations = forward_act
        cost.memory_by_pp_rank = by_rank
        if self._gathered_for_step(plan) and plan.zero_stage >= 2:  # the memory report states why
            held = "parameters gathered, gradients unsharded" if plan.zero_stage == 3 else "gradients unsharded"
            cost.notes.append(f"{plan.schedule}: {held} for the whole step (stage is the FSDP root)")
        return cost

    def _boundary_blocks(self, position: int) -> int:
        """Completed Attention-Residual blocks entering the layer at `position` (0-based into work.layers)."""
        return self.spec.attn_res_blocks_before(min(position, self.spec.num_layers))

    def _add_boundary_state(self, rank_cost: list[PartCost], chunks: list[list[int]], ranks: list[int],
                            act_msg: float) -> None:
        """Attention Residuals under PP: per micro-batch in flight a chunk keeps the completed blocks it received
        (views of the received [n + 1, B, T, D] state that its mixes read: not counted by any of its layers) and the
        stacked state it sent (held by the pipeline stage until backward). Never offloaded (act_kept too)."""
        S = len(chunks)
        for c in range(S):
            held = (self._boundary_blocks(chunks[c][0]) if c > 0 else 0) + \
                (self._boundary_blocks(chunks[c + 1][0]) + 1 if c < S - 1 else 0)
            rank_cost[ranks[c]].act += held * act_msg
            rank_cost[ranks[c]].act_kept += held * act_msg

    def host_times(self, plan: Plan, rank_counts: list[dict[int, int]], kind_layer: list[LayerWork]
                   ) -> tuple[list[float], list[float]]:
        """Host seconds per rank of one micro-batch's forward and backward (Calibration.host: per layer per
        micro-batch, + per MoE layer under EP, + per layer under TP and under the FP8 recipe), split 1 : 2 between
        them as the kernels they launch (backward: data and weight gradients). The head and loss are inside layer_s
        (the fitted default also holds the per-step optimizer and clipping host time; a `moestack tune
        --measure-host` value does not).
        Recompute launches forward work again inside backward: a part under full recompute adds its share of the
        layer's forward host time, under selective half of it (an assumption: not measured)."""
        hc = host_calibration(plan.host_profile, self.cal)
        fp8 = fp8_recipe_runs(plan.precision, self.cluster)
        redo = {"none": 0.0, "selective": 0.5, "full": 1.0}
        fwd, bwd = [], []
        for counts in rank_counts:
            h_f = h_b = 0.0
            for k_id, count in counts.items():
                per = hc.layer_s + (hc.tp_layer_s if plan.tp > 1 else 0.0) + (hc.fp8_layer_s if fp8 else 0.0)
                if kind_layer[k_id].kind.ffn == "moe" and plan.ep * plan.etp > 1:
                    per += hc.ep_moe_s
                parts = kind_layer[k_id].parts
                again = sum(redo[recompute_mode(plan, part)] for part in parts) / max(1, len(parts))
                h_f += per / 3 * count
                h_b += per * (2 + again) / 3 * count
            fwd.append(h_f)
            bwd.append(h_b)
        return fwd, bwd

    def sync_times(self, plan: Plan, rank_counts: list[dict[int, int]], kind_layer: list[LayerWork]
                   ) -> tuple[list[float], list[float]]:
        """Device idle per rank and micro-batch pass from host syncs (HostCalibration.moe_sync_s): a dropless MoE layer
        with expert parallelism copies its token counts to the host before the all-to-all (split sizes) and the grouped
        GEMM (per-expert rows), so the device's queue drains and it waits for the host to launch the rest of the layer;
        once per forward, again in a full recompute of the MoE part. Not hidden by max(device, host): it is on both.
        A capacity factor (static buffers) needs no sync."""
        hc = host_calibration(plan.host_profile, self.cal)
        if hc.moe_sync_s <= 0 or plan.ep * plan.etp <= 1 or (self.spec.moe and self.spec.moe.capacity_factor):
            return [0.0] * plan.pp, [0.0] * plan.pp
        fwd, bwd = [], []
        for counts in rank_counts:
            n_moe = sum(c for k_id, c in counts.items() if kind_layer[k_id].kind.ffn == "moe")
            again = plan.recompute.moe == "full"
            fwd.append(n_moe * hc.moe_sync_s)
            bwd.append(n_moe * hc.moe_sync_s if again else 0.0)
        return fwd, bwd

    @staticmethod
    def _grads_build_up(plan: Plan) -> bool:
        """True when gradients do not outlive the step: one device (no FSDP / DDP buffers), one micro-batch (no
        accumulation), and the trainer's zero_grad(set_to_none=True). Backward then allocates them layer by layer
        while it frees that layer's activations. The CPU-offloaded optimizer copies the device gradients out after
        backward and the same zero_grad frees them, so it builds up the same way. FSDP2 (moestack/parallel/fsdp.py,
        every multi-device plan) also produces and reduce-scatters gradients layer by layer in backward and the
        trainer frees them after the step (measured on 2 x H200: the peak is the loss phase, before any layer
        gradient exists), so the same holds without a pipeline."""
        return plan.num_microbatches == 1 and plan.pp == 1

    @staticmethod
    def _gathered_for_step(plan: Plan) -> bool:
        """True under zbv / dualpipev with ZeRO sharding: the trainer makes each pipeline stage the FSDP root
        (moestack.parallel.pipeline.stage_module), so torch's schedule keeps the stage's parameters gathered (ZeRO-3's
        reshard-after-forward off) and its gradients unsharded from its first forward to the end of the step, and
        reduce-scatters them once per step: ZeRO-3 holds parameters as ZeRO-2 does, ZeRO-2 gradients as ZeRO-1."""
        return plan.schedule in V_SHAPE and plan.zero_stage > 0

    def _late_embedding_grad(self, plan: Plan) -> float:
        """Bytes of the embedding's fp32 gradient, produced after the first layer's backward (so not alive at the
        end-of-backward peak); 0 when tied to the head, whose gradient is alive since the loss."""
        return 0.0 if self.spec.tie_word_embeddings else self.work.embed_params / plan.tp * FP32

    def _one_end_of_backward(self, plan: Plan, mem: dict[str, float], expert_ws: float = 0.0,
                             first_stage: bool = True) -> None:
        """Peak of a backward whose gradients build up as activations are freed: at its start (all activations, the
        LM head's gradient, then either the loss buffers or the largest layer working set) or at its end (the
        gradients but the embedding's, plus the first layer's working set: its backward runs last). The loss backward
        runs and frees its chunk buffers before the first layer's backward starts, so the two are never alive
        together (measured on the H200 at seq 16384: the loss phase's peak was the loss chunk, not chunk + layer).
        Layers between the first and the last hold part of the gradients; they are priced by the start (largest
        working set, the head's gradient only) and the end (all gradients), not layer by layer.

        A layer's backward working set ws_k (kind k) is what its backward holds on top of the rest at its peak: the
        recomputed activations plus the gradients of them in flight, priced as the kind's no-recompute activations
        times Calibration.bwd_ws_factors["<mixer>/<ffn>"] (absent = 1; measured by benchmarks/memory.py
        --phase-peaks, see planner/README.md "Measured").

        `expert_ws`: expert offload's working set (one layer's fetched bf16 weights + the prefetch of the next GEMM
        + the fp32 gradient staged for the host, moestack/memory/offload.py ExpertOffload / _ExpertGEMM). It is a
        transient of a MoE layer's backward, added to the MoE kinds' ws_k only: nothing is fetched before the first
        layer's backward, so at the loss phase it is not alive, nor at the end of backward when the first layer is
        dense (the proxy's).

        The embedding's fp32 gradient (V x h / tp x 4 bytes, on the first stage, untied) is produced after the first
        layer's backward (measured: the end of the 'layer 0 backward' phase rose by it), so it is not
        alive at that layer's peak and the end leaves it out.

        The head term stands for what the loss backward holds of the LM head, V x h / tp x 4 bytes: the chunks share
        one autocast cast of the fp32 weight (one ToCopyBackward node), so their bf16 weight gradients accumulate in
        that node's input buffer (2 bytes) while each chunk's recompute holds its own bf16 cast of the weight for
        the GEMM backward (2 bytes); the fp32 gradient appears once all chunks are done (chunk buffers freed).
        `hidden_loss`: the final norm's saved fp32 input and normalised output, its fp32 output kept by the loss
        chunks' checkpoints and the accumulating fp32 gradient of that output: 4 x T x h x 4 bytes on the loss
        stage (the residual stream is fp32: fp32 embedding + residual adds under autocast)."""
        kind_cost, kinds, layer_kind = self.kind_costs(plan.model_copy(update={"recompute": RecomputePolicy()}))
        factors = self.cal.bwd_ws_factors
        ws = [c.act * factors.get(f"{k.kind.mixer}/{k.kind.ffn}", 1.0) + (expert_ws if k.kind.ffn == "moe" else 0.0)
              for c, k in zip(kind_cost, kinds)]
        head = (self.work.head.params * self.work.num_heads_out / plan.tp) * FP32
        T = plan.micro_batch_size * plan.seq_len / plan.cp
        hidden_loss = 4 * T * self.spec.hidden_size * FP32 / plan.tp if mem["buffers"] > 0 else 0.0
        layer = max(mem["buffers"] + hidden_loss, max(ws))
        start = mem["activations"] + min(head, mem["gradients"]) + layer
        embedding = self._late_embedding_grad(plan) if first_stage else 0.0
        first = ws[layer_kind[0]]  # the backward that runs last: the first layer's
        end = max(0.0, mem["gradients"] - embedding) + first
        if start >= end:
            mem["gradients"] = min(head, mem["gradients"])
            mem["buffers"] = layer
        else:
            mem["activations"] = 0.0
            mem["gradients"] = max(0.0, mem["gradients"] - embedding)
            mem["buffers"] = first

    def _deferred_tp_sum_time(self, plan: Plan, counts: dict[int, int], kind_layer: list[LayerWork],
                              has_head: bool) -> float:
        """plan.tp_grad_reduce = deferred (moestack/parallel/tensor.py `finish_tp_grad_reduce`): the partial TP
        gradients of one rank summed once per step, after the last backward, exposed; on FSDP's fp32 gradients,
        sharded over the dense dp_shard (the reduce-scatter ran first); bucketed, so one ring all-reduce's time."""
        if plan.tp <= 1 or plan.tp_grad_reduce != "deferred":
            return 0.0
        nbytes = sum(tp_grad_sum_bytes(part, plan) * count for k_id, count in counts.items()
                     for part in kind_layer[k_id].parts)  # fmt: skip
        grad_b = FP32 if plan.precision == "fp32" else BF16
        if has_head:
            nbytes += self.work.head.params * grad_b
        nbytes *= FP32 / grad_b / self._shards(plan)[0]
        return ring_time(self.cluster, nbytes, plan.tp, 1, "ar", self.cal.comm) if nbytes else 0.0

    def _dp_times(self, plan: Plan, dense: float, expert: float, fwd: float, bwd: float, m: int,
                  layers: int) -> tuple[float, float]:
        """Gradient reduction and parameter gathers over the data-parallel groups (dense: dp, stride tp*cp;
        experts: edp, stride ep*etp). ZeRO-0: all-reduce; 1: reduce-scatter + all-gather of updated fp32 params,
        once per step, overlapped with the last backward / first forward except the last bucket; 2: the
        reduce-scatter per micro-batch; 3 (FSDP2): bf16 all-gather before fwd and bwd and fp32 reduce-scatter,
        every micro-batch, prefetched one layer ahead. zbv / dualpipev (`_gathered_for_step`): gathered once and
        reduce-scattered once per step, so ZeRO-2 is priced as ZeRO-1 and ZeRO-3 as one bf16 all-gather + one
        reduce-scatter per step."""
        cl, cm = self.cluster, self.cal.comm
        # dense gradients are summed over the context-parallel ranks too (their sequence shares add up): one group of
        # dp * cp ranks, stride tp (moestack/parallel/mesh.py dp_shard_cp; Megatron's data-parallel-with-CP group)
        dpc, dp_stride, edp_stride = plan.dp * plan.cp, plan.tp, plan.ep * plan.etp
        edp = plan.edp
        if _experts_tp_replicated(plan):  # summed over TP per micro-batch (part_cost); FSDP then reduces over dp
            edp, edp_stride = dpc, dp_stride
        z = plan.zero_stage
        held = self._gathered_for_step(plan)
        if held and z == 2:
            z = 1  # one reduce-scatter per step (moestack.parallel.pipeline.stage_module)
        g_dense, g_exp = dense * grad_bytes(plan), expert * grad_bytes(plan)
        if z == 0:
            rs = ring_time(cl, g_dense, dpc, dp_stride, "ar", cm) + ring_time(cl, g_exp, edp, edp_stride, "ar", cm)
            return rs, max(rs - 0.9 * bwd, rs / layers)
        rs = ring_time(cl, g_dense, dpc, dp_stride, "rs", cm) + ring_time(cl, g_exp, edp, edp_stride, "rs", cm)
        if z == 1:
            ag = ring_time(cl, g_dense, dpc, dp_stride, "ag", cm) + ring_time(cl, g_exp, edp, edp_stride, "ag", cm)
            exposed = max(rs - 0.9 * bwd, rs / layers) + max(ag - 0.9 * fwd, ag / layers)
            return rs + ag, exposed
        if z == 2:
            ag = ring_time(cl, g_dense, dpc, dp_stride, "ag", cm) + ring_time(cl, g_exp, edp, edp_stride, "ag", cm)
            per_mb = max(0.0, rs - 0.9 * bwd) + OVERLAP_RESIDUAL * min(rs, bwd)
            return m * rs + ag, m * per_mb + max(ag - 0.9 * fwd, ag / layers)
        w_dense, w_exp = dense * BF16, expert * BF16
        ag = ring_time(cl, w_dense, dpc, dp_stride, "ag", cm) + ring_time(cl, w_exp, edp, edp_stride, "ag", cm)
        if held:  # no reshard after forward, no reduce per micro-batch (pipeline.stage_module)
            return rs + ag, max(rs - 0.9 * bwd, rs / layers) + max(ag - 0.9 * fwd, ag / layers)
        per_mb = _overlapped(ag, fwd, True) + _overlapped(ag + rs, bwd, True)
        return m * (2 * ag + rs), m * per_mb

    def _shards(self, plan: Plan) -> tuple[int, int]:
        """(dense, expert) ZeRO shard counts: dense over dp_shard x cp (FSDP2's dp_shard_cp mesh under context
        parallelism; Megatron's distributed optimizer likewise shards over data parallel with CP), experts over their
        DP group less replicas."""
        if plan.zero_stage == 0:
            return 1, 1
        if _experts_tp_replicated(plan):  # experts shard with their block over the dense dp mesh
            return plan.dp_shard * plan.cp, plan.dp_shard * plan.cp
        return plan.dp_shard * plan.cp, max(1, plan.edp // plan.dp_replicate)

    def _optimizer_offload(self, plan: Plan, dense: list[float], expert: list[float], rank_cost: list[PartCost],
                           fwd: list[float], bwd: list[float], m: int) -> tuple[float, float, float]:
        """Optimizer step (HBM-bound; Muon adds Newton-Schulz GEMMs), offload transfers over the host link and the
        host memory they need, for the busiest rank."""
        cl, cal = self.cluster, self.cal
        sd, se = self._shards(plan)
        link = max(cl.device.host_link_gb_s, 1e-9) * 1e9
        opt_t = off_t = host = 0.0
        muon_t = self._muon_time(plan) if plan.optimizer == "muon" else 0.0  # the same on every stage
        for r in range(plan.pp):
            local_d, local_e = dense[r] / sd, expert[r] / se
            on_dev = local_d + (0.0 if plan.offload.experts else local_e)
            t_opt = elementwise_time(on_dev * optimizer_step_bytes(plan.optimizer), cl, cal) + muon_t
            t_off = 0.0
            h = 0.0
            if plan.offload.optimizer:
                # grads down (fp32), bf16 params up, CPU update; master + states live in host memory
                t_opt = on_dev / cal.cpu_adam_params_per_s
                t_off += on_dev * (FP32 + BF16) / link
                h += on_dev * (FP32 + optimizer_bytes_per_param(plan.optimizer))
            if plan.offload.experts:
                ex = expert[r]
                # per micro-batch: weights up for fwd and bwd (bf16), grads down (fp32); prefetched under compute
                per_mb = ex * (2 * BF16 + FP32) / link
                t_off += m * max(0.0, per_mb - 0.9 * (fwd[r] + bwd[r]))
                t_opt = max(t_opt, local_e / cal.cpu_adam_params_per_s)
                h += local_e * (FP32 + FP32 + optimizer_bytes_per_param(plan.optimizer))
            if plan.offload.activations:
                act = rank_cost[r].act
                per_mb = act / link
                t_off += m * (max(0.0, per_mb - 0.9 * fwd[r]) + max(0.0, per_mb - 0.9 * bwd[r]))
                h += act * inflight_microbatches(plan.schedule, plan.pp, plan.vpp, m)
            opt_t, off_t, host = max(opt_t, t_opt), max(off_t, t_off), max(host, h)
        return opt_t, off_t, host

    def _muon_time(self, plan: Plan) -> float:
        """Newton-Schulz for this rank's matrices (each device orthogonalises its 1/shards share of matrices)."""
        sd, se = self._shards(plan)
        flops = 0.0
        for layer in self._kinds:
            count = sum(1 for x in self.work.layers if x.parts is layer.parts) / plan.pp
            for part in layer.parts:
                for g in part.gemms:
                    if g.expert:
                        flops += count * muon_flops(g.n, g.k) * part.num_experts / (plan.ep * plan.etp) / se
                    else:
                        flops += count * muon_flops(g.n, g.k) / sd / (1 if g.split == "rep" else plan.tp)
        peak = self.cluster.device.peak_flops("bf16")
        return flops / (peak * self.cal.gemm_peak_eff * 0.8)

    def _memory(self, plan: Plan, dense: list[float], expert: list[float], rank_cost: list[PartCost],
                act_layer_max: list[float]) -> tuple[dict[str, float], float, list[dict[str, float]]]:
        """Bytes on the busiest rank, by component (module docstring; ZeRO per Rajbhandari et al. 2020), that
        rank's activations at the end of forward (before the one-end-of-backward accounting), and every pipeline
        rank's components (the dry run compares its rank with them)."""
        cal, spec = self.cal, self.spec
        sd, se = self._shards(plan)
        m = plan.num_microbatches
        T = plan.micro_batch_size * plan.seq_len / plan.cp
        opt_b = optimizer_bytes_per_param(plan.optimizer)
        best: dict[str, float] = {}
        best_fwd_act = 0.0
        by_rank: list[dict[str, float]] = []
        # zbv / dualpipev: the stage is the FSDP root (moestack.parallel.pipeline.stage_module): parameters stay
        # gathered (bf16 copy, as ZeRO 0-2) and gradients unsharded (fp32) for the whole step
        held = self._gathered_for_step(plan)
        head_rank = chunk_ranks(plan.pp, plan.vpp, plan.schedule)[-1]  # the last chunk: LM head and loss (V: rank 0)
        for r in range(plan.pp):
            d, e = dense[r], expert[r]
            w_shard_d = sd if plan.zero_stage == 3 else 1
            w_shard_e = se if plan.zero_stage == 3 else 1
            g_shard_d = sd if plan.zero_stage >= 2 and not held else 1
            g_shard_e = se if plan.zero_stage >= 2 and not held else 1
            mem: dict[str, float] = {}
            e_dev = 0.0 if plan.offload.experts else e
            # embedding / LM head parameters on this rank (in d): AdamW under Muon, bf16 under the fp8 recipe
            vocab_params = ((r == 0) + (r == head_rank and not spec.tie_word_embeddings)) * \
                spec.vocab_size * spec.hidden_size / plan.tp
            if plan.offload.optimizer:
                # the device keeps a bf16 copy for compute (distributed plans: FSDP2 bf16 params); the one-device
                # trainer keeps its fp32 parameters under autocast (moestack.memory.adamw.CPUOffloadAdamW leaves
                # device parameters in their dtype), as autocast_weight_copies assumes
                w_b = FP32 if plan.devices == 1 else BF16
                mem["weights"] = d * w_b / w_shard_d + e_dev * w_b / w_shard_e
                if held and plan.zero_stage == 3:
                    mem["weights"] += (d + e_dev) * BF16  # the gathered copy
                mem["optimizer"] = 0.0
            else:
                # FSDP2 shards the fp32 parameters at every ZeRO stage (moestack/parallel/fsdp.py; Megatron's
                # distributed optimizer likewise keeps the fp32 master weights sharded): ZeRO 1/2 add the bf16 copy
                mem["weights"] = d * FP32 / sd + e_dev * FP32 / se
                mem["optimizer"] = d * opt_b / sd + e_dev * opt_b / se
                if plan.optimizer == "muon":  # Muon leaves the embedding and the LM head to AdamW (8 bytes)
                    mem["optimizer"] += vocab_params * (optimizer_bytes_per_param("adamw") - opt_b) / sd
            if plan.devices > 1 and (plan.zero_stage < 3 or held) and not plan.offload.optimizer:
                # FSDP2 (moestack/parallel/fsdp.py) computes with a bf16 copy of the parameters gathered in forward
                # and kept until backward under ZeRO 0-2; with one shard (ZeRO-0, or dp_shard = 1, e.g. pure TP)
                # that copy comes on top of the whole fp32 parameters
                fsdp = d * FP32 / sd + e_dev * FP32 / se + BF16 * bf16_weight_copy(plan, self.cluster, d, e_dev,
                                                                                   vocab_params)
                mem["weights"] = max(mem["weights"], fsdp)
            grad_b = grad_bytes(plan)
            mem["gradients"] = d * grad_b / g_shard_d + e_dev * grad_b / g_shard_e
            inflight = inflight_microbatches(plan.schedule, plan.pp, plan.vpp, m)
            if r > 0 and plan.schedule in ("1f1b", "interleaved_1f1b"):
                inflight = max(1.0, inflight - r * (2 if plan.schedule == "interleaved_1f1b" else 1) / plan.vpp)
            act = rank_cost[r].act
            if plan.offload.activations:  # layers in flight (copying out / being produced) + what is never offloaded
                in_flight = ACT_OFFLOAD_LAYERS * cal.act_factors.get("activation_offload", 1.0)
                mem["activations"] = in_flight * act_layer_max[r] + rank_cost[r].act_kept * inflight
            else:
                mem["activations"] = act * inflight
            buffers = 0.0
            if r == head_rank and framework_of(plan.host_profile) == "megatron":
                # Megatron's vocabulary-parallel fused cross-entropy (Transformer Engine): the bf16 logits of the
                # rank's vocabulary shard, their gradient written in place, per output head (main + MTP)
                buffers = max(buffers, T * spec.vocab_size / plan.tp * BF16 * self.work.num_heads_out)
            elif r == head_rank:  # the chunked loss: one chunk's logits at a time
                # under TP the head is replicated and each rank runs the loss on its sequence shard (head_cost):
                # chunks of the full vocabulary over T / tp tokens (tp2, 2 x H200: +7.5 GiB in the loss phase)
                buffers = max(buffers, min(T / plan.tp, LOSS_CHUNK_TOKENS) * spec.vocab_size * LOSS_BYTES_PER_LOGIT)
            if spec.moe is not None:
                moe_buf = (T / plan.tp * spec.moe.top_k * (spec.moe.latent_size or spec.hidden_size) * BF16
                           * MOE_MEMORY_HEADROOM * 2)
                buffers = max(buffers, moe_buf)
            if plan.zero_stage == 3 and not held:  # held: the whole gathered copy is in "weights"
                per_layer = (d + e) / max(1, len(self.work.layers) / plan.pp)
                buffers += 2 * per_layer * BF16
            if fp8_recipe_runs(plan.precision, self.cluster):
                # the fp8 weight cache (moestack/ops/fp8/weight_cache.py): both layouts, 1 byte each, of the
                # FP8 GEMMs' weights (all but embedding / head) until the optimizer step; under ZeRO-3 only those of
                # the layer gathered now (it drops what FSDP frees)
                fp8_bytes = 2 * (max(0.0, d - vocab_params) + e_dev)
                recipe = GEMM_RECIPES[plan.precision]
                if recipe.scaling == "native":  # Transformer Engine: row- and column-wise copies, with their scales
                    fp8_bytes *= recipe.elem_bytes + recipe.scale_bytes
                gathered = plan.zero_stage == 3 and not held
                mem["fp8_weights"] = fp8_bytes / max(1, len(self.work.layers) / plan.pp) if gathered else fp8_bytes
            expert_ws = 0.0
            if plan.offload.experts:  # one layer's fetched bf16 weights, the next GEMM's prefetch, the fp32 dW
                per_layer_e = e / max(1, len(self.work.layers) / plan.pp)
                expert_ws = 2 * per_layer_e * BF16 + per_layer_e * FP32
            if plan.offload.experts and not self._grads_build_up(plan):
                buffers += expert_ws  # several micro-batches / devices: kept as a sum (not measured)
            if plan.tp > 1:
                buffers += T * spec.hidden_size * BF16
            mem["buffers"] = buffers
            fwd_act = mem["activations"]
            if self._grads_build_up(plan):
                self._one_end_of_backward(plan, mem, expert_ws, r == 0)
            mem["reserved"] = cal.runtime_reserved_gib * GIB
            by_rank.append(mem)
            if sum(mem.values()) > sum(best.values()):
                best, best_fwd_act = mem, fwd_act
        return best, best_fwd_act, by_rank


def binding_constraint(cost: PlanCost) -> str:
    """The limit this plan hits first: memory when within 5% of HBM, else the largest exposed time term."""
    if cost.host_bytes > cost.host_capacity:
        return f"host memory ({cost.host_bytes / GIB:.0f} GiB needed > {cost.host_capacity / GIB:.0f} GiB)"
    frac = cost.memory_fraction
    if frac > 0.95:
        return f"memory ({frac:.0%} of HBM)"
    names = {"gemm": "GEMM compute", "attention": "attention kernels", "kda": "KDA kernels",
             "elementwise": "memory-bound kernels", "recompute": "recompute", "tp_comm": "TP communication",
             "cp_comm": "CP communication", "ep_comm": "EP all-to-all", "pp_bubble": "pipeline bubble",
             "pp_p2p": "pipeline p2p", "dp_comm": "DP communication", "tp_grad_sum": "deferred TP gradient sums",
             "optimizer": "optimizer step",
             "offload": "host offload link", "host": "host (CPU) launch time"}
    key = max(cost.time, key=cost.time.get)
    return f"{names.get(key, key)} ({cost.time[key] / cost.step_time_s:.0%} of step)"
