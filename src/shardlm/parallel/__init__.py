"""Turning a Hugging Face model into a TP x FSDP2 model, in wings imported one way
(``model < plan < {infer | runtime | weights} < build``; ``tests/test_architecture.py`` enforces it):

``model/``    what is read off the model and its config (sizes, module facts, the meta build, experts)
``plan/``     the plan as data (``Plan``, the style table, rows, the ``shardlm plan`` table)
``infer/``    the plan derived from one traced meta forward, the dry run, the refusals
``runtime/``  the DTensor styles a plan is applied with, LoRA, dropout masks, EP, gradient sums
``weights/``  published checkpoint layouts in and out, seeded init, filling the local pieces
``build``     meta -> TP -> FSDP2 -> weights (``parallelize``)

Inference and the runtime never import each other: they meet only in ``build``."""
