"""Memory per rank of a training layout, before starting anything: ``shardlm estimate``.

Why: the first question about a layout is whether it fits, and the answer should not cost a
failed launch. Parameter shapes come from the meta model and the same TP plan ``parallelize``
applies (``autotp.infer_plan``), so the model-state numbers are what the ranks really hold:

* TP: ``colwise``/``packed_colwise``/``lm_head`` shard a weight's output dim, ``rowwise`` its
  input dim (its bias stays replicated), ``embedding`` the vocabulary rows (in torch's chunks: where tp
  does not divide the vocabulary, rank 0's are the most, and counted; ``Estimate.vocab_rows``); ``replicate`` and
  ``replicate_grad_allreduce`` (norms) are whole on every TP rank, and so are the plan's
  ``sliced`` projections (k/v when kv heads < tp, Phi-3's GQA qkv_proj).
* FSDP2 then chunks dim 0 of each TP-local tensor over ``fsdp`` (the largest chunk, rank 0's,
  is reported). ``dp_replicate`` holds full copies: it divides nothing.
* Gradients: one per trainable parameter, same local shape and dtype (fp32 master weights; the
  TP embedding's too: its rows only, ``parallel/runtime/embedding.py``). AdamW: two fp32 states per
  trainable parameter. With ``lora_r``, only the adapters train:
  ``r*(in+out)`` per targeted linear, A/B placed like their base (colwise base: B sharded;
  rowwise base: A sharded); under ``bf16`` the frozen base is stored in 2 bytes.

Activations (``estimate/activations.py``), parameters and compute copies (``estimate/params.py``), the
rows and the peak of one model or stage (``estimate/rows.py``), pipeline stages (``estimate/pipeline.py``),
the flags checked (``estimate/checks.py``), the printed report (``estimate/table.py``).
"""

from __future__ import annotations

from shardlm.config.paths import check_model_dir
from shardlm.config.ranges import check_value
from shardlm.data.fit import check_seq_len, max_positions, model_config
from shardlm.distributed.mesh import resident_bytes
from shardlm.estimate.checks import check_cp_attention, check_layout, check_offload, check_sequence_parallel
from shardlm.estimate.pipeline import pipeline_estimate
from shardlm.estimate.rows import Estimate, model_estimate
from shardlm.estimate.stages import check_microbatches, schedule_name, stages_per_rank
from shardlm.parallel.infer.autotp import check_geometry, infer_plan
from shardlm.parallel.model.geometry import read_geometry
from shardlm.parallel.model.meta import build_meta_model
from shardlm.parallel.plan.rows import chunk_rows
from shardlm.parallel.runtime.ep import check_ep

DEFAULT_SEQ = 128  # tokens per sequence when --seq is not given (fewer when the model has fewer positions)


def estimate(
    model_path: str,
    tp: int = 1,
    fsdp: int = 1,
    dp_replicate: int = 1,
    batch: int = 4,
    seq: int | None = None,
    bf16: bool = False,
    lora_r: int | None = None,
    gradient_checkpointing: bool = False,
    memory_gib: float | None = None,
    ep: int = 1,
    sequence_parallel: bool = False,
    fsdp_offload: bool = False,
    cp: int = 1,
    pp: int = 1,
    pp_schedule: str = "1F1B",
    pp_microbatches: int | None = None,
    cp_attention: str = "all_gather",
    pp_virtual_stages: int | None = None,
) -> Estimate:
    """Per-rank memory of training ``model_path`` with this layout (``batch`` sequences per rank of
    ``seq`` tokens, default 128 or the model's positions if fewer; ``ep``: expert parallelism,
    carved out of the data-parallel ranks; ``sequence_parallel``: ``parallel.sequence_parallel``;
    ``fsdp_offload``: the model state in host memory; ``cp``: context parallelism, each sequence
    split between ``cp`` ranks, FSDP sharding over ``fsdp x cp``; ``cp_attention``: its variant,
    ``parallel.cp_attention``; ``pp``: pipeline stages run by ``pp_schedule`` over ``pp_microbatches``
    (default ``pp``) micro-batches of ``batch`` sequences, ``pp_virtual_stages`` stages a rank (default: as
    ``parallel.pp_virtual_stages``), see ``pipeline_estimate``)."""
    check_model_dir(model_path)
    check_offload(fsdp_offload, fsdp * dp_replicate, ep)
    if seq is None:
        bound = max_positions(model_config(model_path))
        seq = min(DEFAULT_SEQ, bound[1]) if bound else DEFAULT_SEQ
    check_layout(tp, fsdp, dp_replicate, batch, seq, ep, lora_r, memory_gib, cp)
    check_value("parallel.pp", pp, "--pp")
    layout = {"tp": tp, "fsdp": fsdp, "cp": cp, "ep": ep, "dp_replicate": dp_replicate, "batch": batch, "seq": seq}
    layout |= {"bf16": bf16, "lora_r": lora_r, "gradient_checkpointing": gradient_checkpointing}
    layout |= {"sequence_parallel": sequence_parallel, "fsdp_offload": fsdp_offload, "cp_attention": cp_attention}
    if pp > 1:
        schedule = schedule_name(pp_schedule)
        check_microbatches(pp, schedule, pp_microbatches or pp)
        per_rank = stages_per_rank(schedule, pp_virtual_stages)
        layout |= {"pp": pp, "pp_schedule": schedule, "pp_microbatches": pp_microbatches or pp}
        layout |= {"pp_virtual_stages": per_rank}
    baseline = resident_bytes()  # before the meta model and the plan's trace add their own
    check_geometry(model_path, tp)
    check_seq_len(model_config(model_path), seq, "--seq")
    model = build_meta_model(model_path)
    check_ep(model, ep)
    check_cp_attention(model, cp, cp_attention, tp)
    plan = infer_plan(model, tp)
    if sequence_parallel:
        check_sequence_parallel(model, plan, tp, seq, cp)
    if pp > 1:
        est = pipeline_estimate(model, plan, layout, memory_gib, baseline)
    else:
        est = model_estimate(model, model.config, plan, layout, memory_gib, baseline)
    vocab = read_geometry(model.config).vocab
    est.vocab_rows = chunk_rows(vocab, tp) if vocab and vocab % tp else []
    return est
