"""Token-weighted cross-entropy, computed on vocabulary shards when the LM head is TP-sharded.

The loss of an optimizer step is ``sum of token losses / number of labels != IGNORE_INDEX``
over the *whole global batch*: every data-parallel rank and every accumulation micro-step.
Each micro-step therefore backpropagates ``local_sum / global_count`` and data-parallel
gradients are summed (FSDP2 divide factor 1), which gives exactly the gradient one process
would compute on the global batch, whatever the padding per rank. Averaging per-rank means
instead would weight a rank's tokens by how many other tokens it happened to hold.

With sharded logits (a DTensor ``Shard(-1)``) the cross-entropy runs under torch's
``loss_parallel``: max and sum-exp are all-reduced over the TP group and the target logit
comes from the rank that owns it, so full logits are never gathered. Ignored tokens
contribute neither loss nor gradient; a micro-batch with no real labels adds exactly 0.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.distributed.tensor.parallel import loss_parallel

from shardlm.data.rows import IGNORE_INDEX


def loss_context(vocab_sharded: bool):
    """Context for the loss forward *and* backward (``loss_parallel`` must cover both)."""
    return loss_parallel() if vocab_sharded else nullcontext()


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of per-token cross-entropy over labels != IGNORE_INDEX, in fp32.

    ``logits``: ``[..., vocab]`` (plain or vocab-sharded DTensor); ``labels``: ``[...]``,
    already aligned with the logits (next-token shift done by the data pipeline).
    Call inside ``loss_context(isinstance(logits, DTensor))``.
    """
    flat = logits.reshape(-1, logits.shape[-1]).float()
    return F.cross_entropy(flat, labels.reshape(-1), reduction="sum", ignore_index=IGNORE_INDEX)
