"""Activation memory of sequence parallelism, measured: the bytes autograd saves for backward on one TP
rank (distinct storages, parameters aside, DTensors counted by their local pieces) during one forward
of a tiny-width Llama at long sequences, tp=2 without and with ``parallel.sequence_parallel``, beside
``shardlm estimate``'s activations row for the same layout (``--sequence-parallel``).

    PYTHONPATH=src python benchmarks/sequence_memory.py [--seq 2048 4096 8192] [--checkpointing]

Two gloo processes on CPU; prints a Markdown table (benchmarks/README.md keeps the measured one).
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
from torch.distributed.tensor import DTensor

MODEL = dict(hidden_size=64, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)


def saved_bytes(model: torch.nn.Module, input_ids: torch.Tensor) -> int:
    """Bytes of the distinct non-parameter storages autograd saves during a forward (this rank's)."""

    def local(t: torch.Tensor) -> torch.Tensor:
        return t._local_tensor if isinstance(t, DTensor) else t

    params = {local(p).untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = local(t).untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=input_ids)
    return sum(saved.values())


def rank_body(path: str, seqs: list[int], checkpointing: bool) -> list[tuple[int, bool, int]]:
    from shardlm import build_mesh, init_distributed, parallelize
    from shardlm.config import ParallelConfig

    init_distributed()
    out = []
    for seq in seqs:
        ids = torch.randint(0, 64, (1, seq), generator=torch.Generator().manual_seed(0))
        for sp in (False, True):
            mesh = build_mesh(ParallelConfig(tp=2, sequence_parallel=sp))
            model = parallelize(path, mesh).module
            if checkpointing:
                model.gradient_checkpointing_enable({"use_reentrant": False})
            model.train()
            out.append((seq, sp, saved_bytes(model, ids)))
    return out


def main() -> None:
    import transformers

    from shardlm.distributed.launch import spawn
    from shardlm.estimate.memory import estimate

    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--checkpointing", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        path = os.path.join(root, "llama")
        config = transformers.LlamaConfig(vocab_size=64, max_position_embeddings=max(args.seq), **MODEL)
        config.save_pretrained(path)
        measured = spawn(rank_body, 2, path, args.seq, args.checkpointing)[0]
        print("| seq | SP | measured (MiB, rank 0) | estimate (MiB) | estimate / measured |")
        print("|---|---|---|---|---|")
        for seq, sp, got in measured:
            kw = dict(tp=2, batch=1, seq=seq, gradient_checkpointing=args.checkpointing, sequence_parallel=sp)
            want = estimate(path, **kw).bytes["activations"]
            print(f"| {seq} | {'on' if sp else 'off'} | {got / 2**20:.2f} | {want / 2**20:.2f} | {want / got:.3f} |")


if __name__ == "__main__":
    main()
