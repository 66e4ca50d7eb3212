"""``shardlm estimate``: peak memory per rank before anything is allocated (``memory``), with the
activations of linear-attention mixers (``mixers``), state-space scans (``scans``) and
mixture-of-experts layers (``moe``) counted from their parameters."""

from shardlm.estimate.memory import estimate
from shardlm.estimate.rows import Estimate
from shardlm.estimate.table import format_table

__all__ = ["Estimate", "estimate", "format_table"]
