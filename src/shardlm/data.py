"""Training samples and their order.

Documents are tokenized, an EOS appended to each, and turned into fixed-length samples of
``seq_len`` inputs with next-token labels (packed into one stream, or one padded document per
sample). The order is a function of the seed and the global batch size only, never of the
layout: step ``s`` takes positions ``s*G .. s*G+G-1`` of an endless stream of seeded
per-epoch permutations. Data-parallel rank ``r`` takes its ``per_device`` slice of each
micro-step; TP ranks of one group share a dp rank and so see the same batch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from shardlm.config import DataConfig
from shardlm.errors import ConfigError
from shardlm.loss import IGNORE_INDEX

log = logging.getLogger("shardlm")


@dataclass
class Batch:
    input_ids: torch.Tensor  # [batch, seq_len]
    labels: torch.Tensor  # [batch, seq_len]; IGNORE_INDEX where nothing is predicted

    def to(self, device: torch.device) -> Batch:
        return Batch(self.input_ids.to(device), self.labels.to(device))


@dataclass
class TokenDataset:
    input_ids: torch.Tensor  # [num_samples, seq_len]
    labels: torch.Tensor
    skipped_rows: int = 0
    truncated_rows: int = 0

    def __len__(self) -> int:
        return self.input_ids.shape[0]


def read_documents(path: str) -> tuple[list[str], int]:
    """Lines of a .txt file, one document each; returns (documents, empty lines skipped)."""
    with open(path, encoding="utf-8", errors="replace") as fh:
        lines = [line.rstrip("\n") for line in fh]
    docs = [line for line in lines if line.strip()]
    return docs, len(lines) - len(docs)


def tokenize_documents(docs: list[str], tokenizer) -> list[list[int]]:
    if tokenizer.eos_token_id is None:
        raise ConfigError("tokenizer: it has no eos_token; set one in the tokenizer files")
    encoded = tokenizer(docs, add_special_tokens=False)["input_ids"]
    return [ids + [tokenizer.eos_token_id] for ids in encoded]


def pack(token_docs: list[list[int]], seq_len: int) -> TokenDataset:
    """Concatenate documents and cut windows of ``seq_len + 1`` tokens (remainder dropped)."""
    stream = torch.tensor([t for doc in token_docs for t in doc], dtype=torch.long)
    n = (stream.numel() - 1) // seq_len
    if n < 1:
        return TokenDataset(torch.empty(0, seq_len, dtype=torch.long), torch.empty(0, seq_len, dtype=torch.long))
    windows = stream[: n * seq_len + 1]
    inputs = windows[:-1].view(n, seq_len)
    labels = windows[1:].view(n, seq_len)
    return TokenDataset(inputs.clone(), labels.clone())


def pad(token_docs: list[list[int]], seq_len: int, pad_id: int) -> TokenDataset:
    """One document per sample, truncated to ``seq_len + 1`` tokens, padding labelled IGNORE_INDEX."""
    inputs = torch.full((len(token_docs), seq_len), pad_id, dtype=torch.long)
    labels = torch.full((len(token_docs), seq_len), IGNORE_INDEX, dtype=torch.long)
    truncated = 0
    for i, doc in enumerate(token_docs):
        truncated += len(doc) > seq_len + 1
        doc = torch.tensor(doc[: seq_len + 1], dtype=torch.long)
        inputs[i, : len(doc) - 1] = doc[:-1]
        labels[i, : len(doc) - 1] = doc[1:]
    return TokenDataset(inputs, labels, truncated_rows=truncated)


def build_dataset(cfg: DataConfig, tokenizer) -> TokenDataset:
    docs, skipped = read_documents(cfg.path)
    token_docs = tokenize_documents(docs, tokenizer)
    if cfg.packing:
        ds = pack(token_docs, cfg.seq_len)
    else:
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        ds = pad(token_docs, cfg.seq_len, pad_id)
    ds.skipped_rows = skipped
    if len(ds) == 0:
        raise ConfigError(f"data.path: '{cfg.path}' gives no training sample of data.seq_len={cfg.seq_len} tokens")
    return ds


class GlobalBatchOrder:
    """Which samples form global batch ``step``: a function of seed and global batch size only."""

    def __init__(self, num_samples: int, global_batch: int, seed: int):
        self.num_samples, self.global_batch, self.seed = num_samples, global_batch, seed
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms = {epoch: torch.randperm(self.num_samples, generator=g)}
        return self._perms[epoch]

    def indices(self, step: int) -> list[int]:
        """Sample indices of global batch ``step`` (0-based), in a fixed order."""
        start = step * self.global_batch
        positions = range(start, start + self.global_batch)
        return [int(self._perm(p // self.num_samples)[p % self.num_samples]) for p in positions]


def micro_batch(
    ds: TokenDataset, order: GlobalBatchOrder, step: int, micro: int, dp_rank: int, dp_size: int, per_device: int
) -> Batch:
    """This data-parallel rank's share of accumulation micro-step ``micro`` of global batch ``step``."""
    start = (micro * dp_size + dp_rank) * per_device
    idx = torch.tensor(order.indices(step)[start : start + per_device])
    return Batch(ds.input_ids[idx], ds.labels[idx])
