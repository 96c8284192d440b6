"""`moestack adapt` (scale a model down to a proxy that fits a device) and `moestack convert` (HF safetensors <->
moestack checkpoints). Typer-annotated functions; moestack/cli.py registers them."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from moestack.config.base import ConfigError
from moestack.config.model_spec import ModelSpec
from moestack.planner.profile_cli import _bytes, _n

# ---------------------------------------------------------------------------------------------- adapt


def _layers(spec: ModelSpec) -> str:
    kinds = spec.layer_kinds()
    counts: dict[str, int] = {}
    for k in kinds:
        counts[k.mixer.upper()] = counts.get(k.mixer.upper(), 0) + 1
    return f"{len(kinds)}: " + " + ".join(f"{n} {m}" for m, n in counts.items())


def _shape_rows(spec: ModelSpec) -> dict[str, str]:
    rows = {"layers": _layers(spec), "hidden": str(spec.hidden_size), "vocab": str(spec.vocab_size)}
    dense = [k.ffn for k in spec.layer_kinds()].count("dense")
    if spec.moe is not None:
        rows["dense-FFN layers"] = str(dense)
    if spec.kda is not None:
        k = spec.kda
        v = f" ({k.value_heads} value)" if k.value_heads != k.num_heads else ""
        rows["KDA heads x dim"] = f"{k.num_heads}{v} x {k.head_dim}"
    if spec.mla is not None:
        m = spec.mla
        rows["MLA heads"] = str(m.num_heads)
        rows["MLA q/kv lora, nope/rope/v"] = (
            f"{m.q_lora_rank}/{m.kv_lora_rank}, {m.qk_nope_head_dim}/{m.qk_rope_head_dim}/{m.v_head_dim}"
        )
        if m.indexer is not None:
            ix = m.indexer
            rows["indexer heads x dim, top-k"] = f"{ix.num_heads} x {ix.head_dim}, {ix.top_k}"
    if spec.gqa is not None:
        g = spec.gqa
        rows["GQA heads / kv heads x dim"] = f"{g.num_heads} / {g.num_kv_heads} x {spec.gqa_head_dim}"
    if spec.moe is not None:
        mo = spec.moe
        rows["experts / top-k"] = f"{mo.num_experts} / {mo.top_k} (x{mo.num_experts / mo.top_k:g})"
        rows["latent / expert inter"] = f"{mo.latent_size or '-'} / {mo.expert_intermediate_size}"
        rows["shared experts (width)"] = f"{mo.num_shared_experts} ({mo.shared_intermediate_size})"
    if spec.dense_mlp is not None and dense:
        rows["dense inter"] = str(spec.dense_mlp.intermediate_size)
    return rows


def render_adapt(result, console: Console) -> None:
    """Before / after side by side: shapes, profile totals, training memory against the budget."""
    from moestack.planner.adapt import GIB, training_memory

    src, dst = result.source, result.spec
    ps, pd = result.source_profile, result.profile
    table = Table(
        title=f"adapt {src.name} -> {dst.name} (fit {result.target.name}: {result.target.memory_bytes / GIB:.1f} "
        f"GiB, AdamW, {result.batch} x {result.seq_len} tokens, {result.precision})",
        title_justify="left",
    )
    for col in ("", src.name, dst.name):
        table.add_column(col, justify="left" if not col else "right")
    before, after = _shape_rows(src), _shape_rows(dst)
    for key in before:
        table.add_row(key, before[key], after.get(key, "-"))
    table.add_row("layer pattern", "", result.pattern)
    src_mem = training_memory(src, result.seq_len, result.batch, result.act_factor, result.target.reserved_bytes, ps)
    act_s = sum(lp.act_bytes_per_token for lp in ps.layers) + ps.head_act_bytes_per_token
    act_d = sum(lp.act_bytes_per_token for lp in pd.layers) + pd.head_act_bytes_per_token
    table.add_row("total params", _n(ps.total_params), _n(pd.total_params))
    table.add_row("activated params / token", _n(ps.activated_params), _n(pd.activated_params))
    table.add_row("train FLOPs / token", _n(ps.train_flops_per_token), _n(pd.train_flops_per_token))
    table.add_row("activations / token (profile, bf16)", _bytes(act_s), _bytes(act_d))
    table.add_row("training memory (estimate)", _bytes(sum(src_mem.values())), _bytes(result.memory_total))
    console.print(table)
    parts = ", ".join(f"{k} {_bytes(v)}" for k, v in result.memory.items())
    console.print(
        f"proxy memory: {parts} = {_bytes(result.memory_total)} of {_bytes(result.usable_bytes)} usable "
        f"(activations x{result.act_factor:g} over the profile)",
        highlight=False,
    )
    for note in result.notes:
        console.print(f"note: {note}", highlight=False)


def adapt(
    model: Annotated[str, typer.Argument(help="preset name, moestack ModelSpec YAML, or HF config.json")],
    fit: Annotated[str, typer.Option("--fit", help="device (h200, h100, a100-80g, b200, cpu-8g, ...) or memory "
                                                   "(141GB, 8GiB)")],
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="write the proxy ModelSpec YAML here")] = None,
    seq_len: Annotated[Optional[int], typer.Option("--seq-len", help="tokens per sequence the budget must hold "
                                                                     "(default 4096 GPU, 512 CPU)")] = None,
    batch: Annotated[Optional[int], typer.Option("--batch", "-b", help="sequences per micro-batch "
                                                                       "(default 2)")] = None,
    precision: Annotated[str, typer.Option(help="auto | bf16 | fp32 (auto: fp32 on cpu-*, else bf16)")] = "auto",
    act_factor: Annotated[Optional[float], typer.Option("--act-factor", help="activation bytes x this over the "
                                                        "profile (default 3 bf16, 8 fp32)")] = None,
    margin: Annotated[float, typer.Option(help="fraction of the memory kept free")] = 0.10,
    top_k: Annotated[Optional[int], typer.Option("--top-k", help="proxy top-k (experts keep the source's "
                                                                 "experts/top-k)")] = None,
    name: Annotated[Optional[str], typer.Option(help="name of the proxy (default <model>-fit-<device>)")] = None,
) -> None:
    """Scale a model down to a proxy of the same family that trains on one device; print both side by side."""
    from moestack.planner.adapt import adapt_model, parse_fit, spec_to_yaml
    from moestack.planner.profile import load_any_model_spec

    if precision not in ("auto", "bf16", "fp32"):
        raise ConfigError(f"--precision: must be auto, bf16 or fp32, got '{precision}'")
    spec = load_any_model_spec(model)
    result = adapt_model(spec, parse_fit(fit), seq_len, batch, precision, act_factor, margin, top_k, name)
    console = Console()
    render_adapt(result, console)
    text = spec_to_yaml(result)
    if out is None:
        console.print(text, highlight=False, markup=False)
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        console.print(f"wrote {out} (moestack train --model {out})", highlight=False)
