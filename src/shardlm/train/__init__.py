"""The training loop: ``loss`` (token-weighted, vocab-parallel), ``optim`` (AdamW/SGD, schedules),
``faults`` (SIGTERM, non-finite steps), ``metrics`` (progress, logs, the loss plot) and ``trainer``."""
