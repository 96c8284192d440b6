"""`moestack adapt` (scale a model down to a proxy that fits a device) and `moestack convert` (HF safetensors <->
moestack checkpoints). Typer-annotated functions; moestack/cli/app.py registers them."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from moestack.cli.profile import _bytes, _n
from moestack.config.base import ConfigError
from moestack.config.model_spec import ModelSpec

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
    from moestack.tune.builds import check_builds

    if precision not in ("auto", "bf16", "fp32"):
        raise ConfigError(f"--precision: must be auto, bf16 or fp32, got '{precision}'")
    spec = load_any_model_spec(model)
    result = adapt_model(spec, parse_fit(fit), seq_len, batch, precision, act_factor, margin, top_k, name)
    check_builds(result.spec, result.profile)
    console = Console()
    render_adapt(result, console)
    text = spec_to_yaml(result)
    if out is None:
        typer.echo(text, nl=False)  # verbatim (a rich console would wrap long lines): pipeable into a file
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        console.print(f"wrote {out} (moestack train --model {out})", highlight=False)


# ---------------------------------------------------------------------------------------------- convert

_DTYPE_FLAGS = {"keep": None, "fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _is_hf_dir(path: Path) -> bool:
    from moestack.train.convert import INDEX

    return path.is_dir() and ((path / INDEX).is_file() or any(path.glob("*.safetensors")))


def _checkpoint_dir(path: Path) -> Path:
    from moestack.train.checkpoint import COMPLETE, latest_checkpoint

    if (path / COMPLETE).is_file() or (path / ".metadata").is_file():
        return path
    found = latest_checkpoint(path)
    if found is None:
        raise ConfigError(
            f"convert: {path} is neither an HF checkpoint (*.safetensors) nor a moestack checkpoint (step_* with "
            "COMPLETE)"
        )
    return found


def convert(
    src: Annotated[Path, typer.Argument(help="HF directory (*.safetensors, index.json) or moestack checkpoint "
                                             "(a step_* directory or the root holding them)")],
    dst: Annotated[Path, typer.Argument(help="output: a checkpoint root (from HF) or an HF directory (to HF)")],
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="ModelSpec: preset, YAML or HF config.json "
                     "(default: SRC/config.json, or the spec recorded in a converted checkpoint)")] = None,
    family: Annotated[Optional[str], typer.Option(help="HF naming: kimi_k3, kimi_linear, deepseek_v3, qwen3_moe, "
                                                       "mixtral (default: the model's family)")] = None,
    dtype: Annotated[Optional[str], typer.Option(help="to moestack: keep (default) | fp32; to HF: bf16 | fp32 | "
                                                      "fp16 (default: the recorded HF layout, else bf16)")] = None,
    skip: Annotated[Optional[list[str]], typer.Option("--skip", help="regex of HF tensors to leave out on "
                                                                     "purpose (repeatable)")] = None,
    max_shard_size: Annotated[str, typer.Option("--max-shard-size", help="HF shard size without a recorded "
                                                                         "layout")] = "5GB",
    dequantize: Annotated[bool, typer.Option("--dequantize", help="to HF: write MXFP4 tensors unpacked (bf16 or "
                                             "--dtype) and config.json without quantization_config")] = False,
    trust_key_file: Annotated[Optional[Path], typer.Option("--trust-key-file", help="key file: sign the "
                              "checkpoint written (from HF), refuse a checkpoint not signed with it (to HF)")] = None,
) -> None:
    """HF safetensors <-> moestack checkpoint, streaming shard by shard; bit-exact both ways (MXFP4 experts:
    dequantised on import, re-quantised on export to the same values)."""
    import json
    import time

    import torch

    from moestack.config.hf import is_hf_config, load_hf_config
    from moestack.config.model_spec import ModelSpec
    from moestack.planner.adapt import parse_bytes
    from moestack.planner.profile import load_any_model_spec
    from moestack.train.convert import CheckpointSource, describe_skipped, export_hf, hf_to_checkpoint
    from moestack.train.hf_names import build_name_map
    from moestack.train.safe_load import read_trust_key

    if dtype is not None and dtype not in _DTYPE_FLAGS:
        raise ConfigError(f"--dtype: must be one of {', '.join(_DTYPE_FLAGS)}, got '{dtype}'")
    torch_dtype = getattr(torch, _DTYPE_FLAGS[dtype]) if dtype and _DTYPE_FLAGS[dtype] else None
    trust_key = read_trust_key(trust_key_file, "--trust-key-file")
    console = Console()
    t0 = time.time()
    if _is_hf_dir(src):
        if dtype in ("bf16", "fp16"):
            raise ConfigError("--dtype: converting to moestack takes keep or fp32")
        if model is None and not (src / "config.json").is_file():
            raise ConfigError(f"convert: {src} has no config.json; pass --model")
        spec = load_any_model_spec(model) if model else load_hf_config(src).spec
        path = hf_to_checkpoint(src, dst, spec, family, skip or (), torch_dtype, trust_key=trust_key)
        written = CheckpointSource(path)
        if written.extra.get("skipped"):
            console.print(describe_skipped(written.extra["skipped"], build_name_map(spec, family)), highlight=False)
        console.print(f"wrote {path}: {len(written.tensors)} tensors of model '{spec.name}' "
                      f"({time.time() - t0:.1f} s)", highlight=False)
        return
    if not src.exists():
        raise ConfigError(f"convert: {src}: no such file or directory")
    if dtype == "keep":
        raise ConfigError("--dtype: converting to HF takes bf16, fp32 or fp16")
    source = CheckpointSource(_checkpoint_dir(src), trust_key)
    if model is not None:
        spec = load_any_model_spec(model)
    elif "model_spec" in source.extra:
        spec = ModelSpec.model_validate(json.loads(source.extra["model_spec"]))
    else:
        raise ConfigError(f"convert: checkpoint {source.path} records no model spec; pass --model")
    family = family or source.extra.get("family")
    max_bytes = parse_bytes(max_shard_size)
    if max_bytes is None or max_bytes <= 0:
        raise ConfigError(f"--max-shard-size: expected an amount like 5GB, got '{max_shard_size}'")
    config = Path(model).read_text() if model is not None and is_hf_config(model) else None
    files = export_hf(source, spec, dst, family, dtype=torch_dtype, max_shard_bytes=int(max_bytes), config=config,
                      dequantize=dequantize)
    shards = sum(p.suffix == ".safetensors" for p in files)
    console.print(f"wrote {dst}: {shards} shard(s) of model '{spec.name}' ({time.time() - t0:.1f} s)",
                  highlight=False)
