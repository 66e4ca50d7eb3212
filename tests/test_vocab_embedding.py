"""The vocabulary-parallel input embedding (``parallel/runtime/embedding.py``) at tp=2 without FSDP: each rank
holds and computes only its ``Shard(0)`` rows of the embedding gradient, equal to those rows of one process's
gradient; training matches one process, with a ``padding_idx`` in the second rank's rows (its gradient row stays
zero), and with an LM head tied to the embedding. A vocabulary tp does not divide (253: GPT-2 with its tied
head, Llama untied) is split in torch's chunks, 127 and 126 rows: each rank's rows of the embedding's and the
LM head's gradients equal one process's (the same batch, ids over the whole vocabulary); its training at tp=2
and tp=2 x fsdp=2, resume and consolidation are in ``test_autotp.py``.
"""

import pytest
import torch
from families import VOCAB
from helpers import assert_parity, plain_reference, run_ranks, shardlm_losses, token_dataset, write_model_dir

pytestmark = pytest.mark.ranks

MODELS = {
    "odd_vocab_padding": {"vocab_size": 96, "pad_token_id": 60},
    "odd_vocab_tied": {"vocab_size": 96, "num_key_value_heads": 4, "tie_word_embeddings": True},
}
# name -> (family, vocabulary): one tp=2 does not divide, each rank's rows (torch's chunks) per model
UNEVEN = {"gpt2_vocab253": ("gpt2", 253), "llama_vocab253": ("llama", 253)}
ROWS = {96: [48, 48], 253: [127, 126]}


def embedding_grads(paths: dict[str, int]) -> dict[str, dict]:
    """Rank body: per model (path -> its vocabulary, the batch's ids drawn from all of it), this rank's
    gradients of the embedding and the LM head after one forward/backward at tp=2 against the same rows of
    one process's gradients (the same seeded model, the same batch)."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from shardlm import build_mesh, init_distributed, parallelize
    from shardlm.config import ParallelConfig
    from shardlm.distributed.shards import local_index
    from shardlm.parallel.weights.fill import reference_model
    from shardlm.train.loss import token_loss_sum

    init_distributed()
    mesh = build_mesh(ParallelConfig(tp=2))
    out = {}
    for path, vocab in paths.items():
        data = token_dataset(vocab=vocab)
        ids, labels = data.input_ids[:4], data.labels[:4]
        model = parallelize(path, mesh).module
        logits = model(input_ids=ids).logits
        token_loss_sum(logits, labels).backward()
        ref = reference_model(path, 0)
        F.cross_entropy(ref(input_ids=ids).logits.flatten(0, 1), labels.flatten(), reduction="sum").backward()
        found = []
        for weight, ref_weight in (
            (model.get_input_embeddings().weight, ref.get_input_embeddings().weight),
            (model.get_output_embeddings().weight, ref.get_output_embeddings().weight),
        ):
            local = weight.grad.to_local()
            diff = (local - ref_weight.grad[local_index(weight, 0)]).abs().max()
            found += [local.numel(), weight.to_local().numel(), float(diff)]
        found = torch.tensor(found, dtype=torch.float64)
        every = [torch.zeros_like(found) for _ in range(dist.get_world_size())]
        dist.all_gather(every, found)
        weight = model.get_input_embeddings().weight
        local = sum(p.to_local().numel() for p in model.parameters())  # rank 0's is the estimate's
        out[path] = {"per_rank": [t.tolist() for t in every], "placements": str(weight.grad.placements), "local": local}
    return out


def body(paths: list[str], uneven: dict[str, int]) -> tuple[dict, dict]:
    return shardlm_losses(paths, {"tp": 2}, 4, 1), embedding_grads({**dict.fromkeys(paths, VOCAB), **uneven})


def test_vocab_parallel_embedding_keeps_its_rows_and_matches_one_process(tmp_path, capsys):
    from shardlm.cli import main
    from shardlm.estimate.memory import estimate

    paths = {name: write_model_dir(str(tmp_path / name), "llama", **kw) for name, kw in MODELS.items()}
    uneven = {name: write_model_dir(str(tmp_path / name), fam, vocab_size=v) for name, (fam, v) in UNEVEN.items()}
    vocabs = {path: UNEVEN[name][1] for name, path in uneven.items()}
    losses, grads = run_ranks(body, 2, list(paths.values()), vocabs)
    for name, path in paths.items():
        assert_parity(losses[path], plain_reference(path, 4), label=name)
    vocab = {**{name: kw["vocab_size"] for name, kw in MODELS.items()}, **{name: v for name, (_, v) in UNEVEN.items()}}
    for name, path in {**paths, **uneven}.items():
        assert grads[path]["placements"] == "(Shard(dim=0),)", (name, grads[path])
        hidden = 32
        for rank, found in enumerate(grads[path]["per_rank"]):
            for grad_numel, param_numel, diff in (found[:3], found[3:]):  # the embedding, the LM head
                assert grad_numel == param_numel == ROWS[vocab[name]][rank] * hidden, (name, rank, grad_numel)
                assert diff <= 1e-5, (name, rank, diff)
    # ``shardlm plan`` and ``estimate`` name each rank's rows; the estimate counts rank 0's, the most
    for name, path in uneven.items():
        assert estimate(path, tp=2).params_local == grads[path]["local"], name
        assert main(["estimate", path, "--tp", "2"]) == main(["plan", path, "--tp", "2"]) == 0
        out = capsys.readouterr().out
        assert "vocabulary: 253 rows in torch's chunks, 127 | 126 per TP rank" in out, out
        assert "253x32            127x32" in out and "rows 127 | 126 per rank (weight: 253" in out, out
