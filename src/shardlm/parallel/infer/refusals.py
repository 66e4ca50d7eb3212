"""How the plan refuses a model it cannot split: one ``ConfigError`` line, module names written for every
block at once (``any_block``), ending in the one tail that says what trains the model instead.

``cannot_split``: "parallel.tp: <detail>; shardlm cannot split this model with tp > 1 yet, parallel.fsdp
trains it"; ``not_splittable``: "parallel.tp: <what>, which shardlm cannot split yet; parallel.fsdp trains it".
"""

from __future__ import annotations

import re

from shardlm.errors import ConfigError

FSDP_TRAINS_IT = "parallel.fsdp trains it"
CANNOT_SPLIT = f"shardlm cannot split this model with tp > 1 yet, {FSDP_TRAINS_IT}"


def any_block(text: str) -> str:
    """Module names in ``text`` with their block index as ``*`` (one reason for every block)."""
    return re.sub(r"(?<=[A-Za-z_])\.\d+(?=[.\s)]|$)", ".*", text)


def cannot_split(detail: str) -> ConfigError:
    """The refusal of a model for ``detail``, with the tail naming what trains it instead."""
    return ConfigError(f"parallel.tp: {detail}; {CANNOT_SPLIT}")


def not_splittable(what: str) -> ConfigError:
    """The refusal of a layer the styles cannot split (``what`` says which and how it is used)."""
    return ConfigError(f"parallel.tp: {what}, which shardlm cannot split yet; {FSDP_TRAINS_IT}")
