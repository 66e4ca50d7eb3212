"""Where sequence parallelism (``parallel.sequence_parallel``) changes a plan's activations, derived
from the plan itself (no table of module names), and what it cannot run yet.

Without it, the residual stream is replicated on every TP rank. With it, inside the decoder blocks
the stream is this rank's slice of the sequence (dim 1): the norms, residual adds and dropout
between a row-parallel output and the next column-parallel input compute on ``s / tp`` positions.
The whole sequence is gathered where column-parallel layers read the stream: at the entry of their
*sub-block* (the module holding them, which also reads the activation's shape to split heads:
attention, an MLP), or at the layer itself where it sits directly in the block (OPT's ``fc1``). The
sub-blocks of a parallel residual that read one norm's output share one gather (``Colwise``'s view).

A mixture-of-experts block (the module holding an ``experts`` module, its router kept whole beside it)
is gathered whole instead (``whole_entries``): it computes on the whole sequence as without SP, its
input gradient, summed over TP inside it, is sliced on the way back, and its output is sliced again.

Where nothing with parameters but a final norm sits outside the blocks (``stream_ends``: Llama, Qwen3,
Gemma 3, GPT-NeoX, Falcon, Phi), the stream is in its slices from the embedding to the LM head, as in
Megatron: the vocabulary-parallel embedding reduce-scatters its partial sums (instead of all-reducing
them), the final norm computes on the slices (its gradient summed over TP with the others'), and the LM
head's input is gathered as a column-parallel layer's (backward: reduce-scatter). Otherwise (learned
positions: GPT-2, OPT; a norm of the embeddings, a projection, a vision tower) the stream enters its
slices at the first block (the embeddings all-reduced, computed whole) and is gathered again after the
last one, so the final norm and the LM head (vocabulary-parallel, and so the loss) see the whole sequence.
"""

from __future__ import annotations

import torch.nn as nn

from shardlm.parallel.model.hf import looks_up_rows
from shardlm.parallel.model.meta import decoder_blocks
from shardlm.parallel.plan.plan import Plan
from shardlm.parallel.plan.styles import Style

# the column-parallel readers of the residual stream, whose sub-block gathers the sequence
_READERS = (Style.COLWISE, Style.PACKED_COLWISE)
# what may run inside a gathered sub-block: split layers, and parameters acting on split heads (their
# gradients partial already); a module kept whole there would add a whole gradient into the partial
# sum that the gather's reduce-scatter makes
_IN_SUB_BLOCK = (
    Style.COLWISE,
    Style.PACKED_COLWISE,
    Style.ROWWISE,
    Style.REPLICATE_GRAD_ALLREDUCE,
    Style.SHARDED_NORM,
)


def block_names(model: nn.Module) -> list[str]:
    """The FQNs of the decoder blocks, in order."""
    blocks = {id(b) for b in decoder_blocks(model)}
    return [name for name, m in model.named_modules() if id(m) in blocks]


def whole_entries(plan: Plan) -> list[str]:
    """The mixture-of-experts blocks: the parents of the ``experts`` modules, computed whole."""
    return sorted({fqn.rpartition(".")[0] for fqn, style in plan.styles.items() if style == Style.EXPERTS})


def _under(fqn: str, entries: list[str]) -> bool:
    return any(fqn == e or fqn.startswith(e + ".") for e in entries)


def sequence_entries(model: nn.Module, plan: Plan) -> list[str]:
    """The modules whose input is gathered over the sequence for column-parallel readers: the parent
    of each reader, or the reader itself where its parent is a decoder block; each once, none inside
    another, none inside a mixture-of-experts block (``whole_entries``)."""
    blocks, whole = set(block_names(model)), whole_entries(plan)
    entries: list[str] = []
    for fqn, style in plan.styles.items():
        if (style not in _READERS and fqn not in plan.sliced) or _under(fqn, whole):
            continue
        parent = fqn.rpartition(".")[0]
        entry = fqn if parent in blocks else parent
        if not _under(entry, entries):
            entries = [e for e in entries if not e.startswith(entry + ".")] + [entry]
    return entries


def scattered_rows(model: nn.Module, plan: Plan) -> set[str]:
    """The row-parallel layers whose output is reduce-scattered to the sequence slices (those of a
    mixture-of-experts block stay all-reduced: the block is sliced at its exit)."""
    whole = whole_entries(plan)
    return {f for f, s in plan.styles.items() if s == Style.ROWWISE and f not in plan.sliced and not _under(f, whole)}


def scattered_biases(model: nn.Module, plan: Plan) -> list[str]:
    """The biases of ``scattered_rows``: added to this rank's slice of the reduce-scattered output (as
    Megatron's row-parallel layers add theirs under sequence parallelism), so their gradients cover the
    slice and are summed over TP with the norms' (a LoRA base layer's is frozen: not its wrapper's own)."""
    rows = sorted(scattered_rows(model, plan))
    return [f"{f}.bias" for f in rows if "bias" in dict(model.get_submodule(f).named_parameters(recurse=False))]


def stream_ends(model: nn.Module, plan: Plan) -> tuple[str, str | None, str] | None:
    """(the input embedding, the final norm or None, the LM head) where the stream stays in its slices from
    the embedding's output to the LM head's input: the embedding is vocabulary-parallel on plain row
    lookups, the LM head vocabulary-parallel, and every other parameter outside the decoder blocks is one
    module's (the final norm: ``runtime/sequence.py`` checks that it runs after the blocks). None where
    anything else with parameters computes outside the blocks (learned positions, a norm of the
    embeddings, a projection, a tower): between the embedding and the first block it would meet the other
    ranks' positions, which a reduce-scattered embedding leaves at zero; so Megatron, which reduce-scatters
    the embedding only without position embeddings, and so here (module docstring)."""
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if emb is None or head is None or not looks_up_rows(emb):
        return None
    names = {id(m): fqn for fqn, m in model.named_modules()}
    ends = (names.get(id(emb)), names.get(id(head)))
    if plan.styles.get(ends[0]) != Style.EMBEDDING or plan.styles.get(ends[1]) != Style.LM_HEAD:
        return None
    blocks = block_names(model)
    owners = {n.rpartition(".")[0] for n, _ in model.named_parameters()} - set(ends)
    others = sorted(o for o in owners if not _under(o, blocks))
    return (ends[0], others[0] if others else None, ends[1]) if len(others) <= 1 else None


def sequence_refusal(model: nn.Module, plan: Plan) -> str | None:
    """Why ``plan`` cannot run with sequence parallelism (None: it can): what it holds that the
    sequence-sharded stream does not serve yet."""
    if not plan.styles:
        return "the model has no tensor-parallel plan"
    if plan.replicated:
        return f"{next(iter(plan.replicated))} stays replicated over TP ({next(iter(plan.replicated.values()))})"
    if plan.latent_readers or plan.summed:
        return "its mixers read low-rank latents or their own row-parallel output (MLA, Mamba-1)"
    mixers = [f for f, s in plan.styles.items() if s == Style.PER_CHANNEL]
    if mixers:
        return f"{mixers[0]} acts per channel in a recurrent or convolutional mixer"
    blocks = block_names(model)
    if not blocks:
        return "no repeated decoder blocks were found"
    for entry in sequence_entries(model, plan) + whole_entries(plan):
        if not any(entry.startswith(b + ".") for b in blocks):
            return f"{entry} reads the residual stream outside the decoder blocks' sub-blocks"
    for entry in sequence_entries(model, plan):
        for name, module in model.get_submodule(entry).named_modules():
            fqn = f"{entry}.{name}" if name else entry
            own = any(True for _ in module.parameters(recurse=False))
            if own and not _split(plan, [fqn, *_prefixes(fqn)]):  # LoRA's adapters: under their split layer
                return f"{fqn} is kept whole inside {entry}, whose input is gathered over the sequence"
    return None


def _split(plan: Plan, modules: list[str]) -> bool:
    """Whether one of ``modules`` is a split layer or acts on split heads (``_IN_SUB_BLOCK``)."""
    return any(plan.styles.get(m) in _IN_SUB_BLOCK or m in plan.sliced for m in modules)


def sequence_norms(model: nn.Module, plan: Plan) -> list[str]:
    """Parameters of modules kept whole inside the decoder blocks (norms, the gathered sub-blocks
    aside), and the final norm's where it runs on the slices (``stream_ends``): they compute on this
    rank's slice of the sequence, so their gradients are summed over TP."""
    inside = sequence_entries(model, plan) + whole_entries(plan)
    names = []
    for block in block_names(model):
        for name, _ in model.get_submodule(block).named_parameters():
            fqn = f"{block}.{name}"
            owners = _prefixes(fqn)  # the module owning it and its parents (a LoRA base layer's split layer)
            if _split(plan, owners) or any(o in inside for o in owners):
                continue
            names.append(fqn)
    ends = stream_ends(model, plan)
    if ends is not None and ends[1] is not None:  # the final norm on the slices
        names += [f"{ends[1]}.{name}" for name, _ in model.get_submodule(ends[1]).named_parameters()]
    return names


def _prefixes(fqn: str) -> list[str]:
    """``a.b.c`` -> ``["a.b", "a"]``: the modules above a parameter."""
    parts = fqn.split(".")[:-1]
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
