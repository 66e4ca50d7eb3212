"""What a run may do to an output directory it finds, without any process started: ``claim`` refuses
a run that does not continue this directory's checkpoint, ``train.overwrite_output_dir`` removes
only what shardlm wrote, an interrupted rename of a finished save is restored rather than removed,
a format-2 marker without its manifest's hash is refused, and a resume that would keep another
packing or another learning rate than the config's is refused by name."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from shardlm import ConfigError
from shardlm.checkpoint.layout import MARKER, remove_leftovers
from shardlm.checkpoint.manager import check_compatible
from shardlm.checkpoint.manifest import read_manifest
from shardlm.checkpoint.ownership import claim


def earlier_run(root: Path) -> Path:
    """An output_dir as a finished run leaves it, plus files a user put there."""
    (root / "checkpoints" / "step-2").mkdir(parents=True)
    (root / "checkpoints" / "step-2" / MARKER).write_text("{}")
    (root / "checkpoints" / "step-3.tmp-dead0000").mkdir()
    (root / "checkpoints" / "README").write_text("mine")
    (root / "logs").mkdir()
    (root / "logs" / "rank0.log").write_text("x")
    (root / "logs" / "slurm-17.out").write_text("the job's own log")
    (root / "tensorboard").mkdir()
    (root / "tensorboard" / "events.out.tfevents.1.host").write_text("x")
    (root / "metrics.jsonl").write_text('{"step": 1}\n')
    (root / "loss.png").write_text("x")
    (root / "notes.txt").write_text("mine")
    return root


def test_claim_refuses_a_run_that_does_not_continue_this_directory(tmp_path):
    run = earlier_run(tmp_path / "run")
    other = tmp_path / "other" / "checkpoints" / "step-1"
    for resume_from in (None, str(other)):  # a fresh start, or resume: true with no checkpoint / another dir's
        with pytest.raises(ConfigError, match=r"^train.output_dir: .* holds another run's checkpoints"):
            claim(str(run), resume_from, overwrite=False)
    claim(str(run), str(run / "checkpoints" / "step-2"), overwrite=False)  # continuing it
    only_metrics = tmp_path / "m"
    only_metrics.mkdir()
    (only_metrics / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ConfigError, match="holds another run's metrics.jsonl"):
        claim(str(only_metrics), None, overwrite=False)


def test_overwrite_removes_only_what_shardlm_wrote(tmp_path, capsys):
    run = earlier_run(tmp_path / "run")
    claim(str(run), None, overwrite=True)
    left = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    assert left == ["checkpoints", "checkpoints/README", "logs", "logs/slurm-17.out", "notes.txt"]
    said = capsys.readouterr().out
    assert "removed the earlier run's checkpoints, logs, loss.png, metrics.jsonl, tensorboard" in said


def test_a_finished_save_interrupted_between_its_renames_is_restored(tmp_path):
    root = tmp_path / "checkpoints"
    (root / "step-4.old-aaaa0000").mkdir(parents=True)  # step-4 renamed away, the new one not yet in place
    (root / "step-4.old-aaaa0000" / MARKER).write_text("{}")
    (root / "step-4.tmp-bbbb0000").mkdir()
    (root / "step-4.tmp-bbbb0000" / MARKER).write_text("{}")
    (root / "step-5.tmp-cccc0000").mkdir()  # a save that died before its marker: removed
    remove_leftovers(str(tmp_path))
    assert sorted(p.name for p in root.iterdir()) == ["step-4"]
    assert (root / "step-4" / MARKER).is_file()


def test_a_format_2_marker_without_the_manifest_hash_is_refused(tmp_path):
    assert read_manifest(str(tmp_path), {"format": 1}) is None  # saved before manifests: warned elsewhere
    with pytest.raises(ConfigError, match="format-2 marker does not record the manifest's sha256"):
        read_manifest(str(tmp_path), {"format": 2})


def run_config(packing_strategy: str = "bfd", learning_rate: float = 1e-4):
    train = SimpleNamespace(
        seed=0,
        optim="adamw",
        learning_rate=learning_rate,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        sgd_momentum=0.0,
    )
    data = SimpleNamespace(packing=True, packing_strategy=packing_strategy)
    return SimpleNamespace(train=train, data=data, global_batch_size=8)


def marker(data: dict, **train) -> dict:
    config = {"data": data, "train": {**vars(run_config().train), **train}}
    return json.loads(json.dumps({"global_batch_size": 8, "seed": 0, "config": config}))


def test_resume_refuses_what_the_checkpoint_would_silently_keep():
    check_compatible("ck", marker({"packing": True, "packing_strategy": "bfd"}), run_config())
    # a checkpoint older than data.packing_strategy packed the wrapped way
    with pytest.raises(ConfigError, match=r"^data.packing_strategy: 'ck' was trained on 'wrapped' windows"):
        check_compatible("ck", marker({"packing": True}), run_config())
    check_compatible("ck", marker({"packing": True}), run_config("wrapped"))
    with pytest.raises(ConfigError, match=r"^train.learning_rate: 0.001 differs from the checkpoint's 0.0001"):
        check_compatible("ck", marker({"packing": False}), run_config(learning_rate=1e-3))
