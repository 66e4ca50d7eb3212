"""Inferring the plan from one traced meta forward: the trace (``trace``, its module hooks
``trace_hooks`` and what it found ``trace_result``; ``tracker`` and the concepts it records:
``follow``, ``checks``, ``parts``, ``wholes``, ``meta_answers``, ``latent``, ``summed``, ``sizes``,
``layouts``), the placements it decides (``channels``, ``experts``), the dry run (``dry_run``), the
refusals (``refusals``) and the plan itself (``autotp``). Imports ``model/`` and ``plan/``, never
``runtime/`` or ``weights/``."""
