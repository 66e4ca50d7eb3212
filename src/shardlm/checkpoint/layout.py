"""Where checkpoints live and how one becomes complete: step directories, the marker, atomic saves.

``OUTPUT_DIR/checkpoints/step-N/`` holds DCP's ``.metadata`` + ``__R_0.distcp`` files, ``rng/``,
``hf/`` (config, generation config and tokenizer files, for consolidation), ``manifest.json``
(the sha256 of every file, ``manifest.py``) and the marker ``shardlm_checkpoint.json``, written
last. Every rank writes into ``step-N.tmp-<id>``; after a barrier rank 0 writes the manifest, the
marker (with the manifest's sha256) and renames the directory (``finalize``), so a crash mid-save
never leaves a directory that looks whole; ``remove_leftovers`` (before every save, and when a
run starts) and ``prune`` remove such leftovers, ``prune`` old steps too.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import uuid

from shardlm.checkpoint.manifest import write_manifest
from shardlm.config.paths import TOKENIZER_FILES
from shardlm.errors import ConfigError
from shardlm.parallel.model.meta import build_meta_model
from shardlm.parallel.weights.fill import has_weights
from shardlm.parallel.weights.published_write import record_layout

log = logging.getLogger("shardlm")

MARKER = "shardlm_checkpoint.json"
MARKER_FILES = (MARKER, MARKER + ".part")  # what the manifest does not cover: the marker holds its hash
FORMAT_VERSION = 2  # 2: the marker records manifest_sha256 (manifest.py); 1: no manifest, still read
FORMATS = (1, 2)
STEP_DIR = re.compile(r"^step-(\d+)$")
HF_FILES = ("config.json", "generation_config.json")


def checkpoints_dir(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def read_marker(step_dir: str) -> dict:
    """The marker of a complete checkpoint; a ConfigError naming the directory otherwise."""
    if ".tmp-" in os.path.basename(os.path.normpath(step_dir)):
        raise ConfigError(f"checkpoint '{step_dir}' is an unfinished save (a .tmp- directory); use a complete step-N")
    path = os.path.join(step_dir, MARKER)
    if not os.path.isfile(path):
        raise ConfigError(f"checkpoint '{step_dir}' has no {MARKER}: the save did not finish; use an earlier step-N")
    try:
        with open(path) as fh:
            marker = json.load(fh)
    except (OSError, ValueError):
        raise ConfigError(f"checkpoint '{step_dir}': {MARKER} is damaged; use an earlier step-N") from None
    if marker.get("format") not in FORMATS:
        raise ConfigError(f"checkpoint '{step_dir}': {MARKER} has format {marker.get('format')}, expected 1 or 2")
    return marker


def find_latest(output_dir: str) -> str | None:
    """Newest complete ``step-N`` under ``output_dir/checkpoints`` (incomplete saves are skipped)."""
    root = checkpoints_dir(output_dir)
    steps = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        match = STEP_DIR.match(name)
        if match and os.path.isfile(os.path.join(root, name, MARKER)):
            steps.append((int(match.group(1)), os.path.join(root, name)))
    return max(steps)[1] if steps else None


def resolve(path: str, key: str = "checkpoint") -> str:
    """A step directory from a step directory or an output directory (its newest complete step)."""
    if not os.path.isdir(path):
        raise ConfigError(f"{key}: '{path}' is not a directory; pass a checkpoint step-N or an output_dir")
    if os.path.isfile(os.path.join(path, MARKER)) or STEP_DIR.match(os.path.basename(os.path.normpath(path))):
        read_marker(path)
        return path
    if ".tmp-" in os.path.basename(os.path.normpath(path)):
        read_marker(path)  # raises: unfinished save
    latest = find_latest(path)
    if latest is None:
        raise ConfigError(f"{key}: '{path}' has no complete checkpoint under checkpoints/step-N")
    return latest


def should_save(step: int, save_steps: int, max_steps: int) -> bool:
    """Every ``save_steps`` and at the last step; ``save_steps: 0`` turns checkpointing off."""
    return save_steps > 0 and (step % save_steps == 0 or step == max_steps)


def copy_hf_files(cfg, dest: str) -> None:
    os.makedirs(dest, exist_ok=True)
    sources = [(cfg.model, HF_FILES), (cfg.tokenizer or cfg.model, TOKENIZER_FILES)]
    for folder, names in sources:
        for name in names:
            if os.path.isfile(os.path.join(folder, name)):
                shutil.copy2(os.path.join(folder, name), os.path.join(dest, name))
    if has_weights(cfg.model):  # the published layout the weights were read in, for consolidation
        record_layout(cfg.model, dest, build_meta_model(cfg.model))


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)  # so the rename itself survives a power cut (POSIX)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_proof(tmp: str, marker: dict, model_dir: str) -> dict:
    """Rank 0, after every rank wrote its files: the manifest of ``tmp``; the marker with its sha256."""
    return {**marker, "manifest_sha256": write_manifest(tmp, marker["config"], model_dir, MARKER_FILES)}


def finalize(tmp: str, final: str, marker: dict) -> None:
    """Rank 0, after every rank wrote its shards and the manifest: marker last, then the atomic rename."""
    with open(os.path.join(tmp, MARKER + ".part"), "w") as fh:
        json.dump(marker, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(os.path.join(tmp, MARKER + ".part"), os.path.join(tmp, MARKER))
    if os.path.exists(final):  # re-saving a step that exists (resumed from an older one)
        old = f"{final}.old-{uuid.uuid4().hex[:8]}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old)
    else:
        os.rename(tmp, final)
    _fsync_dir(os.path.dirname(final))


def remove_leftovers(output_dir: str, keep: str | None = None) -> list[str]:
    """Remove the ``.tmp-``/``.old-`` directories of interrupted saves (all but ``keep``), saying so.

    Only the run that owns ``output_dir`` (``ownership.py``) calls this, so no live save is removed;
    a dead save left on a full disk would otherwise make the next save fail again. A leftover that
    holds its marker while its ``step-N`` is missing is a finished save interrupted between the
    renames of ``finalize``: it becomes ``step-N`` again instead of being removed."""
    root = checkpoints_dir(output_dir)
    removed = []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        path = os.path.join(root, name)
        step = os.path.join(root, name.split(".", 1)[0])
        if (".tmp-" in name or ".old-" in name) and path != keep and STEP_DIR.match(os.path.basename(step)):
            if os.path.isfile(os.path.join(path, MARKER)) and not os.path.exists(step):
                os.rename(path, step)
                print(f"restored {step} from {name}, a finished save interrupted before its rename", flush=True)
                continue
            log.info("removing %s, left by an interrupted save", path)
            print(f"removing {path}, left by an interrupted save", flush=True)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def prune(output_dir: str, keep: int | None, current: str) -> None:
    """Keep the newest ``keep`` complete checkpoints; drop leftovers of interrupted saves."""
    root = checkpoints_dir(output_dir)
    remove_leftovers(output_dir, keep=current)
    complete = []
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if STEP_DIR.match(name) and os.path.isfile(os.path.join(path, MARKER)):
            complete.append((int(STEP_DIR.match(name).group(1)), path))
    if keep is not None:
        for _, path in sorted(complete)[: max(0, len(complete) - keep)]:
            log.info("removing %s (train.save_total_limit=%d)", path, keep)
            shutil.rmtree(path, ignore_errors=True)
