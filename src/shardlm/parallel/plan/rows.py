"""Rows and widths of split dims: which rows of a dim of parts each rank holds (``rank_rows``), one
rank's share of a width where parts are held whole (``local_width``), and the dim a per-channel
tensor acts along (``lead_dim``). Shared by the trace, the runtime styles and the estimate.
"""

from __future__ import annotations

import torch


def lead_dim(t: torch.Tensor) -> int:
    """The first dim of ``t`` longer than 1 (0 if none): the one a per-channel parameter acts along
    (Kimi-Linear's ``A_log`` of shape [1, 1, heads, 1]: dim 2), split with the channels it meets."""
    return next((d for d, n in enumerate(t.shape) if n > 1), 0)


def chunk_rows(n: int, tp: int) -> list[int]:
    """Rows each of ``tp`` ranks holds of a dim of ``n`` split as ``Shard`` splits it (``torch.chunk``): pieces
    of ``ceil(n / tp)``, the last ones shorter or empty. Uneven only for the vocabulary (GPT-2's 50257 at
    tp=2: 25129, 25128), the one split size tp need not divide (``autotp.holds_vocab_rows``)."""
    size = -(-n // tp)
    return [max(0, min(size, n - r * size)) for r in range(tp)]


def rank_rows(
    parts: tuple[int, ...] | list[int], rank: int, tp: int, whole: list[bool] | None = None
) -> list[tuple[int, int]]:
    """Rank's rows of a dim of ``parts`` (its chunk of every part; all of a part ``whole`` flags)."""
    out, offset = [], 0
    for p, held in zip(parts, whole or [False] * len(parts)):
        out.append((offset, offset + p) if held else (offset + rank * p // tp, offset + (rank + 1) * p // tp))
        offset += p
    return out


def local_width(parts: list[int], whole: list[bool], width: int, tp: int) -> int | None:
    """One rank's share of ``width`` where it is a run of consecutive ``parts`` with a part held whole
    (Mamba-2's ``conv_dim``, x|B|C: x/tp + B + C), None where no such run is that wide or one without
    a whole part is (then it is split like any width)."""
    found = set()
    for i in range(len(parts)):
        for j in range(i + 1, len(parts) + 1):
            if sum(parts[i:j]) == width:
                if not any(whole[i:j]):
                    return None
                found.add(sum(p if w else p // tp for p, w in zip(parts[i:j], whole[i:j])))
    return found.pop() if len(found) == 1 else None
