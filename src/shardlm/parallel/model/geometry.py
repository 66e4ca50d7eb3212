"""The model's geometry, read once from its config: the sizes every wing asks about.

``read_geometry`` builds a ``Geometry`` from a Hugging Face config (or any object with the same
attributes: a plain namespace in the tests): the sizes under the names each family uses
(``hf.CONFIG_NAMES``), the head widths of every layer (Gemma 4's per-layer ``head_dim``), and
the head dim derived in ONE way, so the plan's row slicing, the local head counts after TP and the
estimate cannot disagree about it: the smallest head width of the model's attention layers, the
config's ``head_dim`` (or its per-layer values), else ``hidden_size // num_attention_heads``.
The plan stores it (``Plan.geometry``); the trace, ``localize_geometry`` and the estimator read it there.
Router jitter and expert counts stay direct reads of the config (``infer/experts.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardlm.parallel.model.hf import config_size, geometry, head_widths


@dataclass(frozen=True)
class Geometry:
    """Sizes of one model (None: the config has no such size; a pure state-space model has no heads)."""

    hidden: int | None = None
    heads: int | None = None  # query heads
    kv_heads: int | None = None  # key/value heads as the config says (None: as many as ``heads``)
    head_dim: int | None = None  # the one derivation (module docstring)
    intermediate: int | None = None
    layers: int | None = None
    vocab: int | None = None
    ssm_groups: int | None = None  # a Mamba-2 mixer's B/C groups
    ssm_chunk: int | None = None  # its scan chunk
    head_widths: frozenset[int] = field(default_factory=frozenset)  # of the attention layers, per layer
    # the sizes TP must divide that this config has (``hf.SPLIT_SIZES``), under their config names
    split_sizes: dict[str, int] = field(default_factory=dict)

    @property
    def kv(self) -> int | None:
        """Key/value heads, as many as the query heads where the config names none."""
        return self.kv_heads or self.heads


def read_geometry(config) -> Geometry:
    """The ``Geometry`` of ``config`` (see the module docstring)."""
    heads = config_size(config, "num_attention_heads")
    widths = head_widths(config) if heads else set()  # a model without attention heads has no head widths
    size = {key: config_size(config, key) for key in ("hidden_size", "intermediate_size", "num_hidden_layers")}
    return Geometry(
        hidden=size["hidden_size"],
        heads=heads,
        kv_heads=config_size(config, "num_key_value_heads"),
        head_dim=min(widths) if widths else None,
        intermediate=size["intermediate_size"],
        layers=size["num_hidden_layers"],
        vocab=config_size(config, "vocab_size"),
        ssm_groups=config_size(config, "ssm_groups"),
        ssm_chunk=config_size(config, "ssm_chunk"),
        head_widths=frozenset(widths),
        split_sizes=geometry(config),
    )
