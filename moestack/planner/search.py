"""Plan search: enumerate valid plans, drop those that do not fit, rank the rest by predicted time per token.

Enumeration, outermost first (every level honours `--fix` values):
  layout     tp (within the innermost network domain, dividing heads), cp (seq_len / cp >= 4096), pp (divides the
             rest, <= layers), dp = devices / (tp cp pp), ep (divides experts and devices / pp), etp in {1, tp}
  batching   micro-batch size in {1, 2, 4} with enough micro-batches to fill the pipeline
  schedule   1f1b; interleaved_1f1b with vpp in {2, 4, 8}; zbv; dualpipev (gpipe only through --fix)
  sharding   ZeRO-1 or ZeRO-3 (FSDP2) over the data-parallel group (ZeRO-0 / 2 only through --fix)
  memory     a ladder from fast to frugal: recompute none -> selective -> (dense MLP full) -> (MoE full) -> full,
             each with offload none -> optimizer -> +activations (-> +experts on one device); the first two rungs
             that fit are evaluated, cheaper-to-reject rungs are skipped by a quick memory bound
Plans the trainer would refuse (moestack/config/support.py: e.g. Muon with optimizer offload, cp with pp) are
skipped, so every plan printed launches (`moestack train --plan plan.yaml --dry-run` checks one at full size).
The dispatcher is hierarchical when the EP group spans more than one innermost domain, else flat.
Precision and optimizer are the user's choice (they change the training recipe), never searched.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import get_args

from moestack.config.base import ConfigError
from moestack.config.cluster import ClusterSpec, load_cluster_spec
from moestack.config.model_spec import ModelSpec
from moestack.config.plan import HostProfileName, OffloadPolicy, Plan, Precision, RecomputePolicy
from moestack.config.support import EP_OVERLAP_SCHEDULES, unsupported
from moestack.planner.calibration import Calibration, load_calibration
from moestack.planner.cost.comm import group_members_per_domain
from moestack.planner.cost.compute import GEMM_RECIPES
from moestack.planner.cost.step import CostModel, PlanCost
from moestack.planner.host_profile import check_host_profile
from moestack.planner.profile import load_any_model_spec, profile_model

# default tokens per step: 16M (Llama 3 405B / DeepSeek-V3 pre-training scale), at most 64 sequences per device
DEFAULT_GLOBAL_BATCH_TOKENS = 16 * 2**20
DEFAULT_SEQS_PER_DEVICE = 64
DEFAULT_MARGIN = 0.05  # keep 5% of HBM free for fragmentation
# moestack's TP collectives run on the compute stream (parallel/tensor.py): the search does not credit an overlap the
# trainer does not do (published runs that overlap say `--fix tp_overlap=true`)
TP_OVERLAP_DEFAULT = False
DEFAULT_IMBALANCE = Plan.model_fields["moe_load_imbalance"].default

FIX_KEYS = {
    "tp", "pp", "vpp", "ep", "etp", "cp", "dp", "dp_shard", "dp_replicate", "zero", "mbs", "gbs", "schedule",
    "recompute", "offload", "precision", "optimizer", "dispatcher", "tp_overlap", "ep_overlap", "ep_dispatch",
    "sp", "grad_dtype", "quantized_params", "imbalance", "pp_split", "fp8_act_input",
}
INT_KEYS = {"tp", "pp", "vpp", "ep", "etp", "cp", "dp", "dp_shard", "dp_replicate", "zero", "mbs", "gbs"}
BOOL_KEYS = {"tp_overlap", "ep_overlap", "sp", "quantized_params", "fp8_act_input"}
FLOAT_KEYS = {"imbalance"}
PARTS = ("kda", "attention", "moe", "mlp")


def parse_recompute(text: str) -> RecomputePolicy:
    """'none' | 'selective' | 'full' for every part, or per part: 'attention:selective+mlp:full' (others none)."""
    text = text.strip()
    if text in ("none", "selective", "full"):
        return RecomputePolicy.uniform(text)
    fields = {}
    for item in text.split("+"):
        part, _, mode = item.partition(":")
        if part not in PARTS or mode not in ("none", "selective", "full"):
            raise ConfigError(
                f"fix: recompute: '{item}' is not PART:MODE (parts {', '.join(PARTS)}; modes none/selective/full)"
            )
        fields[part] = mode
    return RecomputePolicy(**fields)


def parse_offload(text: str) -> OffloadPolicy:
    """'none' or a '+'-joined subset of optimizer, experts, activations."""
    if text.strip() == "none":
        return OffloadPolicy()
    items = text.split("+")
    bad = [i for i in items if i not in ("optimizer", "experts", "activations")]
    if bad:
        raise ConfigError(f"fix: offload: unknown item(s) {bad}; use optimizer, experts, activations or none")
    return OffloadPolicy(**{i: True for i in items})


def parse_fix(text: str | None) -> dict:
    """`tp=2,pp=8,vpp=4,ep=64,recompute=attention:selective+mlp:full` -> typed dict (one-line ConfigError)."""
    out: dict = {}
    if not text:
        return out
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, val = item.partition("=")
        key = key.strip()
        if not sep or key not in FIX_KEYS:
            raise ConfigError(f"fix: '{item}' is not KEY=VALUE with KEY in {', '.join(sorted(FIX_KEYS))}")
        val = val.strip()
        if key in INT_KEYS:
            try:
                out[key] = int(val)
            except ValueError:
                raise ConfigError(f"fix: {key} must be an integer (got {val!r})") from None
            if out[key] < (0 if key == "zero" else 1):
                raise ConfigError(f"fix: {key} must be positive (got {val})")
        elif key in FLOAT_KEYS:
            try:
                out[key] = float(val)
            except ValueError:
                raise ConfigError(f"fix: {key} must be a number (got {val!r})") from None
        elif key in BOOL_KEYS:
            if val.lower() not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise ConfigError(f"fix: {key} must be true/false (got {val!r})")
            out[key] = val.lower() in ("1", "true", "yes", "on")
        elif key == "recompute":
            out[key] = parse_recompute(val)
        elif key == "offload":
            out[key] = parse_offload(val)
        elif key == "ep_dispatch" and val not in ("bf16", "fp8"):
            raise ConfigError(f"fix: ep_dispatch must be bf16 or fp8 (got {val!r})")
        else:
            out[key] = val
    return out


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _pow2_upto(n: int) -> list[int]:
    out, x = [], 1
    while x <= n:
        out.append(x)
        x *= 2
    return out


@dataclass
class Problem:
    """A model, a cluster and the fixed training shape the search works within."""

    model: str
    cluster_name: str
    spec: ModelSpec
    cluster: ClusterSpec
    cal: Calibration
    seq_len: int
    global_batch_tokens: int
    precision: str = "bf16"
    optimizer: str = "adamw"
    margin: float = DEFAULT_MARGIN
    host_profile: str = "eager"  # Plan.host_profile: whose host launches the kernels (planner/host_profile.py)
    cost: CostModel = field(init=False)

    def __post_init__(self) -> None:
        recipe = GEMM_RECIPES.get(self.precision)
        if recipe is not None and recipe.dtype not in self.cluster.device.peak_tflops:
            raise ConfigError(f"precision: {self.cluster.device.name} has no {recipe.dtype} units for "
                              f"{self.precision}; use bf16")
        prof = profile_model(self.spec, self.seq_len)
        self.profile = prof
        flops = prof.train_flops_per_token + prof.mtp_train_flops_per_token
        self.cost = CostModel(self.spec, self.cluster, self.cal, self.seq_len, flops)


def load_problem(model: str, cluster: str, devices: int | None = None, seq_len: int | None = None,
                 global_batch_tokens: int | None = None, calibration: str | Path | None = None,
                 precision: str = "bf16", optimizer: str = "adamw", margin: float = DEFAULT_MARGIN,
                 host_profile: str = "eager") -> Problem:
    """Resolve names (presets, YAML, HF config.json) into a Problem."""
    spec = load_any_model_spec(model)
    cl = load_cluster_spec(cluster)
    if devices is not None:
        cl = cl.with_devices(devices)
    seq = seq_len if seq_len is not None else min(spec.max_seq_len, 4096)
    if seq < 2:
        raise ConfigError(f"--seq-len: must be >= 2 tokens per sequence (got {seq}); leave it out for "
                          f"{min(spec.max_seq_len, 4096)}")
    if seq > spec.max_seq_len:
        raise ConfigError(f"--seq-len: {seq} exceeds the model's max_seq_len {spec.max_seq_len}; lower it")
    if global_batch_tokens is not None and global_batch_tokens < seq:
        raise ConfigError(f"--global-batch-tokens: {global_batch_tokens} is less than one sequence ({seq} tokens); "
                          "give tokens per optimizer step, e.g. 16777216")
    tokens = global_batch_tokens or min(DEFAULT_GLOBAL_BATCH_TOKENS, DEFAULT_SEQS_PER_DEVICE * cl.num_devices * seq)
    if precision not in get_args(Precision):
        raise ConfigError(f"precision: must be one of {', '.join(get_args(Precision))} (got {precision!r})")
    if host_profile not in get_args(HostProfileName):
        raise ConfigError(f"host-profile: must be one of {', '.join(get_args(HostProfileName))} (got {host_profile!r})")
    if optimizer not in ("adamw", "adamw_bf16", "muon"):
        raise ConfigError(f"optimizer: must be adamw, adamw_bf16 or muon (got {optimizer!r})")
    cal = load_calibration(calibration)
    check_host_profile(host_profile, cal)
    return Problem(model, cluster, spec, cl, cal, seq, tokens, precision, optimizer, margin, host_profile)


@dataclass
class SearchResult:
    ranked: list[PlanCost]  # plans that fit, fastest (time per token) first
    rejected: Counter  # reason -> count
    evaluated: int
    elapsed_s: float
    closest: PlanCost | None  # least-memory plan seen when nothing fits (what it would need)
    problem: Problem

    @property
    def best(self) -> PlanCost | None:
        return self.ranked[0] if self.ranked else None


def _recompute_ladder(spec: ModelSpec) -> list[RecomputePolicy]:
    kinds = spec.layer_kinds()
    has_dense = any(k.ffn == "dense" for k in kinds)
    has_moe = any(k.ffn == "moe" for k in kinds)
    sel = RecomputePolicy.uniform("selective")
    ladder = [RecomputePolicy.uniform("none"), sel]
    if has_dense:
        ladder.append(sel.model_copy(update={"mlp": "full"}))  # Megatron recompute_modules=["mlp"]
    if has_moe:
        ladder.append(sel.model_copy(update={"mlp": "full", "moe": "full"}))
    ladder.append(RecomputePolicy.uniform("full"))
    return ladder


def _offload_ladder(spec: ModelSpec, cluster: ClusterSpec) -> list[OffloadPolicy]:
    if cluster.device.host_memory_gib <= 0 or cluster.device.host_link_gb_s <= 0:
        return [OffloadPolicy()]
    ladder = [OffloadPolicy(), OffloadPolicy(optimizer=True), OffloadPolicy(optimizer=True, activations=True)]
    if spec.moe is not None and cluster.num_devices == 1:  # the trainer offloads experts on one device only
        ladder += [OffloadPolicy(optimizer=True, experts=True),
                   OffloadPolicy(optimizer=True, experts=True, activations=True)]
    return ladder


def _tp_ok(spec: ModelSpec, tp: int) -> bool:
    if spec.hidden_size % tp:
        return False
    heads = []
    if spec.mla is not None:
        heads.append(spec.mla.num_heads)
    if spec.gqa is not None:
        heads.append(spec.gqa.num_heads)
        kv = spec.gqa.num_kv_heads
        if kv % tp and tp % kv:
            return False
    if spec.kda is not None:
        heads.append(spec.kda.num_heads)
    if spec.mamba2 is not None:
        heads.append(spec.mamba2.num_heads)
    return all(h % tp == 0 for h in heads)


class Planner:
    """Enumerates and ranks plans for one Problem."""

    def __init__(self, problem: Problem):
        self.pb = problem
        self.n_layers = len(problem.cost.work.layers)

    # -- enumeration ------------------------------------------------------------------------------------------
    def layouts(self, fix: dict):
        """(tp, cp, pp, dp, ep, etp) tuples allowed by the model, the cluster and `fix`."""
        pb, N = self.pb, self.pb.cluster.num_devices
        spec = pb.spec
        inner = pb.cluster.tier_domain(0) if pb.cluster.tiers else 1
        tps = [fix["tp"]] if "tp" in fix else [t for t in _pow2_upto(min(inner, 16)) if N % t == 0]
        for tp in tps:
            if not _tp_ok(spec, tp):
                continue
            cps = [fix["cp"]] if "cp" in fix else [c for c in _pow2_upto(max(1, pb.seq_len // 4096))]
            for cp in cps:
                if N % (tp * cp):
                    continue
                rest = N // (tp * cp)
                pps = [fix["pp"]] if "pp" in fix else [p for p in _divisors(rest) if p <= min(self.n_layers, 64)]
                for pp in pps:
                    if rest % pp:
                        continue
                    dp = rest // pp
                    if "dp" in fix and fix["dp"] != dp:
                        continue
                    yield from self._expert_layouts(fix, tp, cp, pp, dp)

    def _expert_layouts(self, fix: dict, tp: int, cp: int, pp: int, dp: int):
        spec, N = self.pb.spec, self.pb.cluster.num_devices
        if spec.moe is None:
            yield (tp, cp, pp, dp, 1, 1)
            return
        per_stage = N // pp
        etps = [fix["etp"]] if "etp" in fix else sorted({1, tp})
        for etp in etps:
            if per_stage % etp:
                continue
            if "ep" in fix:
                eps = [fix["ep"]]
            else:
                g = math.gcd(spec.moe.num_experts, per_stage // etp)
                eps = _divisors(g)
            for ep in eps:
                if per_stage % (ep * etp) == 0 and spec.moe.num_experts % ep == 0:
                    yield (tp, cp, pp, dp, ep, etp)

    def schedules(self, fix: dict, pp: int, m: int):
        if pp == 1:
            opts = [("1f1b", 1)]
        elif "schedule" in fix and fix["schedule"] == "gpipe":
            opts = [("gpipe", 1)]
        else:
            opts = [("1f1b", 1)]
            for v in (2, 4, 8):
                if pp * v <= self.n_layers and m % pp == 0:
                    opts.append(("interleaved_1f1b", v))
            if 2 * pp <= self.n_layers:
                opts.append(("zbv", 2))
                if m >= 2 * pp:
                    opts.append(("dualpipev", 2))
        if "schedule" in fix:
            opts = [o for o in opts if o[0] == fix["schedule"]]
        if "vpp" in fix:
            opts = [o for o in opts if o[1] == fix["vpp"]]
            if not opts and "schedule" in fix and pp * fix["vpp"] <= self.n_layers:
                opts = [(fix["schedule"], fix["vpp"])]
        return opts

    def _gbs(self, fix: dict, dp: int) -> int:
        if "gbs" in fix:
            return fix["gbs"]
        seqs = max(1, round(self.pb.global_batch_tokens / self.pb.seq_len))
        return max(dp, -(-seqs // dp) * dp)

    def _dispatcher(self, fix: dict, ep: int, etp: int) -> str:
        if "dispatcher" in fix:
            return fix["dispatcher"]
        cl = self.pb.cluster
        if ep > 1 and cl.tiers and group_members_per_domain(cl, ep, etp, 0) < ep:
            return "hierarchical"
        return "flat"

    # -- search -----------------------------------------------------------------------------------------------
    def search(self, fix: dict | None = None, max_fits_per_shape: int = 2, require_fit: bool = True) -> SearchResult:
        """Evaluate the space (restricted by `fix`) and rank plans that fit by time per token. With
        require_fit=False (used by --fix) plans over the memory limit are ranked too when none fits."""
        fix = dict(fix or {})
        pb = self.pb
        t0 = time.perf_counter()
        rejected: Counter = Counter()
        fits: list[PlanCost] = []
        unfit: list[PlanCost] = []
        lowest: tuple[float, Plan] | None = None  # least-memory plan by the quick bound (for "closest")
        closest: PlanCost | None = None
        evaluated = 0
        rc_ladder = [fix["recompute"]] if "recompute" in fix else _recompute_ladder(pb.spec)
        off_ladder = [fix["offload"]] if "offload" in fix else _offload_ladder(pb.spec, pb.cluster)
        hbm_cap = pb.cluster.device.hbm_bytes * (1 - pb.margin)
        layouts = list(self.layouts(fix))
        if not layouts:
            keys = ",".join(f"{k}={fix[k]}" for k in ("tp", "cp", "pp", "dp", "ep", "etp") if k in fix)
            raise ConfigError(
                f"fix: no layout of {pb.cluster.num_devices} devices matches {keys or 'the model'} (tp must divide the"
                " devices, hidden size and heads and stay inside one innermost domain; tp*cp*pp*dp = devices; ep must"
                " divide the experts and devices/pp)"
            )
        for tp, cp, pp, dp, ep, etp in layouts:
            gbs = self._gbs(fix, dp)
            # micro-batches beyond 4096 tokens per device gain little GEMM efficiency and cost bubble + memory
            mbss = [fix["mbs"]] if "mbs" in fix else [b for b in (1, 2, 4, 8) if b == 1 or b * pb.seq_len / cp <= 8192]
            for mbs in mbss:
                if gbs % (mbs * dp):
                    rejected["batch not divisible by mbs*dp"] += 1
                    continue
                m = gbs // (mbs * dp)
                if pp > 1 and m < pp:
                    rejected["too few micro-batches for pp"] += 1
                    continue
                zeros = [fix["zero"]] if "zero" in fix else ([1, 3] if dp > 1 else [0])
                for schedule, vpp in self.schedules(fix, pp, m):
                    lightest = None  # (recompute, offload) rung where the previous ZeRO stage first fit
                    for zero in zeros:
                        if zero == 3 and lightest == 0:
                            rejected["ZeRO-3 not needed (ZeRO-1 fits without recompute/offload)"] += 1
                            continue
                        shard, repl = self._dp_split(fix, dp, zero)
                        base = dict(
                            model=pb.model, cluster=pb.cluster_name, devices=pb.cluster.num_devices,
                            seq_len=pb.seq_len, micro_batch_size=mbs, global_batch_size=gbs, pp=pp, vpp=vpp,
                            dp_replicate=repl, dp_shard=shard, zero_stage=zero, tp=tp, cp=cp, ep=ep, etp=etp,
                            schedule=schedule, precision=fix.get("precision", pb.precision),
                            optimizer=fix.get("optimizer", pb.optimizer), dispatcher=self._dispatcher(fix, ep, etp),
                            tp_comm_overlap=fix.get("tp_overlap", TP_OVERLAP_DEFAULT),
                            ep_dispatch_dtype=fix.get("ep_dispatch", "bf16"),
                            ep_comm_overlap=fix.get("ep_overlap", schedule in EP_OVERLAP_SCHEDULES and ep * etp > 1),
                            sequence_parallel=fix.get("sp", True), grad_dtype=fix.get("grad_dtype", "fp32"),
                            pipeline_split=fix.get("pp_split", "balanced"),
                            quantized_params=fix.get("quantized_params", False),
                            fp8_activation_input=fix.get("fp8_act_input", False),
                            moe_load_imbalance=fix.get("imbalance", DEFAULT_IMBALANCE),
                            host_profile=pb.host_profile,
                        )
                        found = 0
                        for rung, rc in enumerate(rc_ladder):
                            if found >= max_fits_per_shape:
                                break
                            for off in off_ladder:
                                try:
                                    plan = Plan(**base, recompute=rc, offload=off)
                                except ValueError as err:  # pydantic ValidationError: the Plan's own rules
                                    rejected[_reason(err)] += 1
                                    break
                                why = unsupported(plan)
                                if why is not None and require_fit:  # the trainer would refuse it (support.py)
                                    rejected["not run by the trainer: " + why.split(":")[0]] += 1
                                    continue
                                if require_fit:
                                    lo_hbm, lo_host = pb.cost.memory_lower_bound(plan)
                                    if lowest is None or lo_hbm < lowest[0]:
                                        lowest = (lo_hbm, plan)
                                    if lo_host > pb.cluster.device.host_memory_bytes:
                                        rejected["host memory"] += 1
                                        continue
                                    if lo_hbm > hbm_cap:
                                        rejected["HBM"] += 1
                                        continue
                                cost = pb.cost.evaluate(plan)
                                evaluated += 1
                                if why is not None:  # --fix evaluates it anyway (e.g. a published run's layout)
                                    cost.notes.append(f"moestack train refuses this plan: {why}")
                                if closest is None or cost.memory_total < closest.memory_total:
                                    closest = cost
                                if cost.host_bytes > cost.host_capacity or cost.memory_total > hbm_cap:
                                    rejected["host memory" if cost.host_bytes > cost.host_capacity else "HBM"] += 1
                                    if not require_fit:
                                        unfit.append(cost)
                                    continue
                                fits.append(cost)
                                found += 1
                                if lightest is None:
                                    lightest = rung + off_ladder.index(off)
                                if rc.short() == "none" and off.short() == "none":
                                    found = max_fits_per_shape  # nothing on the ladder is faster than this rung
                                break
        key = lambda c: (c.step_time_s / c.plan.tokens_per_step, c.memory_total)  # noqa: E731
        fits.sort(key=key)
        if not fits and not require_fit:
            fits = sorted(unfit, key=key)
        if not fits and lowest is not None and (closest is None or lowest[0] < closest.memory_total):
            closest = pb.cost.evaluate(lowest[1])
        return SearchResult(fits, rejected, evaluated, time.perf_counter() - t0, closest, pb)

    def _dp_split(self, fix: dict, dp: int, zero: int) -> tuple[int, int]:
        """(dp_shard, dp_replicate): ZeRO shards over the whole DP group unless --fix says otherwise."""
        if zero == 0:
            return 1, dp
        shard = fix.get("dp_shard", dp // fix["dp_replicate"] if "dp_replicate" in fix else dp)
        return shard, dp // shard if shard and dp % shard == 0 else dp


def _reason(err: Exception) -> str:
    msg = str(err)
    for key, reason in (("global_batch_size", "batch not divisible"), ("micro-batches", "too few micro-batches"),
                        ("vpp", "schedule/vpp"), ("zero_stage", "ZeRO layout"), ("ep*etp", "EP layout"),
                        ("seq_len", "sequence split"), ("interleaved", "schedule/vpp")):
        if key in msg:
            return reason
    return "invalid plan"


def evaluate_fixed(problem: Problem, fix: dict) -> SearchResult:
    """`--fix`: evaluate the plan the fixed degrees describe (unfixed choices are searched, fastest wins)."""
    return Planner(problem).search(fix, require_fit=False)
