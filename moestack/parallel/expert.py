"""Expert parallelism (EP): routed experts sharded over ranks, rows dispatched to their owners with all-to-all.

Applied from outside: `apply_expert_parallel(model, ep_mesh, dispatcher)` shards each MoE's `experts` weights on
dim 0 over the ep mesh (DTensor Shard(0): rank j owns the contiguous experts [j*E_loc, (j+1)*E_loc), and DCP can
reshard them across EP degrees) and swaps the module's class to `ExpertParallelExperts`, whose forward moves rows
to their owners, runs the local experts and moves the outputs back. `MoE.forward` is untouched: it still calls
`experts(h_sorted, offs)` with rows in global expert order, and the parameter names do not change.

One forward (flat dispatcher, P ranks, E_loc experts each):
    counts [P, E_loc] -> all-to-all of counts      (small; every rank learns what it will receive)
    one host sync for the split sizes               (the dropless path: buffers sized by the real counts)
    rows (dest rank, expert) -> all-to-all          (ONE fused buffer per direction, uneven splits)
    received (src rank, expert) -> (expert, src)    (a gather: the local grouped GEMM wants expert-major rows)
    local experts -> inverse gather -> all-to-all back
The hierarchical dispatcher (n domains of D ranks) routes the same rows in two hops: first inside the fast domain,
to the rank whose local index matches the owner's, then ONE cross-domain exchange per destination domain (each
carrying the rows of all D ranks of the source domain for that peer), which lands every row on its owner.
Cross-domain messages per rank drop from (n-1)*D to n-1 and each is D times larger.

Autograd: the all-to-alls are `moestack.parallel.comm.all_to_all` (backward = the reverse exchange, saving only
split sizes) and the regroupings are index gathers; under activation recompute nothing is kept twice.

Legend: N rows in (sorted by global expert), R rows received, L row width (latent), E experts, E_loc = E / P,
P ranks in the EP group, n domains, D ranks per domain.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from moestack.config.base import ConfigError
from moestack.config.model_spec import RouterSpec
from moestack.model.moe import Experts, MoE
from moestack.parallel.comm import SendOrder, all_to_all, exchange_counts
from moestack.parallel.overlap_fb import overlap_point

LocalFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def regroup_index(counts_ABC: torch.Tensor, total: int) -> torch.Tensor:
    """Index that reorders rows laid out as chunks (a, b, c) [row-major, chunk (a,b,c) has counts_ABC[a,b,c]
    rows] into (b, a, c) order: rows_bac = rows_abc[index]. `total` = counts_ABC.sum() as a Python int (known
    from the split sizes, so no host sync here). Returns int64 [total]."""
    A, B, C = counts_ABC.shape
    counts_ABC = counts_ABC.long()
    starts_abc = torch.cumsum(counts_ABC.reshape(-1), 0) - counts_ABC.reshape(-1)  # source start of each chunk
    counts_bac = counts_ABC.permute(1, 0, 2).reshape(-1)
    src_start_bac = starts_abc.view(A, B, C).permute(1, 0, 2).reshape(-1)
    dst_start_bac = torch.cumsum(counts_bac, 0) - counts_bac
    chunk_R = torch.repeat_interleave(torch.arange(A * B * C, device=counts_ABC.device), counts_bac,
                                      output_size=total)
    offset_R = torch.arange(total, device=counts_ABC.device) - dst_start_bac[chunk_R]
    return src_start_bac[chunk_R] + offset_R


def invert_index(index_R: torch.Tensor) -> torch.Tensor:
    """The inverse permutation: inv[index[i]] = i."""
    inv = torch.empty_like(index_R)
    inv[index_R] = torch.arange(index_R.numel(), device=index_R.device)
    return inv


def _splits(*counts: torch.Tensor, totals: tuple[int, ...]) -> list[list[int]]:
    """Row sums of several [G, X] count tensors as Python lists, with one host sync for all of them.

    totals: the rows each count tensor adds up to (known from shapes). A dry run (moestack/train/dry_run.py) has no
    counts to read (fake tensors): there every group gets an even share of its total, i.e. balanced routing."""
    if is_fake(counts[0]):
        return [even_split(total, c.shape[0]) for c, total in zip(counts, totals, strict=True)]
    sums = torch.cat([c.sum(1) for c in counts]).tolist()
    out, i = [], 0
    for c in counts:
        out.append(sums[i : i + c.shape[0]])
        i += c.shape[0]
    return out


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def even_split(total: int, parts: int) -> list[int]:
    """`total` rows over `parts` groups as evenly as possible (the first groups take the remainder)."""
    return [total // parts + (i < total % parts) for i in range(parts)]


class FlatDispatcher:
    """One all-to-all per direction over the whole EP group."""

    overlap = False  # plan.ep_comm_overlap: hand-over points for DualPipeV's overlapped F / B (overlap_fb.py)

    def __init__(self, group: dist.ProcessGroup, send_order: SendOrder = "backend"):
        self.group, self.order = group, send_order
        self.size = dist.get_world_size(group)

    def __call__(self, h_NL: torch.Tensor, counts_E: torch.Tensor, local_fn: LocalFn) -> torch.Tensor:
        P, mark = self.size, overlap_point if self.overlap else _identity
        h_NL = mark(h_NL)  # before the dispatch
        send_PX = counts_E.view(P, -1)
        recv_PX = exchange_counts(send_PX, self.group)
        in_splits, out_splits = _splits(send_PX, recv_PX, totals=(h_NL.shape[0],) * 2)
        R = sum(out_splits)
        x_RL = mark(all_to_all(h_NL, out_splits, in_splits, self.group, self.order))  # (src rank, local expert)
        order_R = regroup_index(recv_PX.unsqueeze(-1), R)  # -> (local expert, src rank)
        offs_X = torch.cumsum(recv_PX.sum(0), 0).to(torch.int32)
        y_RL = mark(local_fn(x_RL[order_R], offs_X)[invert_index(order_R)])  # before the combine
        return mark(all_to_all(y_RL, in_splits, out_splits, self.group, self.order))


class HierarchicalDispatcher:
    """Two hops: inside the fast domain to the owner's local index, then one exchange per destination domain.

    intra_group: the D ranks of my domain (group rank = local index); cross_group: the n ranks with my local index,
    one per domain (group rank = domain index). EP rank = domain * D + local index.
    """

    overlap = False  # as FlatDispatcher.overlap

    def __init__(self, intra_group: dist.ProcessGroup, cross_group: dist.ProcessGroup):
        self.intra, self.cross = intra_group, cross_group
        self.D, self.n = dist.get_world_size(intra_group), dist.get_world_size(cross_group)

    def __call__(self, h_NL: torch.Tensor, counts_E: torch.Tensor, local_fn: LocalFn) -> torch.Tensor:
        n, D, mark = self.n, self.D, overlap_point if self.overlap else _identity
        h_NL = mark(h_NL)
        c_nDX = counts_E.view(n, D, -1)  # rows to (domain, local index, local expert), in this order in h_NL
        X = c_nDX.shape[-1]
        # hop 1 (intra-domain): group by destination local index
        send_a = c_nDX.permute(1, 0, 2).reshape(D, n * X)
        recv_a = exchange_counts(send_a, self.intra)  # [src local, (domain, expert)]
        # hop 2 (cross-domain): group what arrived by destination domain
        r_DnX = recv_a.view(D, n, X)
        send_b = r_DnX.permute(1, 0, 2).reshape(n, D * X)
        recv_b = exchange_counts(send_b, self.cross)  # [src domain, (src local, expert)] = [src ep rank, expert]
        in_a, out_a, in_b, out_b = _splits(send_a, recv_a, send_b, recv_b, totals=(h_NL.shape[0],) * 4)
        N, A, R = sum(in_a), sum(out_a), sum(out_b)

        order_a = regroup_index(c_nDX, N)  # (domain, local, expert) -> (local, domain, expert)
        x = all_to_all(h_NL[order_a], out_a, in_a, self.intra)  # (src local, domain, expert)
        order_b = regroup_index(r_DnX, A)  # -> (domain, src local, expert)
        x = mark(all_to_all(x[order_b], out_b, in_b, self.cross))  # (src domain, src local, expert)
        recv_PX = recv_b.view(n * D, X)
        order_l = regroup_index(recv_PX.unsqueeze(-1), R)  # -> (expert, src rank)
        offs_X = torch.cumsum(recv_PX.sum(0), 0).to(torch.int32)

        y = mark(local_fn(x[order_l], offs_X)[invert_index(order_l)])
        y = all_to_all(y, in_b, out_b, self.cross)[invert_index(order_b)]
        return mark(all_to_all(y, in_a, out_a, self.intra)[invert_index(order_a)])


Dispatcher = FlatDispatcher | HierarchicalDispatcher


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class ExpertParallelExperts(Experts):
    """`Experts` with weights sharded over the EP group (installed by `apply_expert_parallel`, not constructed).

    forward(h_NL [N, L] sorted by global expert, offs_E int32 [E]) -> [N, L] in the same row order, exactly what
    `Experts.forward` returns on one device; in between, the rows visit the ranks owning their experts.
    """

    ep_dispatcher: Dispatcher
    ep_etp_group: dist.ProcessGroup | None = None  # expert tensor parallelism (etp > 1)

    def local_forward(self, x_RL: torch.Tensor, offs_X: torch.Tensor) -> torch.Tensor:
        """The local experts on rows sorted by local expert (Experts.forward on this rank's weight shard)."""
        w_gate_up, w_down = _local(self.w_gate_up), _local(self.w_down)
        # the same path as one device (the fused activation on CUDA: the eager GLU keeps its intermediates)
        return self.ffn(x_RL, w_gate_up, w_down, offs_X)

    def forward(self, h_NL: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
        offs = offs_E.long()
        counts_E = torch.diff(offs, prepend=offs.new_zeros(1))
        local_fn = self.local_forward
        if self.ep_etp_group is not None:  # expert tensor parallelism: the etp peers share the rows, split I
            local_fn = functools.partial(etp_local_forward, group=self.ep_etp_group, local_fn=self.local_forward)
        return self.ep_dispatcher(h_NL, counts_E, local_fn)


def _shard_dim0(param: nn.Parameter, ep_mesh: DeviceMesh) -> nn.Parameter:
    """This rank's contiguous dim-0 block as a DTensor Shard(0) over ep_mesh (local slice: no communication, works
    on meta; every rank built the same full weights from the same seed)."""
    P, j = ep_mesh.size(), ep_mesh.get_local_rank()
    block = param.shape[0] // P
    local = param.detach()[j * block : (j + 1) * block].clone()
    dt = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False, shape=param.shape,
                            stride=param.stride())
    return nn.Parameter(dt, requires_grad=param.requires_grad)


def etp_local_forward(x_RL: torch.Tensor, offs_X: torch.Tensor, group: dist.ProcessGroup, local_fn: LocalFn
                      ) -> torch.Tensor:
    """Expert tensor parallelism around the local experts: every rank of the etp group holds the same experts with
    1/etp of each one's intermediate dim (column-parallel gate/up, row-parallel down). The rows that reached any of
    them are shared (an all-gather as one all-to-all with uneven splits), each computes its partial outputs
    (x W_gate_up,t -> act -> W_down,t), and the partial sums go back to the rank the rows came from and are added
    (the row-parallel reduce, as the reverse all-to-all plus a sum). Exact; rows sorted by local expert in and out.
    """
    P = dist.get_world_size(group)
    R = x_RL.shape[0]
    offs = offs_X.long()
    counts_X = torch.diff(offs, prepend=offs.new_zeros(1))
    recv_PX = exchange_counts(counts_X.expand(P, -1), group)  # [src etp rank, local expert]
    (out_splits,) = _splits(recv_PX, totals=(R * P,))
    in_splits = [R] * P
    x_all = all_to_all(x_RL.repeat(P, 1), out_splits, in_splits, group)  # (src, expert)
    order = regroup_index(recv_PX.unsqueeze(-1), sum(out_splits))  # -> (expert, src)
    offs_all = torch.cumsum(recv_PX.sum(0), 0).to(torch.int32)
    y_part = local_fn(x_all[order], offs_all)[invert_index(order)]  # my partial sums, rows (src, expert)
    return all_to_all(y_part, in_splits, out_splits, group).view(P, R, x_RL.shape[1]).sum(0)


def _shard_experts_2d(param: nn.Parameter, mesh_2d: DeviceMesh, gate_up: bool) -> nn.Parameter:
    """This rank's (expert block, intermediate slice) of w_gate_up [E, 2I, L] or w_down [E, L, I] as a DTensor on
    the (ep, etp) mesh: Shard(0) over ep; over etp, w_down is Shard(2) and w_gate_up keeps the gate rows and the up
    rows of its slice ([gate_t; up_t], i.e. _StridedShard(1, split_factor=2): DCP and full_tensor() see the global
    [gate; up] layout)."""
    ep, etp = mesh_2d.size(0), mesh_2d.size(1)
    j, t = mesh_2d.get_local_rank(0), mesh_2d.get_local_rank(1)
    E = param.shape[0]
    block = param.detach()[j * (E // ep) : (j + 1) * (E // ep)]
    if gate_up:
        Eb, two_I, L = block.shape
        I_loc = two_I // 2 // etp
        local = block.view(Eb, 2, two_I // 2, L)[:, :, t * I_loc : (t + 1) * I_loc].reshape(Eb, 2 * I_loc, L)
        placements = [Shard(0), _StridedShard(1, split_factor=2)]
    else:
        I_loc = block.shape[2] // etp
        local = block[:, :, t * I_loc : (t + 1) * I_loc]
        placements = [Shard(0), Shard(2)]
    dt = DTensor.from_local(local.clone(), mesh_2d, placements, run_check=False, shape=param.shape,
                            stride=param.stride())
    return nn.Parameter(dt, requires_grad=param.requires_grad)


def make_dispatcher(kind: str, ep_mesh: DeviceMesh, domain_groups: tuple | None = None,
                    send_order: SendOrder = "backend") -> Dispatcher:
    """"flat" -> FlatDispatcher(ep group); "hierarchical" -> HierarchicalDispatcher(*domain_groups)
    (domain_groups = (intra-domain group, cross-domain group), see Meshes.ep_domain_groups). send_order: how the
    flat dispatcher issues its transfers (moestack.parallel.comm.SendOrder)."""
    if kind == "flat":
        return FlatDispatcher(ep_mesh.get_group(), send_order)
    if kind in ("hierarchical", "hierarchical_dedup"):
        if domain_groups is None:
            raise ConfigError("plan.dispatcher: 'hierarchical' needs an EP domain size (ranks per fast domain)")
        if kind == "hierarchical_dedup":  # see moestack.parallel.dedup (needs apply_token_dedup afterwards)
            from moestack.parallel.dedup import DedupHierarchicalDispatcher

            return DedupHierarchicalDispatcher(*domain_groups)
        return HierarchicalDispatcher(*domain_groups)
    raise ConfigError(f"plan.dispatcher: unknown dispatcher {kind!r}; allowed: 'flat', 'hierarchical'")


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh, dispatcher: Dispatcher,
                          ep_etp_mesh: DeviceMesh | None = None) -> list[str]:
    """Shard the routed experts of every MoE under `model` over `ep_mesh` and install the dispatcher.

    ep_etp_mesh: the 2-D (ep, etp) expert mesh for expert tensor parallelism (etp > 1): each expert's intermediate
    dim is split over etp as well (`etp_local_forward`). Works on a whole model or a pipeline stage, before FSDP
    (FSDP then shards the local expert blocks over the expert-data-parallel mesh). Returns the names of the
    converted `experts` modules.
    """
    P = ep_mesh.size()
    etp = ep_etp_mesh.size(1) if ep_etp_mesh is not None else 1
    converted = []
    for name, module in model.named_modules():
        if not isinstance(module, MoE):
            continue
        experts = module.experts
        E = experts.w_gate_up.shape[0]
        if E % P:
            raise ConfigError(f"plan.ep: {P} does not divide the {E} routed experts of {name}; choose ep dividing {E}")
        if etp > 1:
            inter = experts.w_down.shape[2]
            if inter % etp:
                raise ConfigError(f"plan.etp: {etp} does not divide the expert intermediate size {inter} of {name}")
            experts.w_gate_up = _shard_experts_2d(experts.w_gate_up, ep_etp_mesh, gate_up=True)
            experts.w_down = _shard_experts_2d(experts.w_down, ep_etp_mesh, gate_up=False)
        else:
            experts.w_gate_up = _shard_dim0(experts.w_gate_up, ep_mesh)
            experts.w_down = _shard_dim0(experts.w_down, ep_mesh)
        experts.__class__ = ExpertParallelExperts
        experts.ep_dispatcher = dispatcher
        experts.ep_etp_group = ep_etp_mesh.get_group(1) if etp > 1 else None
        converted.append(f"{name}.experts")
    return converted


def domain_limited_routing(router: RouterSpec, ep: int, domain_size: int, max_domains: int) -> RouterSpec:
    """RouterSpec restricting each token's experts to at most `max_domains` EP domains (node-limited routing,
    DeepSeek-V3): group-limited routing with one expert group per domain. Experts are contiguous per rank and ranks
    contiguous per domain, so group g is exactly the experts of domain g. Use it in the model spec (it changes the
    routing math, so single- and multi-rank runs must both use it)."""
    if ep % domain_size:
        raise ConfigError(f"domain_size {domain_size} must divide ep ({ep})")
    n = ep // domain_size
    if not 1 <= max_domains <= n:
        raise ConfigError(f"max_domains must be in [1, {n}] (the number of EP domains), got {max_domains}")
    return router.model_copy(update={"num_groups": n, "topk_groups": max_domains})
