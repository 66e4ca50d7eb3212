"""Document-aware packing (``data.packing_strategy: bfd``): whole documents best-fit into windows.

Fine-tuning on packed windows must train what the documents padded one per row train: no token
may attend to, or be predicted from, another document. So each window carries per-token
``position_ids`` that restart at 0 at every document; transformers builds the block-diagonal
causal mask from them (``masking_utils.find_packed_sequence_indices``, used when no 2-D
attention mask and no cache are given, combined with sliding-window and chunked masks), and the
label of a document's last token, which would predict the next document's first token, is
IGNORE_INDEX. ``preflight.check_packing`` refuses the models whose forward cannot honour it.

Placement follows TRL's ``packing_strategy="bfd"`` (``trl/data_utils.py`` ``_pack_bfd``): documents
in order of decreasing length (ties in data order), each into the open window with the least room
that still holds it, else a new window; a segment tree over the free room finds that window in
``O(log seq_len)``. A document of up to ``seq_len`` tokens is never cut; a longer one is cut into
``seq_len``-token pieces, each its own document (the prediction across a cut is lost). Pieces with
no trained label are dropped. The rest of a window is padding: pad id, label IGNORE_INDEX and
positions restarting at 0 (a document of its own, so it is masked off the real ones).
The result is a function of the data alone, so the sample order stays ``GlobalBatchOrder``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shardlm.data.rows import IGNORE_INDEX


@dataclass
class Packed:
    input_ids: torch.Tensor  # [windows, seq_len]
    labels: torch.Tensor  # next-token labels, IGNORE_INDEX on each document's last token and on padding
    position_ids: torch.Tensor  # restart at 0 at every document (and at the padding)
    split_rows: int  # rows longer than seq_len, cut into pieces
    untrained_rows: int  # rows none of whose pieces has a trained label (dropped)


def pieces(labels: np.ndarray, lengths: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(start, length) of every document piece with a trained label, and the number of rows left without one."""
    row_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    starts, sizes, rows = [], [], []
    for row, (start, length) in enumerate(zip(row_starts.tolist(), lengths.tolist())):
        for off in range(0, length, seq_len):
            starts.append(start + off)
            sizes.append(min(seq_len, length - off))
            rows.append(row)
    starts, sizes, rows = (np.asarray(x, dtype=np.int64) for x in (starts, sizes, rows))
    # a piece trains labels[start+1 : start+size] (its own next tokens): count them with one cumsum
    trained = np.concatenate([[0], np.cumsum(labels != IGNORE_INDEX)])
    keep = (trained[starts + sizes] - trained[np.minimum(starts + 1, starts + sizes)]) > 0
    untrained = len(lengths) - len(np.unique(rows[keep]))
    return starts[keep], sizes[keep], untrained


class _FreeRoom:
    """Segment tree over free room 0..seq_len: leaf ``r`` holds ``r`` while some window has exactly
    ``r`` tokens free (0 otherwise), inner nodes the max; ``fit(n)`` is the least free room >= n."""

    def __init__(self, seq_len: int):
        self.size = 1 << seq_len.bit_length()  # at least seq_len + 1 leaves
        self.tree = [0] * (2 * self.size)
        self.windows: dict[int, list[int]] = {}

    def _set(self, room: int, value: int) -> None:
        i = room + self.size
        self.tree[i] = value
        while i > 1:
            i //= 2
            self.tree[i] = max(self.tree[2 * i], self.tree[2 * i + 1])

    def add(self, window: int, room: int) -> None:
        if room > 0:
            self.windows.setdefault(room, []).append(window)
            self._set(room, room)

    def take(self, n: int) -> tuple[int, int] | None:
        """Remove and return (window, room) of a window with the least free room >= n, or None."""
        if self.tree[1] < n:
            return None
        i = 1
        while i < self.size:
            i = 2 * i if self.tree[2 * i] >= n else 2 * i + 1
        room = i - self.size
        stack = self.windows[room]
        window = stack.pop()
        if not stack:
            self._set(room, 0)
        return window, room


def place(sizes: np.ndarray, seq_len: int) -> list[list[int]]:
    """Best-fit decreasing: the pieces (indices into ``sizes``) of each window, in window order."""
    windows: list[list[int]] = []
    free = _FreeRoom(seq_len)
    for piece in np.argsort(-sizes, kind="stable").tolist():
        n = int(sizes[piece])
        found = free.take(n)
        if found is None:
            windows.append([piece])
            free.add(len(windows) - 1, seq_len - n)
        else:
            window, room = found
            windows[window].append(piece)
            free.add(window, room - n)
    return windows


def pack_documents(ids: np.ndarray, labels: np.ndarray, lengths: np.ndarray, seq_len: int, pad_id: int) -> Packed:
    """Rows (``lengths`` of the flat ``ids``/``labels``) packed into windows of ``seq_len`` inputs."""
    starts, sizes, untrained = pieces(labels, lengths, seq_len)
    windows = place(sizes, seq_len)
    inputs = torch.full((len(windows), seq_len), pad_id, dtype=torch.long)
    targets = torch.full((len(windows), seq_len), IGNORE_INDEX, dtype=torch.long)
    positions = torch.zeros((len(windows), seq_len), dtype=torch.long)
    ids_t, labels_t = torch.from_numpy(ids), torch.from_numpy(labels)
    for w, members in enumerate(windows):
        off = 0
        for piece in members:
            start, n = int(starts[piece]), int(sizes[piece])
            inputs[w, off : off + n] = ids_t[start : start + n]
            targets[w, off : off + n - 1] = labels_t[start + 1 : start + n]  # the last one stays IGNORE_INDEX
            positions[w, off : off + n] = torch.arange(n)
            off += n
        positions[w, off:] = torch.arange(seq_len - off)  # padding: a document of its own
    split = int((lengths > seq_len).sum())
    return Packed(inputs, targets, positions, split_rows=split, untrained_rows=untrained)
