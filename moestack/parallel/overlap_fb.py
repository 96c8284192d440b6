"""DualPipeV's overlapped forward / backward (plan.ep_comm_overlap): one micro-batch's forward and another's
backward interleaved at the expert all-to-all, so that each one's communication runs under the other's compute.

torch's ScheduleDualPipeV emits OVERLAP_F_B actions (a FORWARD of one chunk paired with a FULL_BACKWARD of the
other) and runs their two sub-actions one after the other unless a function is registered for the action type;
`install(schedule)` registers `run_overlapped`. It runs the backward on a second thread and the forward on the
calling one, and the two take turns: exactly one of them runs at any time, and each hands over at the points the
EP dispatcher marks (`overlap_point`): before the dispatch, after it, before the combine, after it, and the
matching points of the backward. So each segment of one micro-batch ends right after it issued an all-to-all,
and the other's compute is issued while that transfer is in flight (on GPUs the all-to-all runs on its own
stream: kernels issued by the other thread overlap it).

Why strict turns and not two free threads (torchtitan's barrier pairs them): every collective of a rank (EP
all-to-alls, TP and FSDP collectives, router counts) is then issued in one deterministic order, the same on every
rank of every group, whatever the layer counts of the two chunks (a chunk that runs out of points runs to its end
alone); two free threads could issue collectives of one group in a different order on two ranks. The numbers are
those of running the two sub-actions one after the other (each micro-batch's math is unchanged, and gradients of
one chunk accumulate in the same order), which the gloo test checks bitwise and against one process in float64.

Roles come from the autograd context, not the thread: on CUDA the autograd engine runs a backward on its device
thread; a forward that runs inside a backward (activation recompute) is the backward's.
"""

from __future__ import annotations

import threading

import torch

_ACTIVE: list[_Turns] = []  # the coordinator of the OVERLAP_F_B action running now (at most one)
STATS = {"actions": 0, "handovers": 0}  # process totals (tests check that the roles really alternated)


class _Turns:
    """Two roles, "F" and "B", that run one at a time and hand over at every overlap point."""

    def __init__(self):
        self.cond = threading.Condition()
        self.turn = "F"
        self.running = {"F", "B"}

    def wait_turn(self, role: str) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.turn == role or self.turn is None)

    def hand_over(self, role: str) -> None:
        other = "B" if role == "F" else "F"
        with self.cond:
            if other not in self.running:
                return  # the other role is done: keep going
            STATS["handovers"] += 1
            self.turn = other
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.turn == role)

    def finish(self, role: str) -> None:
        other = "B" if role == "F" else "F"
        with self.cond:
            self.running.discard(role)
            self.turn = other if other in self.running else None
            self.cond.notify_all()


def _role() -> str:
    return "B" if torch._C._current_autograd_node() is not None else "F"


class _Point(torch.autograd.Function):
    """Identity; forward and backward hand the turn over while an overlapped action runs."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        if _ACTIVE:
            _ACTIVE[0].hand_over(_role())
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        if _ACTIVE:
            _ACTIVE[0].hand_over("B")
        return grad


def overlap_point(x: torch.Tensor) -> torch.Tensor:
    """Mark a hand-over point around an all-to-all (identity; free outside an overlapped action)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _Point.apply(x)
    if _ACTIVE:
        _ACTIVE[0].hand_over(_role())
    return x


def run_overlapped(action, ctx) -> None:
    """The OVERLAP_F_B custom function: `action.sub_actions` = (FORWARD of one chunk, FULL_BACKWARD of another),
    run as two alternating roles (module docstring). Receives, loss, counters and the V-shape local hand-offs as
    torch's runtime does for each sub-action."""
    from torch.distributed.pipelining.schedules import _wait_batch_p2p

    schedule = ctx.schedule_ref
    stages = {stage.stage_index: stage for stage in schedule._stages}
    fwd, bwd = action.sub_actions
    f_stage, b_stage = stages[fwd.stage_index], stages[bwd.stage_index]
    f_mb, b_mb = fwd.microbatch_index, bwd.microbatch_index

    # the inputs both need, before either starts (p2p is not part of the turns)
    if not f_stage.is_first and fwd.stage_index - 1 not in stages:
        _wait_batch_p2p(schedule.fwd_recv_ops.pop((fwd.stage_index, f_mb)))
    if not b_stage.is_last and bwd.stage_index + 1 not in stages:
        _wait_batch_p2p(schedule.bwd_recv_ops.pop((bwd.stage_index, b_mb)))
    schedule._assert_unsharded(f_stage)
    schedule._assert_unsharded(b_stage)

    STATS["actions"] += 1
    turns = _Turns()
    errors: list[BaseException] = []

    def backward() -> None:
        try:
            turns.wait_turn("B")
            loss = schedule._maybe_get_loss(b_stage, b_mb)
            schedule.backward_counter[bwd.stage_index] += 1
            last = schedule.backward_counter[bwd.stage_index] == schedule._n_microbatches
            b_stage.backward_one_chunk(b_mb, loss=loss, full_backward=True, last_backward=last)
            if bwd.stage_index - 1 in stages:
                stages[bwd.stage_index - 1].set_local_bwd_input(b_stage.get_local_bwd_output(b_mb), b_mb)
        except BaseException as err:  # noqa: BLE001 - re-raised on the calling thread
            errors.append(err)
        finally:
            turns.finish("B")

    _ACTIVE.append(turns)
    worker = threading.Thread(target=backward, name="overlap_fb.backward", daemon=True)
    worker.start()
    try:
        output = f_stage.forward_one_chunk(f_mb, ctx.arg_mbs[f_mb], ctx.kwarg_mbs[f_mb])
        schedule._maybe_compute_loss(f_stage, output, ctx.target_mbs, f_mb)
        if fwd.stage_index + 1 in stages:
            stages[fwd.stage_index + 1].set_local_fwd_input(output, f_mb)
    finally:
        turns.finish("F")
        worker.join()
        _ACTIVE.clear()
    if errors:
        raise errors[0]


def install(schedule) -> None:
    """Register `run_overlapped` for the schedule's OVERLAP_F_B actions (torch's _PipelineScheduleRuntime)."""
    from torch.distributed.pipelining.schedules import _ComputationType

    schedule.register_custom_function(_ComputationType.OVERLAP_F_B, run_overlapped)
