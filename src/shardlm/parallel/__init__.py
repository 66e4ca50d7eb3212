"""Turning a Hugging Face model into a TP x FSDP2 model: ``hf`` (what is read off the model),
``plan`` and ``autotp`` (the plan, derived from a traced forward), ``tp`` (the DTensor styles),
``lora`` (peft adapters on split layers), ``dropout`` (masks every layout agrees on),
``seeded_init`` (random init block by block) and ``build`` (meta -> TP -> FSDP2 -> weights)."""
