"""The DTensor styles a plan is applied with: linear (``linear``), replicated (``replicate``),
experts (``experts``), per-channel (``channels``), plan words -> styles (``plan_styles``), EP
dispatch (``ep``), LoRA (``lora``), dropout masks (``dropout``), the TP-partial gradient sums
(``grads``) and the collectives, named once (``regions``). Imports ``model/`` and ``plan/``,
never ``infer/`` or ``weights/``."""
