"""Sequence parallelism (``parallel.sequence_parallel``): every family trains at tp=2 (and tp=4) exactly
like one process, with the collectives of Megatron's sequence parallelism, counted.

Reference: ``helpers.plain_reference`` (a plain transformers + torch loop, one process), 4 sequences of 16
tokens, 5 steps, fp32, clipping active; tolerances of the issue: loss 1e-5, grad_norm 1e-4 relative.

Collectives of one micro-batch of a 2-block model at tp=2 (``helpers.model_collectives``; without SP
every count below is an all-reduce: forward 5, backward 5). With SP (Llama, Qwen3, Gemma 3, GPT-NeoX,
Falcon, Phi, Qwen3-MoE: nothing with parameters outside the blocks but the final norm,
``plan.sequence.stream_ends``), forward: the embedding's partial sums reduce-scattered to the slices,
per block one all-gather at each sub-block's entry (q/k/v share it, gate/up share it; Phi's attention
and MLP, which read one norm's output, share one) and one reduce-scatter at each row-parallel output,
the final norm on the slices and one all-gather at the LM head's input: 5 all-gathers + 5
reduce-scatters (Phi: 3 all-gathers). Backward: the mirror image (each all-gather's backward a
reduce-scatter and the other way round): 5 all-gathers + 5 reduce-scatters (Phi: 3 reduce-scatters).
Then one all-reduce of the TP-partial gradients (the norms computing on sequence slices, flattened
together). Bytes: an all-reduce moves what an all-gather and a reduce-scatter move together, so SP
moves what TP moves, except at the ends: the embedding's reduce-scatter and the LM head's gather each
way move half of the all-reduce they replace. With learned positions (GPT-2, OPT) the embeddings are
computed whole: their all-reduce forward, the stream sliced at the first block (backward: all-gather)
and gathered after the last for the final norm and the LM head (backward: the LM head's input
gradient all-reduced): 1 all-reduce + 5 all-gathers + 4 reduce-scatters each way; SP adds that one
all-gather ((tp-1)/tp of one [b, s, h] activation). A mixture-of-experts block (Qwen3-MoE) is
gathered whole: 1 all-gather in, its experts' all-reduce, sliced on the way out (forward per MoE
block: 1 all-gather + 1 all-reduce; the gather is SP's cost).
"""

import pytest
import torch
from families import write_family_dir
from helpers import (
    assert_parity,
    make_adapter,
    model_collectives,
    plain_reference,
    run_ranks,
    token_dataset,
    train_config,
    write_model_dir,
)
from peft import PeftModel

from shardlm.config import load_config
from shardlm.errors import ConfigError
from shardlm.parallel.runtime.dropout import SEQUENCE, DropoutKey, keep_mask

GLOBAL_BATCH = 4
SP2 = {"tp": 2, "sequence_parallel": True}
# Llama, Qwen3 (q/k norms per head), Gemma 3 (sliding and global layers, q/k norms, scaled tied
# embeddings), GPT-2 (Conv1D, packed c_attn, learned positions, tied), GPT-NeoX and Falcon (parallel
# residual), OPT (learned positions, its MLP on flattened tokens), Phi (one norm read by attention and
# MLP), Qwen3-MoE (experts and router)
FAMILIES = ["llama", "qwen3", "gpt2", "gpt_neox", "falcon", "opt", "phi"]
TINY = ["gemma3_text", "qwen3_moe"]
DROPOUT = {
    "opt": ("opt", {"dropout": 0.1, "attention_dropout": 0.1, "activation_dropout": 0.1}),
    "gpt2": ("gpt2", {"resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1}),
    # the embedding dropout on the reduce-scattered embedding's whole shape, before the first block's slice
    "phi": ("phi", {"embd_pdrop": 0.1, "resid_pdrop": 0.1, "attention_dropout": 0.1}),
}


def write_tiny(path: str, model_type: str) -> str:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from tiny import tiny_config

    tiny_config(model_type).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sp")
    paths = {f: write_family_dir(str(root / f), f) for f in FAMILIES}
    paths.update({t: write_tiny(str(root / t), t) for t in TINY})
    for name, (family, overrides) in DROPOUT.items():
        paths[f"{name}_dropout"] = write_model_dir(str(root / f"{name}_dropout"), family, **overrides)
    paths["qwen3_kv4"] = write_family_dir(str(root / "qwen3_kv4"), "qwen3", num_key_value_heads=4)
    paths["falcon_kv4"] = write_family_dir(str(root / "falcon_kv4"), "falcon", num_kv_heads=4)
    return root, paths


# ---------------------------------------------------------------- refused before spawning


def test_sequence_parallel_needs_tp_and_a_divisible_seq_len(tmp_path):
    model = write_model_dir(str(tmp_path / "llama"), "llama")
    (tmp_path / "data.txt").write_text("hello world\n")
    raw = {"model": model, "data": {"path": str(tmp_path / "data.txt"), "seq_len": 30}}
    cases = [
        ({"sequence_parallel": True}, "parallel.sequence_parallel=true splits the sequence over the tensor-parallel"),
        ({"tp": 4, "sequence_parallel": True}, r"needs data.seq_len=30 divisible by parallel.tp=4"),
    ]
    for parallel, message in cases:
        with pytest.raises(ConfigError, match=message) as info:
            load_config(raw={**raw, "parallel": parallel})
        assert "\n" not in str(info.value) and str(info.value).startswith("parallel.sequence_parallel")
    assert load_config(raw={**raw, "parallel": {"tp": 2, "sequence_parallel": True}}).parallel.sequence_parallel


def test_plans_it_cannot_run_are_refused_by_name(tmp_path):
    """What the sequence-sharded stream does not serve yet (a recurrent mixer's per-channel parameters)
    is one line naming the key, from preflight; where the gathers go is derived from the plan."""
    from families import write_tiny_dir
    from helpers import load_checked

    from shardlm.parallel.infer.autotp import infer_plan
    from shardlm.parallel.model.meta import build_meta_model
    from shardlm.parallel.plan.sequence import scattered_rows, sequence_entries, whole_entries

    (tmp_path / "data.txt").write_text("hello world\n")
    mamba = write_tiny_dir(str(tmp_path / "mamba"), "mamba")
    raw = {"model": mamba, "data": {"path": str(tmp_path / "data.txt"), "packing_strategy": "wrapped"}}
    with pytest.raises(ConfigError, match=r"^parallel.sequence_parallel=true cannot run this model: .*mixer") as info:
        load_checked(raw={**raw, "parallel": SP2})
    assert "\n" not in str(info.value) and "set parallel.sequence_parallel=false" in str(info.value)
    where = {}
    for family in ("llama", "opt", "phi"):
        model = build_meta_model(write_family_dir(str(tmp_path / family), family))
        plan = infer_plan(model, 2)
        where[family] = (sequence_entries(model, plan), sorted(scattered_rows(model, plan)), whole_entries(plan))
    assert where["llama"][0] == [f"model.layers.{i}.{m}" for i in (0, 1) for m in ("self_attn", "mlp")]
    rows = ("self_attn.o_proj", "mlp.down_proj")
    assert where["llama"][1] == sorted(f"model.layers.{i}.{m}" for i in (0, 1) for m in rows)
    # OPT's fc1 sits in the block itself: it gathers its own input
    assert where["opt"][0] == [f"model.decoder.layers.{i}.{m}" for i in (0, 1) for m in ("self_attn", "fc1")]
    assert where["phi"][2] == [] and len(where["phi"][0]) == 4


# ---------------------------------------------------------------- dropout masks (no processes)


def test_sequence_slices_draw_their_part_of_the_one_process_mask():
    full = keep_mask((4, 8, 6), 0.3, DropoutKey(7, 3, torch.arange(4)), 2, "cpu", None)
    for tp in (2, 4):
        keys = [DropoutKey(7, 3, torch.arange(4), r, tp) for r in range(tp)]
        parts = [keep_mask((4, 8 // tp, 6), 0.3, key, 2, "cpu", SEQUENCE) for key in keys]
        assert torch.equal(torch.cat(parts, 1), full)
        # OPT's MLP sees the slice flattened to [batch * s / tp, hidden]
        flat = [keep_mask((4 * 8 // tp, 6), 0.3, key, 2, "cpu", SEQUENCE) for key in keys]
        assert torch.equal(torch.cat([f.view(4, 8 // tp, 6) for f in flat], 1), full)


# ---------------------------------------------------------------- parity (processes)


def sp_run(path: str, layout: dict, adapter: str | None = None, **train_kw) -> list[tuple[float, float]]:
    """One shardlm run at ``layout`` (global batch 4: 4 per device over its data-parallel ranks);
    (loss, grad_norm) per step."""
    from shardlm import Trainer, build_mesh, init_distributed, parallelize
    from shardlm.config import LoraConfig

    init_distributed()
    cfg = train_config(path, layout, 4 // layout.get("fsdp", 1), 1, 5, **train_kw)
    cfg.lora = LoraConfig(adapter=adapter, dropout=0.1) if adapter else None
    mesh = build_mesh(cfg.parallel)
    model = parallelize(path, mesh, seed=cfg.train.seed, lora_config=cfg.lora)
    return [(h["loss"], h["grad_norm"]) for h in Trainer(model, cfg, token_dataset(), mesh).train()]


def tp2_body(paths: dict[str, str], loras: dict[str, tuple[str, str]]) -> dict:
    from shardlm import build_mesh, parallelize
    from shardlm.config import ParallelConfig

    runs = {name: sp_run(path, SP2) for name, path in paths.items()}
    runs |= {name: sp_run(path, SP2, adapter=adapter) for name, (path, adapter) in loras.items()}
    runs["opt_dropout_checkpointing"] = sp_run(paths["opt_dropout"], SP2, gradient_checkpointing=True)
    mesh = build_mesh(ParallelConfig(**SP2))
    counted = [n for n in paths if "dropout" not in n]
    counts = {name: model_collectives(parallelize(paths[name], mesh), mesh) for name in counted}
    return {"runs": runs, "counts": counts}


@pytest.mark.ranks
def test_every_family_at_tp2_with_sp_matches_one_process(dirs):
    """Every family, LoRA with lora_dropout (GPT-2: c_attn, c_fc, both c_proj, its embeddings computed
    whole; Llama: every projection, its stream in slices from the reduce-scattered embedding to the LM
    head) and dropout on (OPT, GPT-2 and Phi, 0.1 everywhere; OPT also with activation checkpointing) at tp=2
    with SP, against one process; the collectives of the module docstring."""
    root, paths = dirs
    targets = {"gpt2": ["c_attn", "c_proj", "c_fc"], "llama": ["q_proj", "k_proj", "v_proj", "o_proj"]}
    targets["llama"] += ["gate_proj", "up_proj", "down_proj"]
    loras = {
        f"lora_{name}": (paths[name], make_adapter(paths[name], str(root / f"adapter_{name}"), modules, dropout=0.1))
        for name, modules in targets.items()
    }
    runs = {n: p for n, p in paths.items() if not n.endswith("_kv4")}
    got = run_ranks(tp2_body, 2, runs, loras)
    for name, path in runs.items():
        assert_parity(got["runs"][name], plain_reference(path, GLOBAL_BATCH, dropout="dropout" in name), label=name)
    for name, (path, adapter) in loras.items():
        wrap = lambda model, adapter=adapter: PeftModel.from_pretrained(model, adapter, is_trainable=True)  # noqa: E731
        assert_parity(got["runs"][name], plain_reference(path, GLOBAL_BATCH, wrap=wrap, dropout=True), label=name)
    ref = plain_reference(paths["opt_dropout"], GLOBAL_BATCH, dropout=True)
    assert_parity(got["runs"]["opt_dropout_checkpointing"], ref, label="opt dropout checkpointing")
    # learned positions (GPT-2, OPT): the embeddings all-reduced, the stream sliced at the first block and
    # gathered after the last; the others: the embedding reduce-scattered, the LM head's input gathered
    whole = {"all_reduce": 1, "all_gather_into_tensor": 5, "reduce_scatter_tensor": 4}
    dense = {"all_gather_into_tensor": 5, "reduce_scatter_tensor": 5}
    for name, (fwd, loss, bwd, grads) in got["counts"].items():
        expected = {
            "gpt2": (whole, whole),
            "opt": (whole, whole),
            "phi": ({**dense, "all_gather_into_tensor": 3}, {**dense, "reduce_scatter_tensor": 3}),
            # 3 blocks
            "gemma3_text": ({"all_gather_into_tensor": 7, "reduce_scatter_tensor": 7},) * 2,
            # per block: attention 1 all-gather + 1 reduce-scatter, the MoE block 1 all-gather + 1 all-reduce
            "qwen3_moe": ({"all_reduce": 2, "all_gather_into_tensor": 5, "reduce_scatter_tensor": 3},) * 2,
        }.get(name, (dense, dense))
        assert (fwd, bwd) == expected, (name, fwd, bwd)
        assert loss == {"all_reduce": 3}, (name, loss)
        assert grads == {"allreduce_": 1}, (name, grads)  # the norms' partial gradients, in one all-reduce


def tp4_body(jobs: list[tuple[str, dict]]) -> list:
    return [sp_run(path, layout) for path, layout in jobs]


@pytest.mark.ranks
def test_tp4_and_tp2_fsdp2_with_sp_match_one_process(dirs):
    """tp=4 with SP (Llama and Gemma 3 with fewer kv heads than tp: k/v sliced; Qwen3 and Falcon with 4 kv
    heads; GPT-2, GPT-NeoX, OPT, Qwen3-MoE) and tp=2 x fsdp=2 with SP (Llama: FSDP2's hooks on the blocks
    beside SP's; Qwen3-MoE with ep=2 too: its MoE block gathered whole, the experts' all-to-all inside it as
    without SP), against one process."""
    _, paths = dirs
    tp4, tp2_fsdp2 = {"tp": 4, "sequence_parallel": True}, {"tp": 2, "fsdp": 2, "sequence_parallel": True}
    names = ["llama", "qwen3_kv4", "gemma3_text", "gpt2", "gpt_neox", "falcon_kv4", "opt", "qwen3_moe"]
    jobs = [(name, tp4) for name in names] + [("llama", tp2_fsdp2), ("qwen3_moe", {**tp2_fsdp2, "ep": 2})]
    got = run_ranks(tp4_body, 4, [(paths[name], layout) for name, layout in jobs])
    for (name, layout), result in zip(jobs, got):
        assert_parity(result, plain_reference(paths[name], GLOBAL_BATCH), label=f"{layout} {name}")


# ---------------------------------------------------------------- memory (processes)


def saved_activation_bytes(paths: list[str], seq: int) -> list[int]:
    """Rank body: bytes autograd saves during one forward on this rank (distinct storages, parameters
    aside, DTensors by their local pieces), per model path (as ``benchmarks/sequence_memory.py``)."""
    from torch.distributed.tensor import DTensor

    from shardlm import build_mesh, init_distributed, parallelize
    from shardlm.config import ParallelConfig

    init_distributed()
    out = []
    for path, sp in [(p, sp) for p in paths for sp in (False, True)]:
        mesh = build_mesh(ParallelConfig(tp=2, sequence_parallel=sp))
        model = parallelize(path, mesh).module.train()
        local = lambda t: t._local_tensor if isinstance(t, DTensor) else t  # noqa: E731
        params = {local(p).untyped_storage().data_ptr() for p in model.parameters()}
        saved: dict[int, int] = {}

        def pack(t, saved=saved, params=params, local=local):
            storage = local(t).untyped_storage()
            if storage.data_ptr() not in params:
                saved[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=torch.randint(0, 64, (1, seq), generator=torch.Generator().manual_seed(0)))
        out.append(sum(saved.values()))
    return out


@pytest.mark.ranks
def test_estimate_matches_saved_activations_with_and_without_sp(tmp_path):
    """``shardlm estimate``'s activations row against what autograd saves on rank 0 at tp=2 (a Llama of
    width 64 at seq 512; benchmarks/README.md has 2048-8192): within 10% with and without
    ``--sequence-parallel`` (1.5% and 1.7% under at 2048-8192), and SP saves less."""
    from shardlm.estimate.memory import estimate

    path = write_model_dir(
        str(tmp_path / "llama"), "llama", hidden_size=64, intermediate_size=256, max_position_embeddings=512
    )
    without, with_sp = run_ranks(saved_activation_bytes, 2, [path], 512)
    for got, sp in ((without, False), (with_sp, True)):
        want = estimate(path, tp=2, batch=1, seq=512, sequence_parallel=sp).bytes["activations"]
        assert abs(want - got) <= 0.10 * got, (sp, want, got)
    assert with_sp < without


# ---------------------------------------------------------------- packed documents (processes)


def packed_sp_steps(paths: list[str], out: str) -> dict:
    """Rank body: per model, the eval loss and one trainer step at tp=2 with SP on document-packed windows
    (``test_packing.parity_data``: position ids restart at each document, the model's forward builds the
    block-diagonal mask from them)."""
    from test_packing import parity_data

    from shardlm import Trainer, build_mesh, init_distributed, parallelize

    init_distributed()
    packed, _ = parity_data()
    result = {}
    for path in paths:
        cfg = train_config(path, SP2, len(packed), 1, 1, output_dir=out)
        mesh = build_mesh(cfg.parallel)
        trainer = Trainer(parallelize(path, mesh, seed=cfg.train.seed), cfg, packed, mesh, eval_dataset=packed)
        evaluated = trainer.evaluate()["eval_loss"]
        record = trainer.train_step()
        result[path] = (record["loss"], record["grad_norm"], evaluated)
    return result


@pytest.mark.ranks
def test_packed_documents_with_sp_equal_padded_rows_in_one_process(tmp_path):
    """Attention under SP runs on the gathered sequence with the mask the model built from the whole
    window's position ids: one step's loss (1e-5), grad_norm (1e-4 relative) and the eval loss on packed
    windows equal one process's on the documents padded one per row (Llama; Gemma 3, sliding window)."""
    from test_packing import GEMMA3, assert_equals_padded
    from transformers import Gemma3TextConfig

    paths = [write_model_dir(str(tmp_path / "llama"), "llama")]
    Gemma3TextConfig(**GEMMA3).save_pretrained(tmp_path / "gemma3")
    paths.append(str(tmp_path / "gemma3"))
    got = run_ranks(packed_sp_steps, 2, paths, str(tmp_path / "out"))
    assert_equals_padded(got, paths)
