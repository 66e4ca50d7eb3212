"""Published checkpoint layouts (issue 15): checkpoints written by transformers' own
``save_pretrained`` in the names real checkpoints use are loaded through transformers' conversion
rules, shard by shard, and consolidated back to the same files.

Layouts, each a tiny model written by ``save_pretrained``:
- rename: GPT-NeoX (Pythia's ``embed_out.weight``; ``lm_head.weight`` in memory), EXAONE
  (``transformer.h.*.attn.attention.*`` -> ``model.layers.*.self_attn.*`` and more);
- prefix change: Qwen3.5 text (``model.language_model.*``; written as transformers writes a model
  it loaded from that layout: ``_weight_conversions`` set, as ``from_pretrained`` sets it); and a
  Qwen3.5 checkpoint as published: ``Qwen3_5ForConditionalGeneration``'s config (``text_config``:
  Gated DeltaNet and attention layers) and files, whose vision tower (``model.visual.*``) the causal
  LM neither reads nor writes back (``UNUSED``);
- merge + concatenate: Mixtral's per-expert ``w1``/``w3``/``w2`` and Qwen3-MoE's
  ``gate_proj``/``up_proj``/``down_proj`` -> fused ``gate_up_proj`` / ``down_proj`` (split by TP on
  the intermediate dim, gate and up halves each on its own, and by FSDP (Mixtral: by expert
  parallelism) on the expert dim);
- chunk and concatenate across a TP split: rules registered for a Llama through transformers'
  public ``register_checkpoint_conversion_mapping`` (no causal LM of transformers 5.24 that shardlm
  splits with TP uses them), ``llama_rules``; ``Interleave`` (read whole) in one process.

Trained one step at learning rate 0 (weights unchanged, bit for bit) at tp=2 x fsdp=2 (one 4-rank
spawn; tp=2 alone covers nothing it does not), each saved and consolidated: the consolidated files
hold the original files' names, shapes and bits, and ``from_pretrained`` reports no missing or
unexpected keys. Process-free: the name mapping, each rule kind's boxes against transformers' own
converter, the refusal before spawning, and which layout consolidation writes (Qwen3.5 from random
init and from a checkpoint).
"""

from __future__ import annotations

import math
import os
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from families import VOCAB, family_config
from helpers import run_ranks, token_dataset, train_config

from shardlm.checkpoint.output import CHECK_MESSAGE
from shardlm.cli import main
from shardlm.parallel.model.meta import build_meta_model
from shardlm.parallel.weights import published, published_write


def check(path: str) -> published.Layout:
    return published.check(path, build_meta_model(path))


REPO = Path(__file__).resolve().parents[1]


def _configs() -> dict:
    import transformers as tf

    small = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    return {
        "gpt_neox": (family_config("gpt_neox"), False),
        "exaone": (
            tf.ExaoneConfig(**small, intermediate_size=64, bos_token_id=0, eos_token_id=0, pad_token_id=0),
            False,
        ),
        "qwen3_5_text": (
            tf.Qwen3_5TextConfig(
                **small, head_dim=8, intermediate_size=64, layer_types=["full_attention", "full_attention"]
            ),
            True,
        ),
        "mixtral": (tf.MixtralConfig(**small, intermediate_size=16, num_local_experts=4), False),
        "qwen3_moe": (
            tf.Qwen3MoeConfig(
                **small,
                head_dim=8,
                intermediate_size=64,
                moe_intermediate_size=16,
                num_experts=4,
                num_experts_per_tok=2,
            ),
            False,
        ),
        "llama_rules": (family_config("llama"), False),  # with REGISTERED_RULES
        # a published Qwen3.5 checkpoint as it is: the multimodal model's config (text_config with Gated
        # DeltaNet and attention layers) and files (``model.language_model.*``, ``model.visual.*``)
        "qwen3_5": (
            tf.Qwen3_5Config(
                architectures=["Qwen3_5ForConditionalGeneration"],
                text_config=dict(
                    **small,
                    head_dim=8,
                    intermediate_size=64,
                    layer_types=["linear_attention", "full_attention"],
                    linear_num_key_heads=2,
                    linear_num_value_heads=4,
                    linear_key_head_dim=8,
                    linear_value_head_dim=8,
                ),
                vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32),
            ),
            False,
        ),
    }


def _llama_rules() -> list:
    """Rules no tiny causal LM above has, for a Llama: ``Chunk`` (one published ``gate_up`` -> the
    column-parallel gate/up projections) and ``Concatenate`` along the columns (two published
    halves -> ``q_proj``, whose rows TP splits: each rank reads a box of both halves)."""
    from transformers.core_model_loading import Chunk, Concatenate, WeightConverter

    return [
        WeightConverter("mlp.gate_up.weight", ["mlp.gate_proj.weight", "mlp.up_proj.weight"], [Chunk(dim=0)]),
        WeightConverter(["self_attn.q_a.weight", "self_attn.q_b.weight"], "self_attn.q_proj.weight", [Concatenate(1)]),
    ]


REGISTERED_RULES = {"llama_rules": ("LlamaForCausalLM", _llama_rules)}


@contextmanager
def registered(name: str, rules=None):
    """Rules registered through transformers' public ``register_checkpoint_conversion_mapping``
    for the block (in this process; each rank registers its own), then removed."""
    from transformers import conversion_mapping as cm

    if name not in REGISTERED_RULES and rules is None:
        yield
        return
    cls, make = REGISTERED_RULES.get(name, (name, None))
    cm.register_checkpoint_conversion_mapping(cls, rules if rules is not None else make())
    try:
        yield
    finally:
        cm._checkpoint_conversion_mapping_cache.pop(cls)
        cm.USER_REGISTERED_MAPPINGS.discard(cls)


# what the published files hold and the model does not (and the other way round)
ON_DISK = {
    "gpt_neox": ("embed_out.weight", "lm_head.weight"),
    "exaone": ("transformer.h.0.attn.attention.out_proj.weight", "model.layers.0.self_attn.o_proj.weight"),
    "qwen3_5_text": ("model.language_model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight"),
    "mixtral": ("model.layers.0.block_sparse_moe.experts.3.w3.weight", "model.layers.0.mlp.experts.gate_up_proj"),
    "qwen3_moe": ("model.layers.1.mlp.experts.3.gate_proj.weight", "model.layers.1.mlp.experts.gate_up_proj"),
    "llama_rules": ("model.layers.1.self_attn.q_b.weight", "model.layers.1.mlp.up_proj.weight"),
    "qwen3_5": ("model.language_model.layers.0.linear_attn.A_log", "model.layers.0.linear_attn.A_log"),
}
# what the published files hold that the causal LM trained from them does not: Qwen3.5's vision tower
UNUSED = {"qwen3_5": "model.visual."}


def trained_files(name: str, files: dict) -> dict:
    """The files' tensors that the causal LM trains (and consolidation writes back): all but ``UNUSED``."""
    return {k: v for k, v in files.items() if not (name in UNUSED and k.startswith(UNUSED[name]))}


# every model at tp=2 x fsdp=2, in one 4-rank job (tp=2 alone exercises nothing this does not);
# Mixtral's experts divided by expert parallelism instead of FSDP (ep carved out of fsdp=2): rank 0
# holds the same experts (0 and 1) and reads the same rows either way
LAYOUT = {"tp": 2, "fsdp": 2}
LAYOUTS = {"mixtral": {"tp": 2, "fsdp": 2, "ep": 2}}


def write_published(path: str, name: str, loaded_from_published: bool | None = None) -> str:
    """``save_pretrained`` of a seeded tiny model of ``name``, in the layout transformers writes
    (``loaded_from_published`` False: as it writes a new model, whatever ``_configs`` says)."""
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.conversion_mapping import get_model_conversion_mapping

    config, published_layout = _configs()[name]
    loaded_from_published = published_layout if loaded_from_published is None else loaded_from_published
    torch.manual_seed(0)
    with registered(name):
        # the class the checkpoint was published from (Qwen3.5's multimodal one), else the causal LM
        cls = getattr(transformers, config.architectures[0]) if config.architectures else AutoModelForCausalLM
        model = cls._from_config(config) if config.architectures else cls.from_config(config)
        if loaded_from_published:  # what from_pretrained leaves on a model loaded from the prefixed layout
            model._weight_conversions = get_model_conversion_mapping(model, add_legacy=False)
        model.save_pretrained(path)
    return path


def _files(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(f for f in os.listdir(path) if f.endswith(".safetensors")):
        out.update(load_file(os.path.join(path, file)))
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("published")
    return {name: write_published(str(root / name), name) for name in _configs()}


def test_names_map_through_transformers_rules(models):
    for name, path in models.items():
        disk, memory = ON_DISK[name]
        assert disk in published.header(path) and memory not in published.header(path), name
        with registered(name):
            layout = check(path)  # covers the model with its shapes
        assert memory in layout.by_key, name
        assert all(k.startswith(UNUSED.get(name, "\0")) for k in layout.unexpected), (name, layout.unexpected[:3])
        assert layout.used, name
    kinds = published.describe(check(models["mixtral"]))
    assert kinds == {"rename": 17, "boxes": 4}  # 2 layers x (gate_up_proj, down_proj) from 24 per-expert tensors


def test_consolidation_writes_the_layout_the_weights_came_from(models, tmp_path):
    """What consolidation writes for Qwen3.5 text, whose published checkpoints are prefixed
    (``model.language_model.*``) and whose ``save_pretrained`` of a new model is not (it drops the
    ``PrefixChange`` of a model it did not load): from random init (no layout recorded), what
    ``save_pretrained`` writes for a new model, ``model.*``; from the published checkpoint, that
    layout; from a ``model.*`` checkpoint, ``model.*`` again (no rule matched, none reversed), as
    ``save_pretrained`` does after ``from_pretrained``. Names and shapes, headers only."""
    prefixed = models["qwen3_5_text"]
    plain = write_published(str(tmp_path / "plain"), "qwen3_5_text", loaded_from_published=False)
    shapes = published.untied_shapes(build_meta_model(prefixed))
    for case, (weights, expected) in {
        "random": (None, plain),
        "prefixed": (prefixed, prefixed),
        "plain": (plain, plain),
    }.items():
        hf = tmp_path / f"hf-{case}"
        hf.mkdir()
        (hf / "config.json").write_bytes((Path(prefixed) / "config.json").read_bytes())
        if weights is not None:  # what every checkpoint of a run from weights records (checkpoint/layout.py)
            published_write.record_layout(weights, str(hf), build_meta_model(weights))
        unpack = published_write.PublishedUnpack(str(hf), build_meta_model(str(hf)), lambda k, t: {k: t})
        want = {k: v[0] for k, v in published.header(expected).items()}
        assert unpack.published_shapes(shapes) == want, case
    assert any(k.startswith("model.language_model.") for k in published.header(prefixed))
    assert not any(k.startswith("model.language_model.") for k in published.header(plain))


def _converter_cases():
    from transformers.core_model_loading import Chunk, Concatenate, MergeModulelist, Split, WeightConverter

    g = torch.Generator().manual_seed(0)
    experts = {f"m.experts.{e}.{w}.weight": torch.randn(6, 4, generator=g) for e in range(3) for w in ("w1", "w3")}
    return {
        "merge+concatenate": (
            WeightConverter(
                [".experts.*.w1.weight", ".experts.*.w3.weight"],
                ".experts.gate_up_proj",
                [MergeModulelist(dim=0), Concatenate(dim=1)],
            ),
            "m.experts.gate_up_proj",
            experts,
        ),
        "merge": (
            WeightConverter(".experts.*.w1.weight", ".experts.down_proj", [MergeModulelist(dim=0)]),
            "m.experts.down_proj",
            {k: v for k, v in experts.items() if ".w1." in k},
        ),
        "concatenate": (
            WeightConverter(["a.q.weight", "a.k.weight", "a.v.weight"], "a.qkv.weight", [Concatenate(dim=0)]),
            "x.a.qkv.weight",
            {
                "x.a.q.weight": torch.randn(4, 3, generator=g),
                "x.a.k.weight": torch.randn(2, 3, generator=g),
                "x.a.v.weight": torch.randn(2, 3, generator=g),
            },
        ),
        "chunk": (
            WeightConverter("w12.weight", ["gate.weight", "up.weight"], [Chunk(dim=0)]),
            "x.gate.weight",
            {"x.w12.weight": torch.randn(8, 3, generator=g)},
        ),
        "split": (
            WeightConverter("in_proj.weight", ["in_qkv.weight", "in_z.weight"], [Split(dim=1)]),
            "x.in_qkv.weight",
            {"x.in_proj.weight": torch.randn(3, 7, generator=g)},
        ),
    }


@pytest.mark.parametrize("kind", ["merge+concatenate", "merge", "concatenate", "chunk", "split"])
def test_boxes_equal_transformers_converter(kind):
    """Each source placed by its boxes (``_pieces``, ``_local_boxes``: how a rank reads) gives
    exactly what transformers' own converter gives on the whole tensors."""
    from transformers.core_model_loading import dot_natural_key

    converter, key, tensors = _converter_cases()[kind]
    model = torch.nn.Module()  # Split sizes its parts from the model's parameters
    model.x = torch.nn.Module()
    model.x.in_qkv, model.x.in_z = torch.nn.Linear(5, 3, bias=False), torch.nn.Linear(2, 3, bias=False)
    model.config = None
    unit = published.Unit(key, converter, {}, kind="convert")
    for name in sorted(tensors, key=dot_natural_key):
        renamed, pattern = converter.rename_source_key(name)
        assert pattern is not None and renamed == key, (name, renamed)
        unit.sources.setdefault(pattern, []).append(name)
    expected = published._run_converter(unit, model, tensors)
    unit.outputs = {k: tuple(v.shape) for k, v in expected.items()}
    available = {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}
    pieces = published._pieces(unit, available)
    assert pieces is not None and set(pieces) == set(expected)
    for out, want in expected.items():
        got = torch.full_like(want, float("nan"))
        for piece in pieces[out]:
            for offsets, view in published._local_boxes(got, piece):
                box = tensors[piece.source]
                for dim, (start, length) in enumerate(zip(offsets, view.shape)):
                    box = box.narrow(dim, start, length)
                view.copy_(box)
        assert torch.equal(got, want), (kind, out)


def _train_yaml(path: Path, model: str, output_dir: Path) -> Path:
    path.write_text(
        f"model: {model}\ntokenizer: {REPO / 'examples' / 'tiny-llama'}\n"
        f"data:\n  path: {REPO / 'examples' / 'data' / 'corpus.txt'}\n  seq_len: 16\n"
        f"parallel: {{tp: 2}}\ntrain:\n  output_dir: {output_dir}\n  max_steps: 1\n"
    )
    return path


def test_refused_before_spawning(models, tmp_path, capsys):
    """Names that, converted, do not cover the model: one line naming the first gap, in memory and
    as the checkpoint stores it (the absent tensor), exit 2, no rank."""
    from safetensors.torch import save_file

    cases = {
        "gpt_neox": (
            ("embed_out.weight",),
            "lacks weights for lm_head.weight (stored as embed_out.weight in this layout) (and 0 more)",
        ),
        "mixtral": (
            (
                "model.layers.1.block_sparse_moe.experts.2.w1.weight",
                "model.layers.1.block_sparse_moe.experts.2.w3.weight",
            ),
            "lacks weights for model.layers.1.mlp.experts.gate_up_proj (stored as 8 tensors in this layout; "
            "model.layers.1.block_sparse_moe.experts.2.w1.weight and 1 more of them absent; "
            "converted: [3, 32, 32], the model needs [4, 32, 32]) (and 0 more)",
        ),
        "qwen3_5_text": (
            ("model.language_model.layers.1.self_attn.q_proj.weight",),
            "lacks weights for model.layers.1.self_attn.q_proj.weight "
            "(stored as model.language_model.layers.1.self_attn.q_proj.weight in this layout) (and 0 more)",
        ),
    }
    for name, (drop, message) in cases.items():
        model = tmp_path / name
        model.mkdir()
        tensors = _files(models[name])
        for key in drop:
            del tensors[key]
        save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})
        (model / "config.json").write_bytes((Path(models[name]) / "config.json").read_bytes())
        out = tmp_path / f"out-{name}"
        assert main(["train", str(_train_yaml(tmp_path / f"{name}.yaml", str(model), out))]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0] == f"error: model: '{model}' {message}", err
        assert not out.exists()


def train_lr0(jobs: list[tuple[str, str, dict, str]]) -> dict[str, dict[str, int]]:
    """Rank body: one step at learning rate 0 per (name, model, layout, output_dir), saved at the
    end; per model, how many elements of each file tensor this rank read (DCP's HF reader)."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    from shardlm import Trainer, build_mesh, init_distributed, parallelize

    init_distributed()
    process = HuggingFaceStorageReader._process_read_request
    counts: dict[str, dict[str, int]] = {}

    def counted(self, f, req, planner):
        reads[req.storage_index.fqn] = reads.get(req.storage_index.fqn, 0) + math.prod(req.lengths)
        return process(self, f, req, planner)

    HuggingFaceStorageReader._process_read_request = counted
    for name, path, layout, output_dir in jobs:
        reads = counts.setdefault(name, {})
        cfg = train_config(path, layout, 2, 1, 1, output_dir=output_dir, learning_rate=0.0, save_steps=1)
        mesh = build_mesh(cfg.parallel)
        with registered(name):
            Trainer(parallelize(path, mesh), cfg, token_dataset(), mesh).train()
    return counts


@pytest.fixture(scope="module")
def runs(models, tmp_path_factory) -> dict:
    """One 4-rank spawn: every model at tp=2 x fsdp=2; ``{model: output_dir}`` and rank 0's reads."""
    root = tmp_path_factory.mktemp("published-runs")
    jobs = [(name, path, LAYOUTS.get(name, LAYOUT), str(root / name)) for name, path in models.items()]
    return {"reads": run_ranks(train_lr0, 4, jobs), **{job[0]: job[3] for job in jobs}}


@pytest.mark.ranks  # starts processes or a process group
def test_each_rank_reads_only_its_rows(models, runs):
    """Rank 0 (tp 0, fsdp 0) reads of every file tensor just the part its own pieces hold, never a
    whole checkpoint: a quarter of the chunked and concatenated tensors (TP halves them, FSDP halves
    them again); of the per-expert tensors, those of the experts FSDP gives it (2 of 4), each the
    half of its intermediate rows (``w1``/``w3``, ``gate_proj``/``up_proj``) or columns
    (``w2``, ``down_proj``) TP gives it."""
    sizes = {name: {k: math.prod(v[0]) for k, v in published.header(path).items()} for name, path in models.items()}
    for name, reads in runs["reads"].items():
        assert reads.keys() <= sizes[name].keys(), name
        assert sum(reads.values()) < sum(sizes[name].values()) / 2, name
        print(f"{name}: rank 0 read {sum(reads.values())} of {sum(sizes[name].values())} elements")  # pytest -s
    rules = runs["reads"]["llama_rules"]
    for key in ("model.layers.0.mlp.gate_up.weight", "model.layers.0.self_attn.q_a.weight"):
        assert rules[key] == sizes["llama_rules"][key] // 4, (key, rules[key])
    for name in ("mixtral", "qwen3_moe"):
        reads = runs["reads"][name]
        experts = [k for k in sizes[name] if ".experts." in k]
        held = [k for k in experts if k in reads]
        assert len(experts) == 24 and len(held) == 12, held
        assert all(".experts.0." in k or ".experts.1." in k for k in held), held
        assert all(reads[k] == sizes[name][k] // 2 for k in held), {k: reads[k] for k in held}


@pytest.mark.ranks  # starts processes
@pytest.mark.parametrize("name", list(_configs()))
def test_round_trip_gives_back_the_published_files(models, runs, name, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    out = str(tmp_path / "hf")
    with registered(name):
        assert main(["consolidate", runs[name], out]) == 0
        _, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    original = trained_files(name, _files(models[name]))
    assert capsys.readouterr().out.strip().endswith(CHECK_MESSAGE.format(n=len(original)))
    written = _files(out)
    assert written.keys() == original.keys()
    for key, tensor in original.items():
        assert written[key].dtype == tensor.dtype and torch.equal(written[key], tensor), key
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info


@pytest.mark.ranks  # starts processes or a process group
def test_lora_merge_writes_the_published_layout(models, tmp_path):
    """``consolidate --merge`` of a LoRA run on a published GPT-NeoX: the merged model is saved by
    ``save_pretrained`` (Pythia's ``embed_out.weight``) and verified under those names. One process."""
    import torch.distributed as dist

    from shardlm import Trainer, build_mesh, init_distributed, parallelize
    from shardlm.checkpoint.export import consolidate
    from shardlm.config import LoraConfig

    path = models["gpt_neox"]
    init_distributed()
    try:
        cfg = train_config(path, {}, 2, 1, 1, output_dir=str(tmp_path / "out"), learning_rate=0.0, save_steps=1)
        cfg.lora = LoraConfig(r=4, target_modules=["query_key_value", "dense"])
        mesh = build_mesh(cfg.parallel)
        Trainer(parallelize(path, mesh, lora_config=cfg.lora), cfg, token_dataset(), mesh).train()
    finally:
        dist.destroy_process_group()
    consolidate(str(tmp_path / "out"), str(tmp_path / "merged"), merge=True)
    merged, original = _files(str(tmp_path / "merged")), _files(path)
    assert merged.keys() == original.keys()  # lora_B starts at zero: the merged model is the base
    assert all(torch.equal(merged[k], original[k]) for k in original)


def _registered_rule(kind: str) -> list:
    from transformers.core_model_loading import Chunk, Interleave, WeightConverter

    if kind == "interleave":  # no box geometry: read whole
        return [WeightConverter("mlp.up_proj.weight", "mlp.up_proj.weight", [Interleave(dim=0)])]
    # one published tensor -> two in memory; written back by joining them (the reverse Concatenate)
    return [WeightConverter("mlp.gate_up.weight", ["mlp.gate_proj.weight", "mlp.up_proj.weight"], [Chunk(dim=0)])]


@pytest.mark.ranks  # starts processes or a process group
@pytest.mark.parametrize("kind,read", [("interleave", {"rename": 19, "whole": 2})])
def test_registered_rules_load_and_consolidate(kind, read, tmp_path, capsys):
    """A rule kind no causal LM of transformers 5.24 has and that has no box geometry, registered
    for a tiny Llama: ``Interleave`` (each rank reads the tensor whole and runs transformers'
    converter). ``kind="chunk"`` runs the same for ``Chunk`` (boxes; consolidation joins the two
    in-memory tensors back), which the spawned runs of ``llama_rules`` cover at tp=2. One process:
    lr 0, saved, consolidated, equal to the files ``save_pretrained`` wrote, and ``from_pretrained``
    (with the rule) misses nothing."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from shardlm import Trainer, build_mesh, init_distributed, parallelize

    with registered("LlamaForCausalLM", _registered_rule(kind)):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(family_config("llama"))
        path = str(tmp_path / "llama")
        model.save_pretrained(path)
        original = _files(path)
        assert ("model.layers.0.mlp.gate_up.weight" in original) == (kind == "chunk")
        assert published.describe(check(path)) == read
        init_distributed()
        try:
            cfg = train_config(path, {}, 2, 1, 1, output_dir=str(tmp_path / "out"), learning_rate=0.0, save_steps=1)
            mesh = build_mesh(cfg.parallel)
            Trainer(parallelize(path, mesh), cfg, token_dataset(), mesh).train()
        finally:
            dist.destroy_process_group()
        out = str(tmp_path / "hf")
        assert main(["consolidate", str(tmp_path / "out"), out]) == 0
        assert capsys.readouterr().out.strip().endswith(CHECK_MESSAGE.format(n=len(original)))
        written = _files(out)
        assert written.keys() == original.keys()
        assert all(torch.equal(written[k], original[k]) for k in original)
        _, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
