"""The readable report ``shardlm estimate`` prints (``format_table``), with a line per pipeline stage."""

from __future__ import annotations

from shardlm.config.schema import PP_SPLIT_BACKWARD
from shardlm.estimate.rows import GIB, Estimate
from shardlm.parallel.runtime.ulysses import ATTENTION as ULYSSES


def _human(n: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def stage_lines(est: Estimate) -> list[str]:
    """Under ``pp``: a line per stage (its rank, blocks, parameters, most micro-batches in flight, activations
    and peak), the schedule's bubble, and which rank the rows below are."""
    lay = est.layout
    per_rank = lay.get("pp_virtual_stages", 1)
    formula = "(p-1)/(m+p-1)" if per_rank == 1 else "(p-1)/(v m+p-1)"
    if lay["pp_schedule"] in PP_SPLIT_BACKWARD:
        formula = "about 0 (the weight passes fill it)"
    lines = [
        f"{lay['pp_schedule']} over {lay['pp_microbatches']} micro-batches of {lay['batch']} sequences: bubble "
        f"{formula} = {lay['bubble']:.3f} of each step",
        f"{'stage':<5}  {'rank':<4}  {'blocks':<9}  {'parameters':>12}  {'in flight':>9}  {'activations':>12}  "
        f"{'peak':>12}",
    ]
    for st in est.stages:
        start, stop = st["blocks"]
        lines.append(
            f"{st['stage']:<5}  {st['rank']:<4}  {f'{start}-{stop - 1}':<9}  {st['params']:>12,}  "
            f"{st['in_flight']:>9}  {_human(st['activations']):>12}  {_human(st['total']):>12}"
        )
    peak = max(est.ranks, key=lambda r: r["total"])
    held = ", ".join(f"stage {s}: {n}" for s, n in peak["held"].items())
    lines.append(f"the rows below: rank {peak['rank']}, the highest peak (micro-batches held then: {held})")
    return lines


def format_table(est: Estimate) -> str:
    """The readable report ``shardlm estimate`` prints."""
    lay = est.layout
    lines = [
        (
            f"layout tp={lay['tp']} fsdp={lay['fsdp']} dp_replicate={lay['dp_replicate']}"
            f"{' ep=' + str(lay['ep']) if lay.get('ep', 1) > 1 else ''}"
            f"{' cp=' + str(lay['cp']) if lay.get('cp', 1) > 1 else ''}"
            f"{' (ulysses)' if lay.get('cp', 1) > 1 and lay.get('cp_attention') == ULYSSES else ''}"
            f"{' pp=' + str(lay['pp']) if lay.get('pp', 1) > 1 else ''}, per rank: "
            f"batch {lay['batch']} x seq {lay['seq']}{', bf16' if lay['bf16'] else ', fp32'}"
            f"{', LoRA r=' + str(lay['lora_r']) if lay['lora_r'] else ''}"
            f"{', gradient checkpointing' if lay['gradient_checkpointing'] else ''}"
            f"{', sequence parallel' if lay.get('sequence_parallel') else ''}"
            f"{', FSDP CPU offload' if lay.get('fsdp_offload') else ''}"
        ),
        (
            f"parameters: {est.params_full:,} in the model, {est.params_local:,} on each rank"
            f"{' of the stage with the highest peak' if est.stages else ''}, {est.trainable_local:,} trainable"
        ),
    ]
    if est.vocab_rows:
        rows = " | ".join(map(str, est.vocab_rows))
        lines.append(
            f"vocabulary: {sum(est.vocab_rows):,} rows in torch's chunks, {rows} per TP rank "
            "(the embedding and LM head counted at rank 0's, the largest)"
        )
    if est.stages:
        lines += stage_lines(est)
    for key, value in est.bytes.items():
        if key == "total":
            lines.append(f"{'':-<21}  {'':->12}")
            lines.append(f"{'step phase':<21}  {_human(est.step_bytes):>12}")
            lines.append(f"{'optimizer phase':<21}  {_human(est.optimizer_step_bytes):>12}")
            key = "total (peak)"
        lines.append(f"{key:<21}  {_human(value):>12}")
    if est.offloaded:
        note = "(fsdp_offload: parameters, gradients, optimizer state; not in the total)"
        lines.append(f"{'+ host memory':<21}  {_human(est.host_bytes):>12}  {note}")
    if est.runtime_bytes:
        note = "(torch + transformers, measured here; not in the total)"
        lines.append(f"{'+ runtime':<21}  {_human(est.runtime_bytes):>12}  {note}")
    if est.memory_gib is not None:
        verdict = "fits" if est.fits else "does NOT fit"
        lines.append(
            f"{verdict} in {est.memory_gib:g} GiB per rank ({_human(abs(est.memory_gib * GIB - est.bytes['total']))} "
            f"{'to spare' if est.fits else 'short'})"
        )
    return "\n".join(lines)
