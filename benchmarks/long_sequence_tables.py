"""The long-sequence memory tables of benchmarks/README.md and docs/long_sequences.md (issue #26).

(a) ``--layers``: bytes autograd saves for backward per decoder layer (distinct storages, parameters
aside, DTensors by their local pieces, attributed to the block running when they are saved; the
middle block of three is reported), one process, tp=2 and tp=2 with sequence parallelism, for GPT-2
(LayerNorm, GeLU MLP of 4h, dropout 0.1 as published) and Llama (RMSNorm, SwiGLU, GQA), beside
Korthikanti et al. 2022's per-layer formulas at 16-bit: ``sbh(34 + 5as/h)``, with TP
``sbh(10 + 24/t + 5as/(ht))``, with TP and SP ``sbh/t (34 + 5as/h)``. Under bf16 autocast (or fp32
with ``--fp32``); dropout drawn as shardlm draws it in training (``DeterministicDropout``), and, for
one process, by torch as well.

(b) ``--budget``: the longest sequence (batch 1, a multiple of 64) whose activations row of
``shardlm estimate`` fits a per-rank budget, for one process, tp=2, tp=2 + SP, cp=2, cp=4, tp=2 x cp=2
(and with SP), a tiny-width Llama (hidden 256, 8 heads, 4 kv heads, intermediate 512, 2 layers),
fp32; ``--confirm`` measures the saved bytes of one forward at the cp=2, tp=2 + SP and tp=2 x cp=2 + SP
points.

    PYTHONPATH=src python benchmarks/long_sequence_tables.py --layers [--seq 1024] [--fp32]
    PYTHONPATH=src python benchmarks/long_sequence_tables.py --budget 256 [--confirm]

gloo processes on CPU; prints Markdown tables (benchmarks/README.md keeps the measured ones).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from contextlib import nullcontext

import torch
from torch.distributed.tensor import DTensor

VOCAB = 64
GPT2 = dict(n_embd=256, n_head=4, n_layer=3, vocab_size=VOCAB)  # dropouts: GPT-2's published 0.1
LLAMA = dict(hidden_size=256, intermediate_size=688, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3)
WIDE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=2)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _weight_copy(t: torch.Tensor) -> bool:
    """Whether ``t`` is autocast's bf16 copy of a parameter (or its transpose): its autograd history is
    a chain of single-input casts and views ending at the parameter. Not an activation: it is counted
    with the weights (``shardlm estimate``'s compute_weights row)."""
    fn = t.grad_fn
    for _ in range(4):
        if fn is None or len(fn.next_functions) != 1:
            return False
        fn = fn.next_functions[0][0]
        if fn is not None and type(fn).__name__ == "AccumulateGrad":
            return True
    return False


def saved_per_block(model: torch.nn.Module, forward, blocks: list[torch.nn.Module]) -> tuple[list[int], int]:
    """Bytes of the distinct non-parameter storages autograd saves during ``forward()`` (autocast's
    weight copies left out, ``_weight_copy``), per block of ``blocks`` (by the block running when first
    saved), and in all."""
    current, per_block, seen = [None], [0] * len(blocks), {}
    handles = []
    for i, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(lambda m, a, i=i: current.__setitem__(0, i)))
        handles.append(block.register_forward_hook(lambda m, a, o: current.__setitem__(0, None)))

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = _local(t).untyped_storage()
        # the parameters now: FSDP2 swaps its unsharded ones in around each module's forward
        params = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
        if storage.data_ptr() not in params and storage.data_ptr() not in seen and not _weight_copy(t):
            seen[storage.data_ptr()] = storage.nbytes()
            if current[0] is not None:
                per_block[current[0]] += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    for h in handles:
        h.remove()
    return per_block, sum(seen.values())


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    from shardlm.parallel.plan.sequence import block_names

    return [model.get_submodule(name) for name in block_names(model)]


def _forward(model, ids: torch.Tensor, bf16: bool, dropout):
    def run():
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext()
        with autocast, dropout or nullcontext():
            model(input_ids=ids)

    return run


def layer_rank_body(paths: dict[str, str], seq: int, bf16: bool) -> dict:
    """Rank body (2 ranks): per model, the middle block's saved bytes at tp=2 without and with SP."""
    import torch.distributed as dist

    from shardlm import build_mesh, init_distributed, parallelize
    from shardlm.config import ParallelConfig
    from shardlm.parallel.runtime.dropout import DeterministicDropout, DropoutKey

    init_distributed()
    ids = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(0))
    out = {}
    for name, path in paths.items():
        for sp in (False, True):
            mesh = build_mesh(ParallelConfig(tp=2, sequence_parallel=sp))
            pm = parallelize(path, mesh)
            model = pm.module.train()
            key = DropoutKey(0, 0, torch.arange(1), dist.get_rank(), 2, tuple(pm.plan.dropout_sites))
            per_block, _ = saved_per_block(model, _forward(model, ids, bf16, DeterministicDropout(key)), _blocks(model))
            out[name, sp] = per_block[len(per_block) // 2]
    return out


def one_process_layer(path: str, seq: int, bf16: bool, shardlm_dropout: bool) -> int:
    from shardlm.parallel.runtime.dropout import DeterministicDropout, DropoutKey
    from shardlm.parallel.weights.fill import reference_model

    model = reference_model(path, 0).train()
    model.config.use_cache = False
    ids = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(0))
    mode = DeterministicDropout(DropoutKey(0, 0, torch.arange(1))) if shardlm_dropout else None
    per_block, _ = saved_per_block(model, _forward(model, ids, bf16, mode), _blocks(model))
    return per_block[len(per_block) // 2]


def korthikanti(s: int, h: int, a: int, t: int, sp: bool, b: int = 1) -> float:
    """Per-layer activation bytes at 16-bit (Korthikanti et al. 2022, Table 2; no recomputation)."""
    if t == 1:
        return s * b * h * (34 + 5 * a * s / h)
    if sp:
        return s * b * h / t * (34 + 5 * a * s / h)
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


def layers_table(seq: int, bf16: bool) -> None:
    import transformers

    from shardlm.distributed.launch import spawn

    with tempfile.TemporaryDirectory() as root:
        paths = {"gpt2": os.path.join(root, "gpt2"), "llama": os.path.join(root, "llama")}
        transformers.GPT2Config(n_positions=seq, bos_token_id=0, eos_token_id=0, **GPT2).save_pretrained(paths["gpt2"])
        transformers.LlamaConfig(vocab_size=VOCAB, max_position_embeddings=seq, **LLAMA).save_pretrained(paths["llama"])
        tp = spawn(layer_rank_body, 2, paths, seq, bf16)[0]
        dtype = "bf16 autocast" if bf16 else "fp32"
        print(f"| model | layout | measured per layer (MiB, {dtype}) | Korthikanti 16-bit (MiB) | measured / formula |")
        print("|---|---|---|---|---|")
        for name, cfg in (("gpt2", GPT2), ("llama", LLAMA)):
            h = cfg.get("n_embd", cfg.get("hidden_size"))
            a = cfg.get("n_head", cfg.get("num_attention_heads"))
            rows = [("one process (torch's dropout)", one_process_layer(paths[name], seq, bf16, False), 1, False)]
            rows.append(("one process (shardlm's dropout)", one_process_layer(paths[name], seq, bf16, True), 1, False))
            rows += [("tp=2", tp[name, False], 2, False), ("tp=2 + SP", tp[name, True], 2, True)]
            if name == "llama":  # no dropout: both one-process rows are the same
                rows = [("one process", rows[1][1], 1, False), *rows[2:]]
            for layout, got, t, sp in rows:
                want = korthikanti(seq, h, a, t, sp)
                print(f"| {name} | {layout} | {got / 2**20:.2f} | {want / 2**20:.2f} | {got / want:.3f} |")


LAYOUTS = [
    ("one process", {}),
    ("tp=2", {"tp": 2}),
    ("tp=2 + SP", {"tp": 2, "sequence_parallel": True}),
    ("cp=2", {"cp": 2}),
    ("cp=4", {"cp": 4}),
    ("tp=2 x cp=2", {"tp": 2, "cp": 2}),
    ("tp=2 x cp=2 + SP", {"tp": 2, "cp": 2, "sequence_parallel": True}),
]


def longest(path: str, budget: int, layout: dict, step: int = 64, top: int = 1 << 17) -> tuple[int, int]:
    """The longest multiple of ``step`` tokens whose estimated activations fit ``budget`` bytes, and them."""
    from shardlm.estimate.memory import estimate

    def acts(seq: int) -> int:
        return estimate(path, batch=1, seq=seq, **layout).bytes["activations"]

    lo, hi = 1, top // step  # in units of ``step``: ``lo`` fits, ``hi`` does not
    if acts(lo * step) > budget or acts(hi * step) <= budget:
        raise ValueError(f"{layout}: the budget is outside {step}..{top} tokens")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if acts(mid * step) <= budget else (lo, mid)
    return lo * step, acts(lo * step)


def confirm_rank_body(path: str, seq: int, layout: dict) -> int:
    """Rank body: the largest over the ranks of the bytes saved in one forward of a window of ``seq``
    tokens on shardlm's model at ``layout`` (under cp, this rank's chunks, as the trainer runs them)."""
    import torch.distributed as dist

    from shardlm import build_mesh, init_distributed, parallelize
    from shardlm.config import ParallelConfig
    from shardlm.data.context_split import chunk_index
    from shardlm.parallel.runtime.context import ContextShard, context_parallel

    init_distributed()
    mesh = build_mesh(ParallelConfig(**layout))
    model = parallelize(path, mesh).module.train()
    ids = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(0))
    positions, shard = torch.arange(seq).expand(1, seq), None
    if mesh.parallel.cp > 1:
        shard = ContextShard(positions, mesh.parallel.cp, mesh.cp.get_local_rank(), mesh.cp.get_group())
        index = chunk_index(seq, mesh.parallel.cp, mesh.cp.get_local_rank())
        ids, positions = ids[:, index], positions[:, index]
    with context_parallel(shard):
        _, total = saved_per_block(model, lambda: model(input_ids=ids, position_ids=positions), [])
    mine = torch.tensor(float(total))
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return int(mine)


def budget_table(budget_mib: float, confirm: bool) -> None:
    import transformers

    from shardlm.distributed.launch import spawn

    budget = int(budget_mib * 2**20)
    with tempfile.TemporaryDirectory() as root:
        path = os.path.join(root, "llama")
        config = transformers.LlamaConfig(vocab_size=VOCAB, max_position_embeddings=1 << 17, **WIDE)
        config.save_pretrained(path)
        print(f"| layout | ranks | longest seq within {budget_mib:g} MiB | estimated MiB | measured MiB |")
        print("|---|---|---|---|---|")
        for name, layout in LAYOUTS:
            seq, acts = longest(path, budget, layout)
            ranks = layout.get("tp", 1) * layout.get("cp", 1)
            measured = ""
            if confirm and name in ("cp=2", "tp=2 + SP", "tp=2 x cp=2 + SP"):
                measured = f"{spawn(confirm_rank_body, ranks, path, seq, layout)[0] / 2**20:.1f}"
            print(f"| {name} | {ranks} | {seq} | {acts / 2**20:.1f} | {measured} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", action="store_true")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--fp32", action="store_true")
    parser.add_argument("--budget", type=float)
    parser.add_argument("--confirm", action="store_true")
    args = parser.parse_args()
    if args.layers:
        layers_table(args.seq, not args.fp32)
    if args.budget:
        budget_table(args.budget, args.confirm)


if __name__ == "__main__":
    main()
