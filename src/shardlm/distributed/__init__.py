"""The process world: ``mesh`` (process groups, the dp_replicate x fsdp x tp DeviceMesh), ``launch``
(spawning ranks, torchrun, failures), ``shards`` (which rows of a tensor a rank holds, for every
placement), ``clip`` (the global gradient norm over every placement)."""
