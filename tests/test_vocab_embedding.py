"""The vocabulary-parallel input embedding (``parallel/runtime/embedding.py``) at tp=2 without FSDP: each rank
holds and computes only its ``Shard(0)`` rows of the embedding gradient, equal to those rows of one process's
gradient; training matches one process, with a ``padding_idx`` in the second rank's rows (its gradient row stays
zero), and with an LM head tied to the embedding.
"""

import pytest
import torch
from helpers import assert_parity, plain_reference, run_ranks, shardlm_losses, token_dataset, write_model_dir

pytestmark = pytest.mark.ranks

MODELS = {
    "odd_vocab_padding": {"vocab_size": 96, "pad_token_id": 60},
    "odd_vocab_tied": {"vocab_size": 96, "num_key_value_heads": 4, "tie_word_embeddings": True},
}


def embedding_grads(paths: list[str]) -> dict[str, dict]:
    """Rank body: per model, this rank's embedding gradient after one forward/backward at tp=2 against the
    same rows of one process's gradient (the same seeded model, the same batch)."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from shardlm import build_mesh, init_distributed, parallelize
    from shardlm.config import ParallelConfig
    from shardlm.distributed.shards import local_index
    from shardlm.parallel.weights.fill import reference_model
    from shardlm.train.loss import token_loss_sum

    init_distributed()
    mesh = build_mesh(ParallelConfig(tp=2))
    data = token_dataset()
    ids, labels = data.input_ids[:4], data.labels[:4]
    out = {}
    for path in paths:
        model = parallelize(path, mesh).module
        logits = model(input_ids=ids).logits
        token_loss_sum(logits, labels).backward()
        weight = model.get_input_embeddings().weight
        ref = reference_model(path, 0)
        F.cross_entropy(ref(input_ids=ids).logits.flatten(0, 1), labels.flatten(), reduction="sum").backward()
        rows = local_index(weight, 0)
        local = weight.grad.to_local()
        diff = (local - ref.get_input_embeddings().weight.grad[rows]).abs().max()
        found = torch.tensor([local.numel(), weight.to_local().numel(), float(diff)], dtype=torch.float64)
        every = [torch.zeros_like(found) for _ in range(dist.get_world_size())]
        dist.all_gather(every, found)
        out[path] = {"per_rank": [t.tolist() for t in every], "placements": str(weight.grad.placements)}
    return out


def body(paths: list[str]) -> tuple[dict, dict]:
    return shardlm_losses(paths, {"tp": 2}, 4, 1), embedding_grads(paths)


def test_vocab_parallel_embedding_keeps_its_rows_and_matches_one_process(tmp_path):
    paths = {name: write_model_dir(str(tmp_path / name), "llama", **kw) for name, kw in MODELS.items()}
    losses, grads = run_ranks(body, 2, list(paths.values()))
    for name, path in paths.items():
        assert_parity(losses[path], plain_reference(path, 4), label=name)
        assert grads[path]["placements"] == "(Shard(dim=0),)", (name, grads[path])
        hidden = 32
        for rank, (grad_numel, param_numel, diff) in enumerate(grads[path]["per_rank"]):
            assert grad_numel == param_numel == 48 * hidden, (name, rank, grad_numel)
            assert diff <= 1e-5, (name, rank, diff)
