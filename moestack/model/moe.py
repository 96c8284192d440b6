"""Stable LatentMoE (Kimi K3) and plain MoE: router, stacked experts, the layer.

    topk_idx, topk_w = router(x)          # on the full hidden, fp32
    h = down_proj(x)                      # hidden -> latent, once per token, before dispatch
    y = sum_i topk_w[i] * expert_i(h)     # experts in the latent: latent -> inter (gate, up) -> latent
    y = RMSNorm(y)                        # if spec.latent_norm
    out = up_proj(y) + shared(x)          # shared experts fused into one GLU MLP on the full hidden
With spec.latent_size None it is a plain MoE: no down/up proj, no latent norm, experts on the full hidden.

Balancing: the aux-loss-free selection bias, moved by the trainer once per optimizer step through
`Router.update_selection_bias` ("sign": DeepSeek-V3's fixed step; "quantile": Kimi K3's quantile balancing), and
losses attached to the output with attach_aux_loss: the sequence-wise loss, the global-batch loss and the router
z-loss (moestack.model.balance).

Legend: B batch, T tokens (per sequence in x_BTD; B*T flattened elsewhere), D hidden, L expert width (latent, or
D for a plain MoE), I expert intermediate, E experts, K top-k, N = B*T*K routed rows.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist
from torch import nn

from moestack.config.model_spec import MoESpec, RouterSpec
from moestack.model.aux_loss import attach_aux_loss
from moestack.model.balance import global_balance_loss, global_load_counts, router_z_loss
from moestack.model.mlp import ACTIVATIONS, GLUMLP, glu_activation
from moestack.model.norm import RMSNorm
from moestack.model.weights import compute_weight
from moestack.ops import moe as moe_ops
from moestack.ops.moe import quantile, reference, routing


class Router(nn.Module):
    """Scores E experts per token in fp32 and picks top-k (moestack.ops.moe.route has the exact rule).

    State: `weight` [E, D] (parameter); `selection_bias` [E] fp32 (persistent buffer, model state; None when
    spec.selection_bias is off). Per optimizer step, reset by `update_selection_bias` (non-persistent, counted in
    training-mode forwards only): `tokens_per_expert` [E] int64, the routed slots; `quantile_hist` [E, B] int32,
    the required-bias histogram of step-scope quantile balancing (None unless spec.bias_update is "quantile" with
    quantile_scope "step"); `batch_bias_sum` [E + 1] fp32, batch scope's sum of the micro-batches' solved biases
    and their count (the step's mean becomes the selection bias: evaluation routes with it and the next step's
    solves start from it);
    `global_load` [E] int64, the global-batch loss's slot counts of the step's finished micro-batches (summed over
    the balance group; `finish_microbatch` folds in the last forward's).
    After each training forward: `last_z_loss` (detached, None when spec.z_loss_coef is 0).
    `jitter_seed` int64 [] (non-persistent): the selection jitter's seed, set by the trainer once per optimizer
    step (`set_jitter_seeds`), so a recompute and a resumed run draw the same jitter.
    """

    # the forward-accumulated buffers a recompute must restore (moestack.memory.recompute)
    forward_counters = ("tokens_per_expert", "quantile_hist", "batch_bias_sum")

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, spec: RouterSpec):
        super().__init__()
        self.num_experts, self.top_k, self.spec = num_experts, top_k, spec
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        bias = torch.zeros(num_experts, dtype=torch.float32) if spec.selection_bias else None
        self.register_buffer("selection_bias", bias, persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        by_quantile = spec.bias_update == "quantile" and spec.selection_bias
        batch = by_quantile and spec.quantile_scope == "batch"
        hist = torch.zeros(num_experts, spec.quantile_bins, dtype=torch.int32) if by_quantile and not batch else None
        self.register_buffer("quantile_hist", hist, persistent=False)
        # "batch" scope: the sum of the step's solved micro-batch biases [E] and their count in the last slot
        self.register_buffer("batch_bias_sum", torch.zeros(num_experts + 1) if batch else None, persistent=False)
        self.register_buffer("global_load", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        self.register_buffer("jitter_seed", torch.zeros((), dtype=torch.int64), persistent=False)
        self.backend: str | None = None  # routing backend (moestack.ops.moe.routing); None = auto (by device)
        self.solve_graph = False  # batch-scope solve as one CUDA graph (KernelSpec.moe.solve_graph, set at build)
        self.seq_shard_group: dist.ProcessGroup | None = None  # kept equal to the MoE's (MoE.seq_shard_group)
        self.balance_group: dist.ProcessGroup | None = None  # kept equal to the MoE's (MoE.balance_group)
        self.last_z_loss: torch.Tensor | None = None
        self._global_load_last: torch.Tensor | None = None

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x_TD [T, D] -> topk_idx_TK int64, topk_w_TK and scores_TE in at least fp32 (never autocast).
        With spec.z_loss_coef > 0 the z-loss rides on topk_w_TK (attach_aux_loss)."""
        logits_TE = routing.router_logits(x_TD, self.weight)  # fp32; split-bf16 GEMMs for bf16 x on CUDA
        s = self.spec
        bias_E = self.selection_bias
        # the choosing scores are scores + jitter_TE (training only): the solvers balance those, the route adds it
        jitter_TE = None
        if self.training and s.selection_jitter > 0:  # validated: only with a selection bias
            jitter_TE = reference.selection_jitter(*logits_TE.shape, self.jitter_seed, s.selection_jitter)
        if self.training and self.batch_bias_sum is not None:
            with torch.no_grad():
                probs_TE = torch.sigmoid(logits_TE) if s.score == "sigmoid" else torch.softmax(logits_TE, dim=-1)
                if jitter_TE is not None:
                    probs_TE = probs_TE + jitter_TE
                bias_E = quantile.solve_batch_bias(probs_TE, bias_E, self.top_k, s.quantile_bins,
                                                   s.quantile_iterations, s.quantile_start, self.balance_group,
                                                   self.backend, s.quantile_momentum, graph=self.solve_graph)
                self.batch_bias_sum[:-1].add_(bias_E)
                self.batch_bias_sum[-1].add_(1.0)
        route_bias = bias_E if jitter_TE is None else jitter_TE + bias_E
        topk_idx_TK, topk_w_TK, scores_TE, counts_E = routing.route(
            logits_TE, route_bias, self.top_k, s.score, s.num_groups, s.topk_groups, s.renormalize,
            s.scaling_factor, backend=self.backend,
        )
        if self.training:
            # Eval forwards are not counted; a recompute restores these (moestack.memory.recompute).
            with torch.no_grad():
                self.tokens_per_expert.add_(counts_E)
                if self.quantile_hist is not None:
                    choosing_TE = scores_TE if jitter_TE is None else scores_TE.detach() + jitter_TE
                    quantile.accumulate_histogram_(self.quantile_hist, choosing_TE, self.selection_bias, self.top_k)
        self.last_z_loss = None
        if s.z_loss_coef > 0 and torch.is_grad_enabled():
            z = router_z_loss(logits_TE, s.z_loss_coef, self.seq_shard_group)
            self.last_z_loss = z.detach()
            topk_w_TK = attach_aux_loss(topk_w_TK, z)
        return topk_idx_TK, topk_w_TK, scores_TE

    def finish_microbatch(self) -> None:
        """Fold the last forward's global-batch counts into the step's (the trainer calls this after each
        micro-batch's backward, so a recompute of that forward sees the same counts as the forward)."""
        if self._global_load_last is not None:
            self.global_load.add_(self._global_load_last)
            self._global_load_last = None

    @torch.no_grad()
    def update_selection_bias(self, counts: torch.Tensor | None = None) -> torch.Tensor:
        """Move the selection bias once per optimizer step, then reset the step's accumulators.

        "sign": bias += gamma * sign(mean_load - load) (gamma = spec.bias_update_rate). "quantile", step scope:
        bias = the histogram's solution (moestack.ops.moe.quantile.solve_histogram; an empty histogram keeps the
        bias); batch scope: the mean of the step's solved micro-batch biases (none: the bias stays).
        counts [E]: tokens per expert over the optimizer step; default: this router's accumulator. In distributed
        runs the caller sums the accumulators (tokens_per_expert, quantile_hist) over the ranks first.
        Returns the counts used (a tensor on the router's device).
        """
        if counts is None:
            counts = self.tokens_per_expert.clone()
        if self.selection_bias is not None:
            if self.batch_bias_sum is not None:  # the step's mean solved bias: the next step starts from it
                total, n = self.batch_bias_sum[:-1], self.batch_bias_sum[-1]
                mean_E = total / n.clamp_min(1.0)
                self.selection_bias.copy_(torch.where(n > 0, mean_E - mean_E.mean(), self.selection_bias))
            elif self.quantile_hist is not None:
                self.selection_bias.copy_(quantile.solve_histogram(self.quantile_hist, self.selection_bias,
                                                                   self.top_k))
            elif self.spec.bias_update_rate > 0:
                load = counts.to(torch.float32)
                self.selection_bias.add_(torch.sign(load.mean() - load), alpha=self.spec.bias_update_rate)
        self.reset_step_state()
        return counts

    @torch.no_grad()
    def reset_step_state(self) -> None:
        """Zero the per-step accumulators (also after a skipped step)."""
        self.tokens_per_expert.zero_()
        if self.quantile_hist is not None:
            self.quantile_hist.zero_()
        if self.batch_bias_sum is not None:
            self.batch_bias_sum.zero_()
        self.global_load.zero_()
        self._global_load_last = None

    @torch.no_grad()
    def init_weights(self, std: float) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=std)
        if self.selection_bias is not None:
            self.selection_bias.zero_()
        self.jitter_seed.zero_()
        self.reset_step_state()


@torch.no_grad()
def set_jitter_seeds(routers: dict[str, Router], step: int) -> None:
    """Seed each router's selection jitter for an optimizer step: a function of its module name and the step only,
    so the draw is the same after a resume and under any pipeline split of the layers."""
    for name, router in routers.items():
        if router.spec.selection_jitter > 0:
            router.jitter_seed.fill_((zlib.crc32(name.encode()) + step * 0x9E3779B1) & 0x7FFFFFFF)


class Experts(nn.Module):
    """E GLU experts with stacked weights, run on expert-sorted rows.

    Layout: `w_gate_up` [E, 2I, L] (per expert the gate rows, then the up rows) and `w_down` [E, L, I], i.e. each
    expert slice is nn.Linear's (out, in) weight. Why: HF checkpoints store per-expert Linear weights, so import
    is a stack; expert parallelism shards dim 0 into contiguous per-expert blocks; the transposed views passed to
    the grouped GEMM ([E, L, 2I], [E, I, L]) are "column-major B", which grouped GEMM kernels (and FP8 on Hopper)
    want; gate and up fused in one GEMM read each row once and double the GEMM width. (Tensor-parallel sharding of
    experts must split gate and up separately: view w_gate_up as [E, 2, I, L].)
    """

    def __init__(
        self,
        num_experts: int,
        dim: int,
        intermediate_size: int,
        activation: str = "situ_glu",
        situ_beta: float = 4.0,
        situ_linear_beta: float = 25.0,
    ):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        self.activation, self.situ_beta, self.situ_linear_beta = activation, situ_beta, situ_linear_beta
        self.w_gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, dim))
        self.w_down = nn.Parameter(torch.empty(num_experts, dim, intermediate_size))
        # the GEMM strategy, set at build time: the bf16 registry with KernelSpec.moe.gemm (moestack/model/kernels.py),
        # the FP8 GEMMs under precision fp8 (moestack/ops/fp8/convert.py), wrapped by the expert offload
        self.gemm = moe_ops.GroupedGemm()
        self.routing_backend: str | None = None  # activation: "triton" = fused kernel; None = auto (by device)
        # "mxfp4": quantisation-aware training, the weights the GEMMs see are their MXFP4 values (groups of 32
        # along the last dim, as the released checkpoint stores w1/w3/w2), straight-through gradient
        self.fake_quant: str | None = None

    def grouped_mm(self, x_ND: torch.Tensor, w_EDF: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
        """The seam for the hot op: the strategy in `self.gemm`. x [N, D] sorted by expert, w [E, D, F]."""
        return self.gemm(x_ND, w_EDF, offs_E)

    def forward(self, h_NL: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
        """h_NL [N, L] rows sorted by expert, offs_E int32 [E] cumulative ends -> [N, L] (unweighted outputs).
        With the "triton" routing backend (`routing_backend`, else by device) the activation is one fused kernel
        each way that saves only gate_up; otherwise the eager glu_activation."""
        return self.ffn(h_NL, compute_weight(self, "w_gate_up"), compute_weight(self, "w_down"), offs_E)

    def ffn(
        self, x_NL: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, offs_E: torch.Tensor
    ) -> torch.Tensor:
        """The experts on these weights (Experts' layout): gate/up GEMM -> glu -> down GEMM through the seam."""
        if self.fake_quant == "mxfp4":
            from moestack.ops.mxfp4 import fake_quantize_mxfp4

            w_gate_up, w_down = fake_quantize_mxfp4(w_gate_up), fake_quantize_mxfp4(w_down)
        gate_up_N2I = self.grouped_mm(x_NL, w_gate_up.transpose(1, 2), offs_E)
        return self.grouped_mm(self.glu(gate_up_N2I), w_down.transpose(1, 2), offs_E)

    def glu(self, gate_up_N2I: torch.Tensor) -> torch.Tensor:
        """[N, 2I] (gate | up) -> [N, I]: the fused kernel (saves only gate_up) with the "triton" routing backend,
        else the eager glu_activation (which saves its fp32 intermediates). Expert parallelism calls it too."""
        fused = gate_up_N2I.dtype in (torch.float32, torch.bfloat16, torch.float16)
        if fused and routing.resolve_backend(self.routing_backend, gate_up_N2I.device) == "triton":
            from moestack.ops.moe.triton_activation import fused_glu

            return fused_glu(gate_up_N2I, self.activation, self.situ_beta, self.situ_linear_beta)
        gate_NI, up_NI = gate_up_N2I.chunk(2, dim=-1)
        return glu_activation(gate_NI, up_NI, self.activation, self.situ_beta, self.situ_linear_beta)

    @torch.no_grad()
    def init_weights(self, std: float) -> None:
        nn.init.normal_(self.w_gate_up, mean=0.0, std=std)
        nn.init.normal_(self.w_down, mean=0.0, std=std)


def sequence_aux_loss(
    scores_BTE: torch.Tensor, topk_idx_BTK: torch.Tensor, coef: float, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Sequence-wise balance loss (DeepSeek-V3): mean over sequences of coef * sum_i f_i P_i, with
    f_i = E / (K*T) * count_i(seq) and P_i = mean_t(s_i / sum_j s_j). Differentiable through scores (fp32).

    group: the ranks one sequence's tokens are split over (tensor / sequence / context parallelism; this rank holds
    T of the T * |group| tokens). Counts are then summed over it and the result is this rank's share: the shares
    add up to the loss of the whole sequences, and backward through each share gives exactly its tokens' gradient.
    """
    B, T, E = scores_BTE.shape
    K = topk_idx_BTK.shape[-1]
    counts_BE = scores_BTE.new_zeros((B, E)).scatter_add_(
        1, topk_idx_BTK.reshape(B, T * K), scores_BTE.new_ones((B, T * K))
    )
    T_seq = T
    if group is not None:
        dist.all_reduce(counts_BE, group=group)  # no gradient flows through the counts
        T_seq = T * dist.get_world_size(group)
    f_BE = counts_BE * (E / (K * T_seq))
    P_BE = (scores_BTE / scores_BTE.sum(-1, keepdim=True)).sum(1) / T_seq
    return coef * (f_BE * P_BE).sum(-1).mean()


class MoE(nn.Module):
    """Stable LatentMoE (spec.latent_size set) or plain MoE layer, with optional fused shared experts.

    After each forward: `last_expert_counts` [E] int64 (routed slots per expert, detached), `last_dropped` (int64
    device scalar: slots dropped by spec.capacity_factor, 0 when dropless), `last_aux_loss` (the detached
    sequence-wise aux loss, or None when router.seq_aux_loss_coef is 0) and `last_global_aux_loss` (the global-batch
    loss, or None when router.global_aux_loss_coef is 0), for logging.

    Token path: moestack.ops.moe.routing (backend "triton" on CUDA, "reference" elsewhere; `routing_backend`
    overrides). `row_align` pads each expert's row block to a multiple (for grouped GEMMs that want it).

    Host syncs: none on the native grouped-GEMM path (CUDA bf16); the grouped-GEMM fallbacks (CPU, fp32 on GPU,
    unaligned shapes) read the largest expert group on the host once per GEMM (moestack/ops/moe/README.md).
    """

    def __init__(
        self,
        hidden_size: int,
        spec: MoESpec,
        activation: str,
        situ_beta: float = 4.0,
        situ_linear_beta: float = 25.0,
        norm_eps: float = 1e-5,
    ):
        super().__init__()
        self.spec = spec
        width = spec.latent_size or hidden_size
        self.router = Router(hidden_size, spec.num_experts, spec.top_k, spec.router)
        latent = spec.latent_size is not None
        self.down_proj = nn.Linear(hidden_size, width, bias=False) if latent else None
        self.experts = Experts(
            spec.num_experts, width, spec.expert_intermediate_size, activation, situ_beta, situ_linear_beta
        )
        self.latent_norm = RMSNorm(width, eps=norm_eps) if latent and spec.latent_norm else None
        self.up_proj = nn.Linear(width, hidden_size, bias=False) if latent else None
        self.shared = (
            GLUMLP(hidden_size, spec.shared_intermediate_size, activation, situ_beta, situ_linear_beta)
            if spec.num_shared_experts > 0
            else None
        )
        self.last_aux_loss: torch.Tensor | None = None
        self.last_global_aux_loss: torch.Tensor | None = None
        self.last_expert_counts: torch.Tensor | None = None
        self.last_dropped: torch.Tensor | None = None
        self.row_align = 1
        # set by moestack.parallel (TP / SP / CP): the ranks one sequence's tokens are split over
        self.seq_shard_group: dist.ProcessGroup | None = None
        # set by moestack.parallel.parallelize: the ranks of this pipeline stage holding other tokens (global loss,
        # batch-scope quantile balancing)
        self.balance_group: dist.ProcessGroup | None = None

    @property
    def balance_group(self) -> dist.ProcessGroup | None:
        return self.router.balance_group

    @balance_group.setter
    def balance_group(self, group: dist.ProcessGroup | None) -> None:
        self.router.balance_group = group

    @property
    def seq_shard_group(self) -> dist.ProcessGroup | None:
        return self.router.seq_shard_group

    @seq_shard_group.setter
    def seq_shard_group(self, group: dist.ProcessGroup | None) -> None:
        self.router.seq_shard_group = group

    @property
    def routing_backend(self) -> str | None:
        """Backend of the token path (moestack.ops.moe.routing): router, dispatch, gather, combine and the
        experts' activation (KernelSpec.moe.routing). None = auto (by device)."""
        return self.router.backend

    @routing_backend.setter
    def routing_backend(self, name: str | None) -> None:
        self.router.backend = self.experts.routing_backend = name

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        """x_BTD [B, T, D] -> [B, T, D]. Backward through the output also backpropagates the aux loss."""
        B, T, D = x_BTD.shape
        E, K = self.spec.num_experts, self.spec.top_k
        x_TD = x_BTD.reshape(B * T, D)
        topk_idx_TK, topk_w_TK, scores_TE = self.router(x_TD)

        h_TL = self.down_proj(x_TD) if self.down_proj is not None else x_TD
        backend = self.router.backend
        cap = None
        if self.spec.capacity_factor is not None:
            cap = routing.capacity_rows(B * T, K, E, self.spec.capacity_factor, self.row_align)
        d = routing.dispatch(topk_idx_TK, E, self.row_align, cap, topk_w_TK.detach(), backend)
        y_RL = self.experts(routing.gather(h_TL, d, backend), d.offs_E)
        y_TL = routing.combine(y_RL, d, topk_w_TK, backend)
        if self.latent_norm is not None:
            y_TL = self.latent_norm(y_TL)
        out_TD = self.up_proj(y_TL) if self.up_proj is not None else y_TL
        if self.shared is not None:
            out_TD = out_TD + self.shared(x_TD)
        out_BTD = out_TD.view(B, T, D)

        self.last_expert_counts = d.counts_E.detach()
        self.last_dropped = d.dropped
        r = self.spec.router
        aux = None
        self.last_aux_loss = self.last_global_aux_loss = None
        if r.seq_aux_loss_coef > 0:
            aux = sequence_aux_loss(scores_TE.view(B, T, E), topk_idx_TK.view(B, T, K), r.seq_aux_loss_coef,
                                    self.seq_shard_group)
            self.last_aux_loss = aux.detach()
        if r.global_aux_loss_coef > 0 and torch.is_grad_enabled():
            load_E = global_load_counts(d.counts_E, self.balance_group)
            if self.training:
                self.router._global_load_last = load_E
            gbl = global_balance_loss(scores_TE, self.router.global_load + load_E, r.global_aux_loss_coef,
                                      self.seq_shard_group)
            self.last_global_aux_loss = gbl.detach()
            aux = gbl if aux is None else aux + gbl
        return attach_aux_loss(out_BTD, aux)

    @torch.no_grad()
    def init_weights(self, std: float) -> None:
        self.router.init_weights(std)
        self.experts.init_weights(std)
        for lin in (self.down_proj, self.up_proj):
            if lin is not None:
                nn.init.normal_(lin.weight, mean=0.0, std=std)
        if self.latent_norm is not None:
            nn.init.ones_(self.latent_norm.weight)
        if self.shared is not None:
            self.shared.init_weights(std)
