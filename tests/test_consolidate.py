"""Consolidation: a tp=2 checkpoint becomes a Hugging Face directory that plain transformers
loads cleanly, equal to one-process training, verified bit for bit; bad input writes nothing.

References: the same 10 steps trained in one process (shardlm's one-process path, itself checked
against plain transformers by the parity suite), and the fp32 consolidation cast to bf16. The
tp=2 checkpoints come from the spawn shared with test_checkpoint.py (``tp2_runs`` in conftest.py).
"""

import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist
from helpers import STEPS, VOCAB, token_dataset, train_config

from shardlm import Trainer, build_mesh, init_distributed, parallelize
from shardlm.checkpoint import export as cons
from shardlm.checkpoint import layout as ckpt_layout
from shardlm.cli import main

pytestmark = pytest.mark.ranks  # every test here starts processes or a process group

# name -> (model key, run dir) in tp2_runs; Kimi-Linear: its A_log [1, 1, heads, 1] split on dim 2 at tp=2;
# Qwen3.5 text: in_proj_qkv of unequal parts and its conv, each rank's chunk of every part (PartsShard); Zaya (tied
# embeddings): its value projections stored by the rows each rank computes, all of one and none of the other (RowsShard)
MODELS = {
    "llama_gqa": ("model", "a"),
    "llama_tied": ("tied", "t"),
    "kimi_linear": ("kimi", "k"),
    "qwen3_5_text": ("qwen35", "q"),
    "zaya": ("zaya", "z"),
}
TIED = {"llama_tied", "zaya"}


@pytest.fixture(scope="module")
def trained(tp2_runs):
    """tp=2 checkpoints after 10 steps (the spawn shared with test_checkpoint.py) and the same
    10 steps trained in this process, per model."""
    runs = tp2_runs
    root = runs["root"]
    init_distributed()
    reference = {}
    try:
        for name, (key, _) in MODELS.items():
            cfg = train_config(runs[key], {}, 2, 2, STEPS, output_dir=str(root / f"ref-{name}"))
            mesh = build_mesh(cfg.parallel)
            model = parallelize(runs[key], mesh)
            Trainer(model, cfg, token_dataset(), mesh).train()
            reference[name] = model.module.eval()
    finally:
        dist.destroy_process_group()
    return {"root": root, "ref": reference, "out": {name: str(root / run) for name, (_, run) in MODELS.items()}}


def _load(out: str):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    return model.eval(), info


@pytest.mark.parametrize("name", list(MODELS))
def test_round_trip_matches_one_process(trained, name, capsys):
    root, reference = trained["root"], trained["ref"][name]
    out = str(root / f"hf-{name}")
    assert main(["consolidate", trained["out"][name], out]) == 0  # an output dir: its newest step
    n = len([k for k in reference.state_dict() if not (name in TIED and k == "lm_head.weight")])
    if name == "kimi_linear":  # written in its published layout: one tensor per expert and projection
        from safetensors import safe_open

        with safe_open(os.path.join(out, "model.safetensors"), "pt") as fh:
            n = len(list(fh.keys()))
    assert capsys.readouterr().out.strip().endswith(cons.CHECK_MESSAGE.format(n=n))
    model, info = _load(out)
    assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(), "error_msgs": []}
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == (name in TIED)
    ref_params = dict(reference.named_parameters())
    assert dict(model.named_parameters()).keys() == ref_params.keys()
    # seen: 2.4e-7; Qwen3.5 4.1e-6 on in_proj_a (weights ~0.06; every other tensor <= 1.1e-6, in_proj_qkv
    # 4.2e-7): 10 AdamW steps of the decay gate, whose gradient passes exp and softplus, from fp32 sums in
    # another order at tp=2 (its losses match one process to 1e-5: test_checkpoint); rows put in the wrong
    # place would differ by ~0.1. Zaya 2.5e-6 on q_proj/k_proj (weights ~0.09; its value projections, stored by rows,
    # under 1e-6): the same 10 steps through its L2 qk norm and convs, its losses matching one process to 1e-5
    atol = 1e-5 if name in ("qwen3_5_text", "zaya") else 2e-6
    for key, param in model.named_parameters():
        torch.testing.assert_close(param, ref_params[key], rtol=1e-5, atol=atol, msg=key)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)  # seen: 1.1e-6


def test_bf16_sharded_output_is_the_checkpoint_cast(trained, capsys):
    root = trained["root"]
    fp32, bf16 = str(root / "hf-llama_gqa"), str(root / "hf-bf16")
    if not os.path.isdir(fp32):
        cons.consolidate(trained["out"]["llama_gqa"], fp32)
    step = os.path.join(trained["out"]["llama_gqa"], "checkpoints", f"step-{STEPS}")
    assert main(["consolidate", step, bf16, "--dtype", "bf16", "--max-shard-size", "20KB"]) == 0
    assert cons.CHECK_MESSAGE.format(n=21) in capsys.readouterr().out  # 2 x 9 + embed, norm, head
    with open(os.path.join(bf16, cons.INDEX_FILE)) as fh:
        assert len(set(json.load(fh)["weight_map"].values())) > 1
    model, info = _load(bf16)
    assert not any(info.values()) and model.dtype == torch.bfloat16
    full = dict(_load(fp32)[0].named_parameters())
    for key, param in model.named_parameters():
        assert torch.equal(param, full[key].to(torch.bfloat16)), key


def test_mismatch_names_the_tensor_and_writes_nothing(trained, monkeypatch, capsys):
    from safetensors.torch import load_file, save_file

    write = cons._write

    def write_one_bit_off(step_dir, out, *args):
        count = write(step_dir, out, *args)
        path = os.path.join(out, cons.SINGLE_FILE)
        tensors = load_file(path)
        flat = tensors["model.norm.weight"].view(torch.int32)
        flat[3] ^= 1  # one ulp
        save_file(tensors, path, metadata={"format": "pt"})
        return count

    monkeypatch.setattr(cons, "_write", write_one_bit_off)
    out = str(trained["root"] / "hf-broken")
    assert main(["consolidate", trained["out"]["llama_gqa"], out]) == 1
    err = capsys.readouterr().err
    assert "save correctness check failed: 'model.norm.weight' in model.safetensors differs" in err
    assert not [p for p in os.listdir(trained["root"]) if p.startswith("hf-broken")]


def test_bad_checkpoints_are_refused(trained, tmp_path, capsys):
    src = os.path.join(trained["out"]["llama_gqa"], "checkpoints", f"step-{STEPS}")
    step = str(tmp_path / f"step-{STEPS}")
    shutil.copytree(src, step)
    out = str(tmp_path / "hf")

    def refused(*args: str) -> str:
        assert main(["consolidate", *args]) == 2
        assert not [p for p in os.listdir(tmp_path) if p.startswith("hf")]  # nothing written
        return capsys.readouterr().err.strip()

    assert "has no LoRA adapters to merge" in refused(step, out, "--merge")
    os.makedirs(os.path.join(out, "keep"))
    assert main(["consolidate", step, out]) == 2
    assert capsys.readouterr().err.strip().endswith("already exists; choose a new directory or remove it")
    assert os.listdir(out) == ["keep"]
    shutil.rmtree(out)
    with open(os.path.join(step, "hf", "config.json")) as fh:
        config = json.load(fh)
    with open(os.path.join(step, "hf", "config.json"), "w") as fh:
        json.dump({**config, "intermediate_size": 96}, fh)
    assert "hf/config.json does not match its manifest (" in refused(step, out)  # the bytes first
    # as a checkpoint saved before manifests (format 1, accepted with a warning): the model's own checks
    os.remove(os.path.join(step, "manifest.json"))
    with open(os.path.join(step, ckpt_layout.MARKER)) as fh:
        marker = json.load(fh)
    with open(os.path.join(step, ckpt_layout.MARKER), "w") as fh:
        json.dump({**{k: v for k, v in marker.items() if k != "manifest_sha256"}, "format": 1}, fh)
    assert "'model.layers.0.mlp.gate_proj.weight' is [64, 32], the model needs [96, 32]" in refused(step, out)
    with open(os.path.join(step, "hf", "config.json"), "w") as fh:
        json.dump(config, fh)
    shard = os.path.join(step, "__0_0.distcp")
    with open(shard, "r+b") as fh:
        fh.truncate(100)
    message = refused(step, out)
    assert message.startswith("error: checkpoint") and f"shard file '{shard}' is truncated (100 of" in message
    assert len(message.splitlines()) == 1
    os.remove(os.path.join(step, ckpt_layout.MARKER))
    assert "the save did not finish" in refused(step, out)
    os.rename(step, step + ".tmp-1234")
    assert "is an unfinished save" in refused(step + ".tmp-1234", out)
