"""``shardlm estimate``: peak memory per rank before anything is allocated (``memory``), with the
activations of linear-attention mixers (``mixers``), state-space scans (``scans``) and
mixture-of-experts layers (``moe``) counted from their parameters."""

from shardlm.estimate.memory import Estimate, estimate, format_table

__all__ = ["Estimate", "estimate", "format_table"]
