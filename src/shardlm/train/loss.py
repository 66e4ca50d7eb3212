"""Token-weighted cross-entropy, computed on vocabulary shards when the LM head is TP-sharded.

The loss of an optimizer step is ``sum of token losses / number of labels != IGNORE_INDEX``
over the *whole global batch*: every data-parallel rank and every accumulation micro-step.
Each micro-step therefore backpropagates ``local_sum / global_count`` and data-parallel
gradients are summed (FSDP2 divide factor 1), which gives exactly the gradient one process
would compute on the global batch, whatever the padding per rank. Averaging per-rank means
instead would weight a rank's tokens by how many other tokens it happened to hold.

With sharded logits (the LM head's ``Shard(-1)`` DTensor) the cross-entropy is the vocabulary-parallel
one of ``parallel/runtime/cross_entropy.py`` on the local logits: max, sum-exp and the target logit are
all-reduced over the TP group, so full logits are never gathered. Ignored tokens contribute neither loss
nor gradient; a micro-batch with no real labels adds exactly 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardlm.data.rows import IGNORE_INDEX
from shardlm.parallel.runtime.cross_entropy import is_vocab_sharded, vocab_parallel_token_losses


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of per-token cross-entropy over labels != IGNORE_INDEX, in fp32.

    ``logits``: ``[..., vocab]`` (plain or the vocab-sharded DTensor of a TP-sharded head); ``labels``:
    ``[...]``, already aligned with the logits (next-token shift done by the data pipeline). A plain tensor
    either way.
    """
    if is_vocab_sharded(logits):
        return vocab_parallel_token_losses(logits, labels, IGNORE_INDEX).sum()
    flat = logits.reshape(-1, logits.shape[-1]).float()
    return F.cross_entropy(flat, labels.reshape(-1), reduction="sum", ignore_index=IGNORE_INDEX)
