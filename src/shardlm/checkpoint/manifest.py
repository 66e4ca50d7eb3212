"""A checkpoint's proof of its bytes: ``manifest.json``, the size and sha256 of every file.

Written by rank 0 inside the ``.tmp-`` directory after every rank wrote its files and before the
marker (``layout.finalize``), so it is inside the atomic rename: a step directory that looks
whole carries the manifest of exactly the bytes that were saved. The marker records the
manifest's own sha256, so the manifest cannot be swapped or edited unnoticed either.

Besides the files, the manifest holds the run's config and the model's fingerprint: the model
type and every parameter's name and global shape (of the base model, as ``build_meta_model``
builds it from config.json), hashed. ``verify`` (load, resume and consolidate call it first)
refuses a checkpoint whose files changed (same size, other bytes), shrank, grew or went missing,
or that was saved from another model, naming the file or the first parameter that differs.

Checkpoints saved before manifests existed (marker format 1) are accepted with a warning: their
bytes cannot be proven, but refusing them would strand every earlier run, and DCP's own checks
(``io.read_metadata``: shard files present and long enough) still apply. A format-2 marker
without its manifest is refused: the manifest was deleted.

sha256 because hashlib's OpenSSL sha256 uses the CPU's SHA instructions where they exist:
measured ~1.1 GB/s on this repository's CI machine against ~0.57 GB/s for blake2b.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os

from shardlm.errors import ConfigError
from shardlm.parallel.model.meta import build_meta_model

MANIFEST = "manifest.json"
CHUNK = 1 << 20


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _files(step_dir: str, skip: tuple[str, ...]) -> list[str]:
    """Every file under ``step_dir`` as a relative path, sorted, except the names in ``skip``."""
    out = []
    for folder, _, names in os.walk(step_dir):
        for name in names:
            rel = os.path.relpath(os.path.join(folder, name), step_dir)
            if rel not in skip:
                out.append(rel)
    return sorted(out)


@functools.lru_cache(maxsize=8)
def model_parameters(model_dir: str) -> tuple[str, tuple[tuple[str, tuple[int, ...]], ...]]:
    """(model type, ((name, global shape), ...)) of the base model in ``model_dir`` (a meta model: no memory)."""
    model = build_meta_model(model_dir)
    shapes = tuple(sorted((name, tuple(t.shape)) for name, t in model.state_dict().items()))
    return getattr(model.config, "model_type", type(model).__name__), shapes


def fingerprint(model_type: str, shapes) -> str:
    text = json.dumps([model_type, [[name, list(shape)] for name, shape in shapes]])
    return hashlib.sha256(text.encode()).hexdigest()


def write_manifest(step_dir: str, config: dict, model_dir: str, skip: tuple[str, ...]) -> str:
    """Hash every file of ``step_dir`` (but ``skip``, the marker) into ``manifest.json``; its sha256."""
    files = {}
    for rel in _files(step_dir, skip + (MANIFEST,)):
        path = os.path.join(step_dir, rel)
        files[rel] = {"size": os.path.getsize(path), "sha256": file_sha256(path)}
    model_type, shapes = model_parameters(os.path.abspath(model_dir))
    manifest = {
        "algorithm": "sha256",
        "files": files,
        "model": {
            "type": model_type,
            "fingerprint": fingerprint(model_type, shapes),
            "parameters": {name: list(shape) for name, shape in shapes},
        },
        "config": config,
    }
    path = os.path.join(step_dir, MANIFEST)
    with open(path, "w") as fh:
        json.dump(manifest, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    return file_sha256(path)


def _mismatch(step_dir: str, name: str, why: str) -> ConfigError:
    return ConfigError(
        f"checkpoint {step_dir}: {name} does not match its manifest ({why}); the checkpoint is damaged, "
        "use an earlier step-N or a backup"
    )


def read_manifest(step_dir: str, marker: dict) -> dict | None:
    """The manifest of ``step_dir`` after checking it against the marker's hash; None for a format-1 checkpoint."""
    expected = marker.get("manifest_sha256")
    path = os.path.join(step_dir, MANIFEST)
    if expected is None and marker.get("format", 1) >= 2:
        raise _mismatch(step_dir, MANIFEST, "its format-2 marker does not record the manifest's sha256")
    if expected is None:
        return None
    if not os.path.isfile(path):
        raise _mismatch(step_dir, MANIFEST, "the file is missing")
    if file_sha256(path) != expected:
        raise _mismatch(step_dir, MANIFEST, "its sha256 differs from the one the marker recorded")
    with open(path) as fh:
        return json.load(fh)


def verify(step_dir: str, marker: dict, skip: tuple[str, ...]) -> dict | None:
    """Refuse ``step_dir`` unless every file has the size and sha256 its manifest recorded (and no
    file is missing or extra); returns the manifest (None, with a warning, for a format-1 checkpoint)."""
    manifest = read_manifest(step_dir, marker)
    if manifest is None:
        print(f"warning: checkpoint {step_dir} has no {MANIFEST} (saved by an older shardlm): bytes not verified")
        return None
    recorded = manifest["files"]
    present = set(_files(step_dir, skip + (MANIFEST,)))
    for name, entry in sorted(recorded.items()):
        path = os.path.join(step_dir, name)
        if name not in present:
            raise _mismatch(step_dir, name, "the file is missing")
        size = os.path.getsize(path)
        if size != entry["size"]:
            raise _mismatch(step_dir, name, f"{size} bytes, {entry['size']} were saved")
        if file_sha256(path) != entry["sha256"]:
            raise _mismatch(step_dir, name, "same size, other bytes: sha256 differs")
    extra = sorted(present - set(recorded))
    if extra:
        raise _mismatch(step_dir, extra[0], "the file was not saved with the checkpoint")
    return manifest


def check_model(step_dir: str, manifest: dict | None, model_dir: str, key: str) -> None:
    """Refuse a checkpoint saved from another model than ``model_dir`` (type, parameter names, shapes)."""
    if manifest is None:
        return
    saved = manifest["model"]
    model_type, shapes = model_parameters(os.path.abspath(model_dir))
    if fingerprint(model_type, shapes) == saved["fingerprint"]:
        return
    if model_type != saved["type"]:
        why = f"a {saved['type']} model, this run's is {model_type}"
    else:
        mine = {name: list(shape) for name, shape in shapes}
        theirs = saved["parameters"]
        name = next((n for n in sorted(set(mine) | set(theirs)) if mine.get(n) != theirs.get(n)), "?")
        why = f"'{name}' is {theirs.get(name, 'absent')} there, {mine.get(name, 'absent')} in '{model_dir}'"
    raise ConfigError(
        f"{key}: checkpoint {step_dir} was saved from another model ({why}); resume it with its own model"
    )
