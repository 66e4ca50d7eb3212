"""Inferring the plan from one traced meta forward: the trace (``trace``, ``tracker`` and the
concepts it records: ``follow``, ``checks``, ``parts``, ``wholes``, ``meta_answers``, ``latent``,
``summed``, ``sizes``, ``layouts``), the placements it decides (``channels``, ``experts``), the
dry run (``dry_run``) and the plan itself with its refusals (``autotp``). Imports ``model/`` and
``plan/``, never ``runtime/`` or ``weights/``."""
