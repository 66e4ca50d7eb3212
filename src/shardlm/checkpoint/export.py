"""Sharded checkpoint -> Hugging Face model directory, then re-read and verified bit for bit.

(A LoRA run's checkpoint becomes a peft adapter directory instead: ``export_lora.py``.)

One process, no process group: tensors are read from the DCP shards with the safe reader of
``io.py``, one output shard at a time (bounded memory: one output shard plus, while
verifying, one tensor re-read from disk), written with ``safetensors`` under the model's own
parameter names (tied weights once, as ``save_pretrained`` does), with ``config.json``,
``generation_config.json`` and the tokenizer files copied from the checkpoint's ``hf/``.

Everything goes into ``OUT.tmp-<id>``; only after every tensor of every written file compared
equal (bits, dtype, shape) with the checkpoint (cast to ``--dtype``) is it renamed to ``OUT``.
Before anything is read, every file of the checkpoint is checked against the sha256 its manifest
recorded at save (``manifest.py``), so "check passed" means the written weights equal what
training saved, not only what the checkpoint holds now.

``unpack``: some tensor-parallel plans may store a parameter in a layout other than Hugging
Face's (e.g. a fused projection permuted so each rank holds whole heads). ``unpack_for`` returns
the function that maps one checkpoint tensor to its HF tensors; identity for every plan today.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from shardlm.checkpoint.export_lora import consolidate_lora
from shardlm.checkpoint.io import load_dcp, read_metadata
from shardlm.checkpoint.layout import MARKER_FILES, read_marker, resolve
from shardlm.checkpoint.manifest import verify as verify_manifest
from shardlm.checkpoint.output import (
    CHECK_MESSAGE,
    DTYPES,
    VerificationError,
    same_bits,
    staged,
    write_hf_files,
)
from shardlm.errors import ConfigError
from shardlm.parallel.model.meta import build_meta_model
from shardlm.parallel.weights.published_write import PublishedUnpack, check_reload

Unpack = Callable[[str, torch.Tensor], dict[str, torch.Tensor]]
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def identity_unpack(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    return {name: tensor}


def unpack_for(marker: dict) -> Unpack:
    """The checkpoint-tensor -> HF-tensors map for the plan the checkpoint was trained with.

    Hook for plan-specific layouts (fused/permuted projections of GPT-2, Phi-3, replicated KV
    heads): read what the plan recorded in ``marker`` and return a function; identity today."""
    return identity_unpack


@dataclass
class Source:
    """One checkpoint tensor (``model.<name>`` in DCP) and the HF tensors it becomes."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    outputs: dict[str, tuple[tuple[int, ...], torch.dtype]]


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B)?\s*", text.upper())
    if not match:
        raise ConfigError(f"--max-shard-size: '{text}' is not a size like 5GB or 500MB")
    scale = {"KB": 1e3, "MB": 1e6, "GB": 1e9, "B": 1, None: 1}[match.group(2)]
    return int(float(match.group(1)) * scale)


def _out_dtype(dtype: torch.dtype, target: torch.dtype) -> torch.dtype:
    return target if dtype.is_floating_point else dtype


def plan_sources(step_dir: str, metadata, target: torch.dtype, unpack: Unpack) -> list[Source]:
    """HF names, shapes and the checkpoint tensor each comes from; refuses a foreign checkpoint."""
    model = build_meta_model(os.path.join(step_dir, "hf"))
    state = model.state_dict(keep_vars=True)  # the tensors themselves, so tied ones share an id
    first: dict[int, str] = {}
    tied = set()
    for name, tensor in state.items():  # a tied tensor is written once, under its first name
        if id(tensor) in first:
            tied.add(name)
        first.setdefault(id(tensor), name)
    saved = {k[len("model.") :]: v for k, v in metadata.state_dict_metadata.items() if k.startswith("model.")}
    extra = sorted(set(saved) - set(state))
    if extra:
        raise ConfigError(f"checkpoint '{step_dir}' has '{extra[0]}', which is not a parameter of the model in hf/")
    sources, expected = [], {}
    for name, tensor in state.items():
        if name in tied:
            continue
        expected[name] = tuple(tensor.shape)
        item = saved.get(name)
        if item is None or not hasattr(item, "size"):
            raise ConfigError(f"checkpoint '{step_dir}' has no tensor '{name}'; it was saved from another model")
        if tuple(item.size) != tuple(tensor.shape):
            raise ConfigError(
                f"checkpoint '{step_dir}': '{name}' is {list(item.size)}, the model needs {list(tensor.shape)}"
            )
        dtype = item.properties.dtype
        outs = unpack(name, torch.empty(tuple(item.size), dtype=dtype, device="meta"))
        sources.append(
            Source(
                name,
                tuple(item.size),
                dtype,
                {k: (tuple(v.shape), _out_dtype(v.dtype, target)) for k, v in outs.items()},
            )
        )
    if hasattr(unpack, "published_shapes"):  # what save_pretrained writes (parallel/weights/published_write.py)
        expected = unpack.published_shapes(expected)
    produced = {k: v[0] for s in sources for k, v in s.outputs.items()}
    if produced != expected:
        wrong = sorted(set(produced) ^ set(expected)) or [k for k in produced if produced[k] != expected[k]]
        raise ConfigError(f"checkpoint '{step_dir}': unpacking gives '{wrong[0]}' unlike the HF model's parameters")
    return sources


def group_sources(sources: list[Source], max_bytes: int) -> list[list[Source]]:
    """Consecutive sources into output files of at most ``max_bytes`` (one tensor may exceed it)."""
    groups: list[list[Source]] = [[]]
    size = 0
    for src in sources:
        nbytes = sum(torch.Size(s).numel() * d.itemsize for s, d in src.outputs.values())
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(src)
        size += nbytes
    return [g for g in groups if g]


def _read(step_dir: str, sources: list[Source], target: torch.dtype, unpack: Unpack) -> dict[str, torch.Tensor]:
    """The HF tensors of ``sources``: read from the checkpoint (full, one process), unpacked, cast."""
    state = {f"model.{s.name}": torch.empty(s.shape, dtype=s.dtype) for s in sources}
    load_dcp(state, step_dir, no_dist=True)
    out = {}
    for src in sources:
        for name, tensor in unpack(src.name, state.pop(f"model.{src.name}")).items():
            out[name] = tensor.to(_out_dtype(tensor.dtype, target)).contiguous()
    return out


def verify(step_dir: str, out: str, target: torch.dtype, unpack: Unpack, sources: list[Source]) -> int:
    """Re-read every written tensor (safetensors) and compare its bits with the checkpoint's."""
    if os.path.isfile(os.path.join(out, INDEX_FILE)):
        with open(os.path.join(out, INDEX_FILE)) as fh:
            weight_map = json.load(fh)["weight_map"]
    else:
        with safe_open(os.path.join(out, SINGLE_FILE), "pt") as f:
            weight_map = {k: SINGLE_FILE for k in f.keys()}  # noqa: SIM118 - safe_open is not iterable
    owner = {name: src for src in sources for name in src.outputs}
    missing = sorted(set(owner) ^ set(weight_map))
    if missing:
        raise VerificationError(f"'{missing[0]}' is missing from or extra in the written files")
    count = 0
    for file in sorted(set(weight_map.values())):
        with safe_open(os.path.join(out, file), "pt") as f:
            names = list(f.keys())
            wanted = {id(owner[n]): owner[n] for n in names}
            reference = _read(step_dir, list(wanted.values()), target, unpack)
            for name in names:
                got = f.get_tensor(name)
                if weight_map.get(name) != file or not same_bits(got, reference.pop(name)):
                    raise VerificationError(f"'{name}' in {file} differs from the checkpoint")
                count += 1
    return count


def consolidate(
    checkpoint: str, out: str, dtype: str = "fp32", max_shard_size: str = "5GB", merge: bool = False
) -> int:
    """Write ``checkpoint`` (a step dir, or an output dir: its newest) as an HF model dir ``out``;
    returns the number of tensors verified. Nothing is left at ``out`` unless verification passed."""
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got '{dtype}'")
    target, max_bytes = DTYPES[dtype], parse_size(max_shard_size)
    step_dir = resolve(checkpoint)
    marker = read_marker(step_dir)
    verify_manifest(step_dir, marker, MARKER_FILES)  # the checkpoint holds the bytes training saved
    if merge and not marker.get("lora"):
        raise ConfigError(f"--merge: checkpoint '{step_dir}' has no LoRA adapters to merge; drop --merge")
    if os.path.exists(out):
        raise ConfigError(f"output '{out}' already exists; choose a new directory or remove it")
    if not os.path.isfile(os.path.join(step_dir, "hf", "config.json")):
        raise ConfigError(f"checkpoint '{step_dir}' has no hf/config.json; it cannot become a Hugging Face model")
    if marker.get("lora"):  # a peft adapter directory, or the merged model (``export_lora.py``)
        return consolidate_lora(step_dir, marker, out, target, merge)
    metadata = read_metadata(step_dir)
    hf = os.path.join(step_dir, "hf")

    def read(state: dict) -> None:
        load_dcp(state, step_dir, no_dist=True)

    unpack = PublishedUnpack(hf, build_meta_model(hf), unpack_for(marker), read)  # the published layout
    sources = plan_sources(step_dir, metadata, target, unpack)
    groups = group_sources(sources, max_bytes)
    needed = sum(torch.Size(shape).numel() * dt.itemsize for s in sources for shape, dt in s.outputs.values())
    with staged(out, needed) as tmp:
        count = _write(step_dir, tmp, groups, target, unpack)
        write_hf_files(step_dir, tmp, target)
        checked = verify(step_dir, tmp, target, unpack, sources)
        problem = check_reload(build_meta_model(hf), tmp)  # from_pretrained's names: none missing or unexpected
        if problem:
            raise VerificationError(problem)
        if checked != count:
            raise VerificationError(f"wrote {count} tensors but verified {checked}")
    print(CHECK_MESSAGE.format(n=checked), flush=True)
    return checked


def _write(step_dir: str, out: str, groups: list[list[Source]], target: torch.dtype, unpack: Unpack) -> int:
    names = (
        [SINGLE_FILE]
        if len(groups) == 1
        else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    )
    weight_map, total, count = {}, 0, 0
    for file, group in zip(names, groups):
        tensors = _read(step_dir, group, target, unpack)
        save_file(tensors, os.path.join(out, file), metadata={"format": "pt"})
        for name, tensor in tensors.items():
            weight_map[name] = file
            total += tensor.numel() * tensor.element_size()
        count += len(tensors)
        del tensors
    if len(groups) > 1:
        with open(os.path.join(out, INDEX_FILE), "w") as fh:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=2)
    return count
