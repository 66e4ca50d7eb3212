"""Document packing (``data.packing_strategy: bfd``) against the same documents padded one per row.

The packer's windows are read back document by document (positions restart, boundary labels
IGNORE_INDEX, nothing cut that fits, every token once); a packed batch must give the loss and
the gradients of the padded batch in one process (fp32) and at tp=2 through the trainer; the rule
that refuses models is checked against the logits of every tested family.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import test_data
import torch
from families import TINY, VOCAB, family_config, write_tiny_dir
from helpers import load_checked, run_ranks, train_config

from shardlm.data.dataset import TokenDataset, build_dataset, pack_bfd, pad
from shardlm.data.packing import pack_documents
from shardlm.data.rows import IGNORE_INDEX
from shardlm.train.loss import token_loss_sum

SEQ = 16
PAD = -1  # not a token: padding is recognisable in the packer's output


def documents(n: int = 40, seed: int = 0, longest: int = 2 * SEQ + 3):
    """Flat ids/labels of ``n`` rows of random lengths (some longer than a window), a prompt of
    untrained tokens in front of every third row, and each row's length."""
    g = np.random.default_rng(seed)
    lengths = g.integers(2, longest, n)
    ids = g.integers(0, VOCAB, int(lengths.sum()))
    labels = ids.copy()
    start = 0
    for i, length in enumerate(lengths.tolist()):
        if i % 3 == 0:
            labels[start : start + length // 2] = IGNORE_INDEX
        start += length
    return ids, labels, lengths


def read_back(packed, pad_id: int = PAD) -> list[tuple[list[int], list[int]]]:
    """(inputs, labels) of every document of every window, cut where the positions restart."""
    out = []
    for x, y, pos in zip(packed.input_ids.tolist(), packed.labels.tolist(), packed.position_ids.tolist()):
        starts = [i for i, p in enumerate(pos) if p == 0] + [len(pos)]
        for a, b in zip(starts, starts[1:]):
            assert pos[a:b] == list(range(b - a))
            if b == len(pos) and set(x[a:]) == {pad_id} and set(y[a:]) == {IGNORE_INDEX}:
                continue  # the padding: one run to the end of the window, nothing trained
            out.append((x[a:b], y[a:b]))
    return out


def test_packer_keeps_documents_whole_and_apart():
    ids, labels, lengths = documents()
    packed = pack_documents(ids, labels, lengths, SEQ, PAD)
    expected = []
    start = 0
    for length in lengths.tolist():
        for off in range(0, length, SEQ):  # longer rows: SEQ-token pieces, each its own document
            n = min(SEQ, length - off)
            piece_ids, piece_labels = ids[start + off : start + off + n], labels[start + off : start + off + n]
            if (piece_labels[1:] != IGNORE_INDEX).any():
                expected.append((piece_ids.tolist(), piece_labels[1:].tolist() + [IGNORE_INDEX]))
        start += length
    got = read_back(packed)
    # every piece once, whole, in one window, its last label IGNORE_INDEX (no prediction across documents)
    assert sorted(got) == sorted(expected)
    assert all(y[-1] == IGNORE_INDEX for _, y in got)
    assert packed.split_rows == int((lengths > SEQ).sum()) > 0
    # best fit decreasing: no two windows' contents would fit into one
    fill = sorted(int((x != PAD).sum()) for x in packed.input_ids)
    assert fill[0] + fill[1] > SEQ
    again = pack_documents(ids, labels, lengths, SEQ, PAD)
    assert all(torch.equal(a, b) for a, b in zip(vars(packed).values(), vars(again).values()) if torch.is_tensor(a))


def test_bfd_build_dataset_round_trips_the_cache(tmp_path):
    """The default strategy through ``build_dataset``: windows of whole lines with their
    position ids, loaded back from the cache unchanged."""
    from transformers import AutoTokenizer

    from shardlm.config import DataConfig

    tok = AutoTokenizer.from_pretrained(str(test_data.TOKENIZER))
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(test_data.LINES * 3) + "\n")
    cfg = DataConfig(path=str(path), cache_dir=str(tmp_path / "cache"), seq_len=24)
    built, loaded = build_dataset(cfg, tok), build_dataset(cfg, tok)
    assert built.position_ids is not None and built.position_ids[:, 0].eq(0).all()
    for name in ("input_ids", "labels", "position_ids"):
        assert torch.equal(getattr(built, name), getattr(loaded, name)), name
    lines = [line for line in test_data.LINES * 3 if line.strip()]
    docs = [tok(line, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for line in lines]
    got = read_back(built, tok.pad_token_id)
    pieces = [d[i : i + 24] for d in docs for i in range(0, len(d), 24)]  # a 1-token piece trains nothing
    assert sorted(x for x, _ in got) == sorted(p for p in pieces if len(p) > 1)
    assert all(y == x[1:] + [IGNORE_INDEX] for x, y in got)
    assert built.truncated_rows == sum(len(d) > 24 for d in docs) > 0


# ---------------------------------------------------------------- the model honours the documents

GEMMA3 = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    sliding_window=4,  # shorter than the documents: the window and the document mask must combine
    layer_types=["sliding_attention", "full_attention"],
)
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "granite", "phi3", "gpt2", "gpt_neox", "opt", "falcon"]
FAMILIES += ["stablelm", "phi", "olmo", "olmo2", "gemma3"]


def tiny_model(family: str):
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(**GEMMA3) if family == "gemma3" else family_config(family, max_position_embeddings=64)
    if family == "gpt2":
        config = family_config(family)
    config.use_cache = False  # as parallel/build.py sets it: a cache turns transformers' packed detection off
    return AutoModelForCausalLM.from_config(config).float()


def apart_error(model) -> float:
    """Max |logits| difference between two documents packed in one row and each run alone."""
    g = torch.Generator().manual_seed(1)
    a, b = torch.randint(0, VOCAB, (1, 7), generator=g), torch.randint(0, VOCAB, (1, 9), generator=g)
    model.eval()
    with torch.no_grad():
        alone = torch.cat([model(input_ids=a).logits, model(input_ids=b).logits], dim=1)
        pos = torch.cat([torch.arange(7), torch.arange(9)])[None]
        packed = model(input_ids=torch.cat([a, b], dim=1), position_ids=pos).logits
    return float((packed - alone).abs().max())


FAST_HYBRIDS = ["mamba", "lfm3", "qwen3_5_text", "falcon_h1"]  # no position_ids; short conv; Gated DeltaNet; Mamba-2


@pytest.mark.parametrize("family", FAMILIES + FAST_HYBRIDS)
def test_refusal_rule_agrees_with_the_logits(tmp_path, family):
    """``packing_refusal`` (structure only) says yes exactly where packed logits equal separate ones."""
    _rule_agrees(tmp_path, family)


@pytest.mark.ranks
@pytest.mark.parametrize("family", sorted(set(TINY) - set(FAST_HYBRIDS)))
def test_refusal_rule_agrees_with_the_logits_hybrids(tmp_path, family):
    """The other hybrids (in the slow tier for their time: transformers' CPU fallback kernels, 3-11 s each)."""
    _rule_agrees(tmp_path, family)


def _rule_agrees(tmp_path, family: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardlm.train.document_mask import packing_refusal

    if family in TINY:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(write_tiny_dir(str(tmp_path), family)))
    else:
        model = tiny_model(family)
    error, refusal = apart_error(model), packing_refusal(model)
    assert (error < 1e-5) == (refusal is None), (family, error, refusal)


def test_refused_models_stop_before_spawning(tmp_path):
    """One line naming the key and the fix; ``wrapped`` and ``packing: false`` pass."""
    from shardlm import ConfigError

    data = tmp_path / "d.txt"
    data.write_text("a b c\n")
    for family in ("opt", "mamba"):
        path = str(tmp_path / family)
        if family in TINY:
            write_tiny_dir(path, family)
        else:
            family_config(family, max_position_embeddings=64).save_pretrained(path)
        raw = {"model": path, "data": {"path": str(data)}}
        with pytest.raises(ConfigError, match=r"^data\.packing_strategy: .*set data\.packing_strategy: wrapped"):
            load_checked(raw=raw)
        load_checked(raw=raw, overrides=["data.packing_strategy=wrapped"])
        load_checked(raw=raw, overrides=["data.packing=false"])
    with pytest.raises(ConfigError, match="data.packing_strategy must be bfd or wrapped"):
        load_checked(raw=raw, overrides=["data.packing_strategy=ffd"])


# ---------------------------------------------------------------- parity: packed windows == padded rows


def parity_data(seed: int = 0) -> tuple[TokenDataset, TokenDataset]:
    """The same documents (none longer than a window) packed, and padded one per row."""
    ids, labels, lengths = documents(n=12, seed=seed, longest=SEQ + 1)
    packed = pack_bfd(ids, labels, lengths, SEQ, 0)
    padded = pad(ids, labels, lengths, SEQ, 0)
    assert len(packed) < len(padded) and packed.truncated_rows == padded.truncated_rows == 0
    return packed, padded


def loss_and_grads(model, ds: TokenDataset):
    model.zero_grad()
    kwargs = {} if ds.position_ids is None else {"position_ids": ds.position_ids}
    logits = model(input_ids=ds.input_ids, **kwargs).logits
    loss = token_loss_sum(logits, ds.labels) / (ds.labels != IGNORE_INDEX).sum()
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "gpt2"])
def test_packed_equals_padded_one_process(family):
    """Same loss (rel 1e-5) and same gradient of every parameter (max |diff| <= 1e-5 * max |grad|;
    observed <= 3e-7 relative) in fp32, dropout off (the tiny families have none)."""
    packed, padded = parity_data()
    model = tiny_model(family).train()
    ref_loss, ref_grads = loss_and_grads(copy.deepcopy(model), padded)
    loss, grads = loss_and_grads(model, packed)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
    worst = max(float((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-12)) for n, g in ref_grads.items())
    assert worst <= 1e-5, (family, worst)
    # the check has teeth: the same windows without their position ids attend across documents
    _, crossed = loss_and_grads(model, TokenDataset(packed.input_ids, packed.labels))
    assert max(float((crossed[n] - g).abs().max() / g.abs().max()) for n, g in ref_grads.items()) > 1e-3


def _tp2_steps(paths: list[str], out: str) -> dict:
    """Rank body: per model, the eval loss and one trainer step at tp=2 on the packed documents."""
    from shardlm import Trainer, build_mesh, init_distributed, parallelize

    init_distributed()
    packed, _ = parity_data()
    result = {}
    for path in paths:
        cfg = train_config(path, {"tp": 2}, len(packed), 1, 1, output_dir=out)
        mesh = build_mesh(cfg.parallel)
        trainer = Trainer(parallelize(path, mesh, seed=cfg.train.seed), cfg, packed, mesh, eval_dataset=packed)
        evaluated = trainer.evaluate()["eval_loss"]
        record = trainer.train_step()
        result[path] = (record["loss"], record["grad_norm"], evaluated)
    return result


@pytest.mark.ranks
def test_packed_equals_padded_at_tp2(tmp_path):
    """tp=2 through the trainer on the packed windows: loss (1e-5) and grad_norm (1e-4 relative) of
    one step and the eval loss equal one process's on the padded rows (dropout off: the tiny
    families have none; Gemma 3 with its sliding window shorter than the documents)."""
    from transformers import Gemma3TextConfig

    paths = []
    for family in ("llama", "gemma3"):
        path = str(tmp_path / family)
        config = Gemma3TextConfig(**GEMMA3) if family == "gemma3" else family_config(family, max_position_embeddings=64)
        config.save_pretrained(path)
        paths.append(path)
    got = run_ranks(_tp2_steps, 2, paths, str(tmp_path / "out"))
    assert_equals_padded(got, paths)


def assert_equals_padded(got: dict, paths: list[str]) -> None:
    """Each path's (loss, grad_norm, eval loss) of packed windows in ``got`` against one process on the
    same documents padded one per row (``parity_data``): loss 1e-5, grad_norm 1e-4 relative."""
    from shardlm.parallel.weights.fill import reference_model

    _, padded = parity_data()
    for path in paths:
        model = reference_model(path, 0)
        model.config.use_cache = False
        loss, grads = loss_and_grads(model, padded)
        norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()])))
        got_loss, got_norm, got_eval = got[path]
        assert abs(got_loss - loss) <= 1e-5 * loss, (path, got_loss, loss)
        assert abs(got_eval - loss) <= 1e-5 * loss, (path, got_eval, loss)
        assert abs(got_norm - norm) <= 1e-4 * norm, (path, got_norm, norm)
