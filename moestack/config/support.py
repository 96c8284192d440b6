"""What the runtime can run: the one list of plan combinations `moestack train` refuses, read by both sides.

`unsupported(plan)` returns one line naming the field and the fix, or None. The runtime raises it before building
anything (moestack.parallel.mesh.check_supported); the planner's search skips such plans (moestack/planner/search.py),
so every plan it prints is one the trainer launches. Shape rules that any layout must meet (degrees dividing the
devices, batch divisibility) are the Plan's own validator; this list is about features not built (yet).
"""

from __future__ import annotations

from moestack.config.plan import Plan, runtime_unsupported

# schedules whose runtime overlaps the expert all-to-all with another micro-batch's compute (plan.ep_comm_overlap):
# torch's DualPipeV emits OVERLAP_F_B actions, moestack.parallel.overlap_fb runs them (the other schedules run
# each forward and backward on its own, so there is nothing to overlap with)
EP_OVERLAP_SCHEDULES = ("dualpipev",)


def unsupported(plan: Plan) -> str | None:
    """Why the runtime cannot run `plan` (one line: field, value, fix), or None. Includes the planner inputs of
    other frameworks' runs (`runtime_unsupported`: precisions, TP without SP, Megatron's TP overlap, ...)."""
    other = runtime_unsupported(plan)
    if other:
        return f"plan: the trainer cannot run {'; '.join(other)}"
    if plan.cp > 1 and plan.pp > 1:
        return (f"plan.cp: context parallelism ({plan.cp}) with pipeline stages (pp {plan.pp}) is not implemented; "
                "use pp 1")
    if plan.cp > 1 and plan.recompute.kda != "none" and plan.cp_kda == "relay":
        return (f"plan.recompute.kda: '{plan.recompute.kda}' cannot recompute a KDA layer under the context parallel "
                "state relay (it would deadlock); use 'none' or plan.cp_kda 'scan'")
    if plan.offload.experts and plan.devices > 1:
        return ("plan.offload.experts: expert offload with more than one device is not supported (FSDP / EP would "
                "have to leave the host-resident expert weights alone); turn it off or use one device")
    if plan.optimizer == "muon" and plan.offload.optimizer:
        return ("plan.offload.optimizer: muon with optimizer offload is not supported (Newton-Schulz on the CPU is "
                "too slow); use adamw / adamw_bf16 with offload, or muon without it")
    if plan.ep_comm_overlap and plan.schedule not in EP_OVERLAP_SCHEDULES:
        return ("plan.ep_comm_overlap: the expert all-to-all is overlapped only under "
                f"{', '.join(EP_OVERLAP_SCHEDULES)} (schedule is {plan.schedule}); set it false or use schedule "
                "dualpipev")
    if plan.ep_comm_overlap and plan.ep * plan.etp == 1:
        return "plan.ep_comm_overlap: there is no expert all-to-all to overlap (ep 1, etp 1); set it false"
    if plan.ep_send_order != "backend" and plan.dispatcher != "flat":
        return (f"plan.ep_send_order: '{plan.ep_send_order}' orders the flat dispatcher's transfers; the "
                f"{plan.dispatcher} dispatcher ignores it: use 'backend' or dispatcher 'flat'")
    if plan.ep_dispatch_dtype != "bf16":
        return ("plan.ep_dispatch_dtype: moestack's EP dispatcher sends bf16 rows (fp8 dispatch, quantised before the "
                "all-to-all as DeepEP does, is not built); use bf16")
    if plan.ep_token_dedup and plan.dispatcher != "hierarchical":
        return "plan.ep_token_dedup: token dedup is a hierarchical-dispatcher feature; set dispatcher 'hierarchical'"
    return None
