"""Which tokens of a window a context-parallel rank holds: head-tail load balancing.

Under context parallelism (``parallel.cp``) every window of ``seq_len`` tokens is cut into
``2 * cp`` equal chunks and rank ``r`` of the cp group holds chunks ``r`` and ``2cp-1-r``. Causal
attention makes a query's work grow with its position, so a plain split (rank ``r`` holding the
``r``-th ``seq_len / cp`` tokens) would leave the last rank with most of it; pairing a chunk from the
head with one from the tail gives every rank the same number of (query, key) pairs (torchtitan's and
Megatron's load balancing).

The input ids, the position ids and the labels are cut alike. The labels are already shifted
(``data/rows.py``: label ``i`` is the token after input ``i``), so each rank's loss is over its
own tokens and nothing crosses a chunk boundary. The position ids are the global ones (restarting at
each packed document): the rank's chunk keeps its rotary positions, and the attention mask is built
from all of them (``parallel/runtime/context.py``).
"""

from __future__ import annotations

import torch

from shardlm.data.dataset import Batch


def chunk_index(seq_len: int, cp: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """The positions in the window (0-based) of the tokens rank ``rank`` of ``cp`` holds, in the
    order it holds them: chunk ``rank`` then chunk ``2cp-1-rank``."""
    if seq_len % (2 * cp):
        raise ValueError(f"a window of {seq_len} tokens does not split into 2*cp={2 * cp} equal chunks")
    size = seq_len // (2 * cp)
    head = torch.arange(rank * size, (rank + 1) * size, device=device)
    tail = torch.arange((2 * cp - 1 - rank) * size, (2 * cp - rank) * size, device=device)
    return torch.cat([head, tail])


def window_positions(batch: Batch) -> torch.Tensor:
    """The position ids of every token of ``batch``'s windows: its own (packed documents), else
    ``0..seq_len-1`` as the model would make them."""
    if batch.position_ids is not None:
        return batch.position_ids
    batch_size, seq_len = batch.input_ids.shape
    return torch.arange(seq_len, device=batch.input_ids.device).expand(batch_size, seq_len)


def split_batch(batch: Batch, index: torch.Tensor) -> Batch:
    """This rank's tokens of ``batch`` (``index``: ``chunk_index``), position ids always given."""
    return Batch(batch.input_ids[:, index], batch.labels[:, index], window_positions(batch)[:, index])
