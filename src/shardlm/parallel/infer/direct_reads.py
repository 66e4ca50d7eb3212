"""Parameters used directly by another module's forward, where split layers sit under that module
(``Plan.direct_reads``; the runtime side: ``runtime/replicate.py: serve_direct_reads``).

Gemma 3n's decoder layer runs AltUp's ``predict`` and ``correct`` itself (not AltUp's forward): it
calls ``prediction_coefs`` but also clamps its weight in training, multiplies by
``correction_coefs.weight`` through ``F.linear``, and scales by AltUp's own ``correct_output_scale``
through ``self.forward``; ProphetNet's decoder looks up its predicting streams' positions with
``position_embeddings._forward`` and reads ``ngram_embeddings.weight`` by index. The owners' own
forwards never run there, so their styles' hooks never give the user local copies, and the user cannot
be ``replicate_local`` (``autotp._run_local``): its attention and MLP are split.

Such an owner is kept whole: its style is one of the replicated ones (``_WHOLE``), its parameters
``Replicate`` DTensors, and while the user runs they are local views of the whole copy on each rank,
as ``replicate_local`` gives its own (``LocalReplicate``). The trace already checked that they meet
only whole activations (a parameter meeting split ones is a violation, its sub-block kept whole), so
every rank computes the same whole gradient, as for any replicated parameter (under sequence
parallelism summed over TP with the other whole parameters of a block, ``plan/sequence.py``). The
matrix's "kept whole" column lists them with the model's property behind it (``properties.py``).
"""

from __future__ import annotations

import torch.nn as nn

from shardlm.parallel.infer.properties import model_property
from shardlm.parallel.infer.refusals import any_block
from shardlm.parallel.plan.plan import Plan
from shardlm.parallel.plan.styles import Style

# the owners kept whole whose parameters a user can compute on as local views: replicated on the TP mesh
# (``replicate`` becomes ``replicate_own`` where split layers sit under it: its own parameters still whole)
_WHOLE = (Style.REPLICATE, Style.REPLICATE_LOCAL, Style.REPLICATE_OWN)


def read_whole(model: nn.Module, plan: Plan, owner: str, user: str) -> bool:
    """Record in ``plan.direct_reads`` that ``user``'s forward reads ``owner``'s own parameters, kept
    whole, with the reason; False where ``owner`` is placed otherwise (split, or its gradients summed
    over TP): its parameters would not be whole on a rank."""
    if plan.styles.get(owner) not in _WHOLE:
        return False
    who = f"{any_block(user) or 'the model'} ({type(model.get_submodule(user)).__name__})"
    why = model_property(model, owner) or f"its parameters read directly by {who}, on whole activations"
    plan.direct_reads[owner] = (user, why)
    return True
