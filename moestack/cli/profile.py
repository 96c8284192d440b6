"""`moestack profile MODEL [--seq-len S] [--json]`: the exact architecture profile as a table or one JSON object."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from moestack.config.base import ConfigError
from moestack.planner.profile import ArchProfile, load_any_model, profile_model


def _n(x: float) -> str:
    """Human count: 2.78T, 104.2B, 443.7M, 12.3K."""
    for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= div:
            return f"{x / div:.4g}{unit}"
    return f"{x:.4g}"


def _bytes(x: float) -> str:
    for div, unit in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(x) >= div:
            return f"{x / div:.4g} {unit}"
    return f"{x:.4g} B"


def render_table(prof: ArchProfile, console: Console) -> None:
    """Per layer type (one layer of each type, times the count) and totals."""
    table = Table(title=f"{prof.name} ({prof.model_type}), seq_len {prof.seq_len}", title_justify="left")
    for col in ("n", "mixer", "ffn", "params", "active", "fwd FLOP/tok", "act B/tok", "a2a B/tok"):
        table.add_column(col, justify="left" if col in ("mixer", "ffn") else "right")
    for g in prof.by_type():
        table.add_row(
            str(g["count"]),
            g["mixer"],
            g["ffn"],
            _n(g["params"]),
            _n(g["activated_params"]),
            _n(g["fwd_flops_per_token"]),
            _bytes(g["act_bytes_per_token"]),
            _bytes(g["dispatch_bytes_per_token"]) if g["dispatch_bytes_per_token"] else "-",
        )
    console.print(table)
    act_total = sum(lp.act_bytes_per_token for lp in prof.layers) + prof.head_act_bytes_per_token
    rows = [
        ("total params", f"{_n(prof.total_params)} ({prof.total_params:,})"),
        ("activated params / token", f"{_n(prof.activated_params)} ({prof.activated_params:,})"),
        ("embedding / LM head", f"{_n(prof.embedding_params)} / {_n(prof.head_params)}"),
        ("other (final norm, MTP, vision)", f"{_n(prof.other_params)}"),
        ("train FLOPs / token (3 x fwd)", _n(prof.train_flops_per_token)),
        ("router GEMM FLOPs / token (apart)", _n(prof.router_train_flops_per_token)),
        ("activations / token (bf16, no recompute)", _bytes(act_total)),
    ]
    if prof.mtp_params:
        mtp = f"{_n(prof.mtp_params)} / {_n(prof.mtp_train_flops_per_token)}"
        rows.append(("MTP params / train FLOPs per token", mtp))
    if prof.vision_params:
        rows.append(("vision tower params (estimate)", _n(prof.vision_params)))
    if prof.quantization:
        q = prof.quantization
        rows.append(
            (
                "checkpoint quantization",
                f"{q.get('method')} {q.get('format')} on {', '.join(q.get('quantized', [])) or 'nothing'}: "
                f"~{_bytes(q['checkpoint_bytes_estimate'])}",
            )
        )
    totals = Table(show_header=False, box=None)
    totals.add_column(justify="left")
    totals.add_column(justify="right")
    for key, value in rows:
        totals.add_row(key, value)
    console.print(totals)
    for note in prof.notes:
        console.print(f"note: {note}", highlight=False)


def profile(
    model: Annotated[str, typer.Argument(help="preset name, moestack ModelSpec YAML, or HF config.json")],
    seq_len: Annotated[int, typer.Option("--seq-len", "-s", help="tokens per sequence (attention FLOPs)")] = 4096,
    json_out: Annotated[bool, typer.Option("--json", help="print one JSON object instead of tables")] = False,
) -> None:
    """Exact parameters, FLOPs per token, activation and dispatch bytes, per layer type and in total."""
    spec, extras = load_any_model(model)
    if seq_len < 1:
        raise ConfigError(f"--seq-len: must be >= 1 token per sequence (got {seq_len})")
    prof = profile_model(spec, seq_len, extras)
    if json_out:
        print(json.dumps(prof.to_json()))
        return
    render_table(prof, Console())
