"""Weights in and out: published checkpoint layouts read (``published``) and written back
(``published_write``), seeded random init block by block (``seeded_init``), filling a parallelized
model's local pieces (``fill``). Imports ``model/`` and ``plan/`` only."""
