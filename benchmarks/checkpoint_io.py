"""Save/load throughput of a DCP checkpoint vs plain safetensors, same tensors, same disk.

Why: checkpoints go through DCP (resharding, any layout), consolidated models through
safetensors; this says what DCP's generality costs on one process. Both writers fsync, and
every file is evicted from the page cache (``posix_fadvise(DONTNEED)``) before each load, so
loads read the disk, not memory. Loads use shardlm's safe reader (restricted unpickling).

    python benchmarks/checkpoint_io.py [--dir /tmp] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

from shardlm.checkpoint.io import load_dcp


def tiny_llama_state() -> dict[str, torch.Tensor]:
    """A ~50 MB fp32 Llama state dict (random init)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=8000,
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=6,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    return {k: v.contiguous() for k, v in AutoModelForCausalLM.from_config(config).float().state_dict().items()}


def _files(path: str) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs] if os.path.isdir(path) else [path]


def evict(path: str) -> None:
    """Drop ``path``'s pages from the page cache so the next read comes from the disk."""
    for name in _files(path):
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def save_safetensors(state: dict, path: str) -> None:
    save_file(state, path)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def save_dcp(state: dict, path: str) -> None:
    with warnings.catch_warnings():  # one process on purpose
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path, sync_files=True), no_dist=True)


def load_dcp_into(state: dict, path: str) -> None:
    target = {k: torch.empty_like(v) for k, v in state.items()}
    load_dcp(target, path, no_dist=True)


def load_dcp_default(state: dict, path: str) -> None:
    """torch's own reader (full unpickling of .metadata): to show what the safe reader costs."""
    target = {k: torch.empty_like(v) for k, v in state.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(target, storage_reader=dcp.FileSystemReader(path), no_dist=True)


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="where to write (default: the system temp dir)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    state = tiny_llama_state()
    mb = sum(t.numel() * t.element_size() for t in state.values()) / 1e6
    root = tempfile.mkdtemp(prefix="ckpt-io-", dir=args.dir)
    names = ("dcp save", "dcp load", "dcp load (torch reader)", "safetensors save", "safetensors load")
    results: dict[str, list[float]] = {k: [] for k in names}
    try:
        for i in range(args.repeats):
            d, s = os.path.join(root, f"dcp{i}"), os.path.join(root, f"st{i}.safetensors")
            results["dcp save"].append(timed(save_dcp, state, d))
            results["safetensors save"].append(timed(save_safetensors, state, s))
            evict(d)
            evict(s)
            results["dcp load"].append(timed(load_dcp_into, state, d))
            evict(d)
            results["dcp load (torch reader)"].append(timed(load_dcp_default, state, d))
            results["safetensors load"].append(timed(load_file, s))
        loaded = load_file(os.path.join(root, "st0.safetensors"))
        assert all(torch.equal(loaded[k], v) for k, v in state.items())
        print(f"{len(state)} tensors, {mb:.1f} MB fp32, {args.repeats} repeats (median), dir {root}")
        for name, times in results.items():
            t = statistics.median(times)
            print(f"  {name:<24} {t * 1e3:8.1f} ms  {mb / t:8.1f} MB/s")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
