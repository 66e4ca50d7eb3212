"""Training samples and their order.

``data.path`` is a .txt, .jsonl, .json or .parquet file, or a directory of them (every such
file below it, hidden ones skipped, in sorted order). What each row becomes:

* plain text (``text_field``, every line of a .txt): its tokens + EOS, all trained;
* prompt/response (``prompt_field`` + ``response_field``): prompt tokens, then response tokens
  + EOS; only the response and the EOS are trained (labels IGNORE_INDEX on the prompt);
* chat (``messages_field``: a list of ``{role, content}``): rendered with the tokenizer's chat
  template; only the text each assistant turn adds (content and the template's end-of-turn
  marker) is trained, plus the EOS appended after a conversation that ends with the assistant;
* skipped and counted in ``skipped_rows`` (the run goes on): an empty or whitespace-only text,
  response or assistant content, a missing or null field, a field of the wrong type, a .jsonl
  line that is not a JSON object, a chat the template rejects or cannot split cleanly, and a
  row whose trained tokens all lie beyond ``seq_len`` without packing, and a row holding bytes
  that are not UTF-8 text (read as U+FFFD) or NUL (a binary file: each of its lines is such a
  row, so an ELF file named .txt is skipped whole, row by row). Blank .jsonl lines are
  not rows. No usable row at all, or a field no row has, is a ``ConfigError``.

Samples have ``seq_len`` inputs and next-token labels. With packing, ``data.packing_strategy``
says how: ``bfd`` (the default) best-fits whole documents into windows with per-token
``position_ids`` restarting at each document, so no token attends across documents
(``data/packing.py``); ``wrapped``: all rows' tokens form one stream cut into windows of
``seq_len + 1`` (the remainder is dropped, and windows with nothing trained are dropped too), a
row longer than a window split across windows, every token attending to those before it. Without packing
each row is one sample, truncated to ``seq_len + 1`` tokens and padded with the pad id (EOS if
none), labels IGNORE_INDEX on padding. ``truncated_rows`` counts rows longer than
``seq_len + 1`` tokens (``bfd``: longer than ``seq_len``, the rows cut into pieces).

Tokenizing happens once: the samples are saved (``save_to_disk``) under ``data.cache_dir``
(default: the Hugging Face datasets cache) in a folder named by a hash of the files' paths,
sizes and mtimes, the tokenizer and the data config; later runs load it. In a distributed run
rank 0 builds and the other ranks wait, then load it.

The order is a function of the seed and the global batch size only, never of the layout: step
``s`` takes positions ``s*G .. s*G+G-1`` of an endless stream of seeded per-epoch
permutations. Data-parallel rank ``r`` takes its ``per_device`` slice of each micro-step; TP
ranks of one group share a dp rank and so see the same batch.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import shutil
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from shardlm.config import DataConfig
from shardlm.data.packing import pack_documents
from shardlm.data.rows import BAD_JSON, IGNORE_INDEX, MISSING, NO_LABEL, OK, REASONS, data_files, encode_file
from shardlm.errors import ConfigError

log = logging.getLogger("shardlm")
CACHE_VERSION = "shardlm-data-2"  # bump when what a row becomes changes


@dataclass
class Batch:
    input_ids: torch.Tensor  # [batch, seq_len]
    labels: torch.Tensor  # [batch, seq_len]; IGNORE_INDEX where nothing is predicted
    position_ids: torch.Tensor | None = None  # [batch, seq_len] for document-packed windows, else None

    def to(self, device: torch.device) -> Batch:
        positions = None if self.position_ids is None else self.position_ids.to(device)
        return Batch(self.input_ids.to(device), self.labels.to(device), positions)


@dataclass
class TokenDataset:
    input_ids: torch.Tensor  # [num_samples, seq_len]
    labels: torch.Tensor
    skipped_rows: int = 0
    truncated_rows: int = 0
    position_ids: torch.Tensor | None = None  # restarting at each document (``bfd`` packing), else None

    def __len__(self) -> int:
        return self.input_ids.shape[0]


def build_dataset(cfg: DataConfig, tokenizer, key: str = "data.path") -> TokenDataset:
    """The samples of ``cfg``, from the cache or built (and cached) once; safe to call on every rank.
    ``key``: the config key that named ``cfg.path`` (``eval.path`` for the eval set), for error lines."""
    cfg.check(key)
    if tokenizer.eos_token_id is None:
        raise ConfigError("tokenizer: it has no eos_token; set one in the tokenizer files")
    if cfg.messages_field and not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            "data.messages_field: the tokenizer has no chat_template; add one to its tokenizer_config.json "
            "or use data.prompt_field/data.response_field"
        )
    files = data_files(cfg.path, key)
    build = functools.partial(_load_or_build, cfg, tokenizer, files, cache_key(cfg, files, tokenizer), key)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return build()
    failure, ds = None, None
    if dist.get_rank() == 0:
        try:
            ds = build()
        except Exception as exc:  # the other ranks must not wait for a build that will never come
            failure = (isinstance(exc, ConfigError), str(exc))
            raise
        finally:
            dist.broadcast_object_list([failure], src=0)
        return ds
    box = [None]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        is_config, message = box[0]
        raise ConfigError(message) if is_config else RuntimeError(f"rank 0 failed to build the data set: {message}")
    return build()


def cache_root(cfg: DataConfig) -> str:
    if cfg.cache_dir:
        return cfg.cache_dir
    if os.environ.get("HF_DATASETS_CACHE"):
        return os.environ["HF_DATASETS_CACHE"]
    import datasets

    return str(datasets.config.HF_DATASETS_CACHE)


def cache_key(cfg: DataConfig, files: list[str], tokenizer) -> str:
    """Hash of everything the samples depend on: files (path, size, mtime), tokenizer, data config."""
    h = hashlib.sha256(CACHE_VERSION.encode())
    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("path", "cache_dir")}
    h.update(json.dumps(settings, sort_keys=True).encode())
    for f in files:
        st = os.stat(f)
        h.update(f"{os.path.abspath(f)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    h.update(tokenizer_fingerprint(tokenizer).encode())
    return h.hexdigest()[:24]


def tokenizer_fingerprint(tokenizer) -> str:
    """The tokenizer's full definition (vocab, merges, added tokens), chat template and special ids."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        body = backend.to_str()
    else:
        from datasets.fingerprint import Hasher

        body = Hasher.hash(tokenizer)
    special = (tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id)
    return "\0".join([type(tokenizer).__name__, body, str(getattr(tokenizer, "chat_template", None)), str(special)])


def _load_or_build(cfg: DataConfig, tokenizer, files: list[str], fingerprint: str, key: str) -> TokenDataset:
    where = os.path.join(cache_root(cfg), "shardlm-data", fingerprint)
    if os.path.isfile(os.path.join(where, "meta.json")):
        ds = _load(where)
        log.info("data: %d samples loaded from cache %s", len(ds), where)
        return ds
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        log.warning("data: cache %s not visible on this rank (not a shared filesystem?); building here", where)
    ds, counts = _build(cfg, tokenizer, files, fingerprint, key)
    _save(ds, where, counts)
    return ds


def _build(cfg: DataConfig, tokenizer, files: list[str], fingerprint: str, key: str) -> tuple[TokenDataset, dict]:
    import datasets

    root = cache_root(cfg)
    parts = [
        encode_file(f, cfg, tokenizer, hashlib.sha256(f"{fingerprint}\0{f}".encode()).hexdigest()[:24], root)
        for f in files
    ]
    rows = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    status = np.asarray(rows.data.column("status").to_numpy(zero_copy_only=False), dtype=np.int64)
    counts = Counter(REASONS[s] for s in status.tolist())
    _check_usable(cfg, rows, status, counts, key)
    ids, lengths = _flat(rows, "input_ids")
    labels, _ = _flat(rows, "labels")
    lengths = lengths[status == OK]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if cfg.packing and cfg.packing_strategy == "wrapped":
        ds = pack(ids, labels, lengths, cfg.seq_len)
    else:
        ds = (
            pack_bfd(ids, labels, lengths, cfg.seq_len, pad_id)
            if cfg.packing
            else pad(ids, labels, lengths, cfg.seq_len, pad_id)
        )
        counts[REASONS[NO_LABEL]] += ds.skipped_rows
    counts.pop(REASONS[OK], None)
    ds.skipped_rows = sum(counts.values())
    detail = ", ".join(f"{n} {reason}" for reason, n in counts.items() if n)
    log.info(
        "data: %d files, %d rows -> %d samples of %d tokens; %d rows skipped (%s), %d longer than seq_len+1",
        len(files),
        len(status),
        len(ds),
        cfg.seq_len,
        ds.skipped_rows,
        detail or "none",
        ds.truncated_rows,
    )
    if len(ds) == 0:
        raise ConfigError(
            f"{key}: '{cfg.path}' gives no training sample of data.seq_len={cfg.seq_len} tokens "
            f"(rows skipped: {detail or 'none'}); add data or change data.seq_len"
        )
    return ds, dict(counts)


def _check_usable(cfg: DataConfig, rows, status: np.ndarray, counts: Counter, key: str) -> None:
    """One-line errors for a data set that has nothing to train on, naming the likely fix."""
    if counts[REASONS[OK]]:
        return
    found = (status != MISSING) & (status != BAD_JSON)
    if counts[REASONS[MISSING]] and not found.any():
        missing = Counter(rows["missing"]).most_common(1)[0][0]
        keys = {
            cfg.text_field: "text_field",
            cfg.prompt_field: "prompt_field",
            cfg.response_field: "response_field",
            cfg.messages_field: "messages_field",
        }
        seen = sorted({k for row_keys in rows["keys"] for k in row_keys})
        raise ConfigError(
            f"data.{keys.get(missing, 'text_field')}: no row of '{cfg.path}' has the field '{missing}'; "
            f"fields found: {', '.join(seen[:20]) or 'none'}"
        )
    detail = ", ".join(f"{n} {reason}" for reason, n in counts.items() if n)
    raise ConfigError(f"{key}: '{cfg.path}' has no usable row ({detail or 'no rows'})")


def _flat(rows, column: str) -> tuple[np.ndarray, np.ndarray]:
    """All rows' tokens of ``column`` as one flat array, and each row's length."""
    import pyarrow.compute as pc

    col = rows.data.column(column)
    values = pc.list_flatten(col).to_numpy(zero_copy_only=False) if len(col) else np.zeros(0)
    return values.astype(np.int64), pc.list_value_length(col).to_numpy(zero_copy_only=False).astype(np.int64)


def pack(ids: np.ndarray, labels: np.ndarray, lengths: np.ndarray, seq_len: int) -> TokenDataset:
    """One stream of all rows cut into windows of ``seq_len + 1``; windows with no trained label dropped."""
    n = max((len(ids) - 1) // seq_len, 0)
    inputs = torch.from_numpy(ids[: n * seq_len]).view(n, seq_len)
    targets = torch.from_numpy(labels[1 : n * seq_len + 1]).view(n, seq_len)
    keep = (targets != IGNORE_INDEX).any(dim=1)
    truncated = int((lengths > seq_len + 1).sum())
    return TokenDataset(inputs[keep].clone(), targets[keep].clone(), truncated_rows=truncated)


def pack_bfd(ids: np.ndarray, labels: np.ndarray, lengths: np.ndarray, seq_len: int, pad_id: int) -> TokenDataset:
    """Whole documents best-fit into windows of ``seq_len``, positions restarting at each (``data/packing.py``);
    rows with nothing trained are counted in ``skipped_rows``, rows cut into pieces in ``truncated_rows``."""
    p = pack_documents(ids, labels, lengths, seq_len, pad_id)
    return TokenDataset(p.input_ids, p.labels, p.untrained_rows, p.split_rows, position_ids=p.position_ids)


def pad(ids: np.ndarray, labels: np.ndarray, lengths: np.ndarray, seq_len: int, pad_id: int) -> TokenDataset:
    """One row per sample, cut to ``seq_len + 1`` tokens; rows left with no trained label dropped
    (their number is returned in ``skipped_rows``)."""
    inputs = torch.full((len(lengths), seq_len), pad_id, dtype=torch.long)
    targets = torch.full((len(lengths), seq_len), IGNORE_INDEX, dtype=torch.long)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    for i, (start, length) in enumerate(zip(starts.tolist(), lengths.tolist())):
        k = min(length, seq_len + 1)
        inputs[i, : k - 1] = torch.from_numpy(ids[start : start + k - 1])
        targets[i, : k - 1] = torch.from_numpy(labels[start + 1 : start + k])
    keep = (targets != IGNORE_INDEX).any(dim=1)
    truncated = int((lengths > seq_len + 1).sum())
    return TokenDataset(inputs[keep], targets[keep], skipped_rows=int((~keep).sum()), truncated_rows=truncated)


def _save(ds: TokenDataset, where: str, counts: dict) -> None:
    """Write to a private folder, then rename it into place: a reader never sees half a cache."""
    import datasets

    tmp = f"{where}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    columns = {"input_ids": ds.input_ids, "labels": ds.labels}
    if ds.position_ids is not None:
        columns["position_ids"] = ds.position_ids
    samples = datasets.Dataset.from_dict({k: v.to(torch.int32).numpy() for k, v in columns.items()})
    with _quiet():
        samples.save_to_disk(os.path.join(tmp, "samples"))
    meta = {
        "samples": len(ds),
        "seq_len": ds.input_ids.shape[1],
        "skipped_rows": ds.skipped_rows,
        "truncated_rows": ds.truncated_rows,
        "skipped": counts,
    }
    with open(os.path.join(tmp, "meta.json"), "w") as fh:
        json.dump(meta, fh, indent=1)
    try:
        os.rename(tmp, where)
    except OSError:  # another process put the same cache there first
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def _quiet():
    """No progress bar for saving or loading finished samples (tokenizing keeps its bar)."""
    from datasets.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was_disabled = are_progress_bars_disabled()
    disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            enable_progress_bars()


def _load(where: str) -> TokenDataset:
    import datasets

    with open(os.path.join(where, "meta.json")) as fh:
        meta = json.load(fh)
    with _quiet():
        samples = datasets.load_from_disk(os.path.join(where, "samples"))
    shape = (meta["samples"], meta["seq_len"])
    ids, _ = _flat(samples, "input_ids")
    labels, _ = _flat(samples, "labels")
    positions = (
        torch.from_numpy(_flat(samples, "position_ids")[0]).view(shape)
        if "position_ids" in samples.column_names
        else None
    )
    return TokenDataset(
        torch.from_numpy(ids).view(shape),
        torch.from_numpy(labels).view(shape),
        skipped_rows=meta["skipped_rows"],
        truncated_rows=meta["truncated_rows"],
        position_ids=positions,
    )


class GlobalBatchOrder:
    """Which samples form global batch ``step``: a function of seed and global batch size only."""

    def __init__(self, num_samples: int, global_batch: int, seed: int):
        self.num_samples, self.global_batch, self.seed = num_samples, global_batch, seed
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms = {epoch: torch.randperm(self.num_samples, generator=g)}
        return self._perms[epoch]

    def indices(self, step: int) -> list[int]:
        """Sample indices of global batch ``step`` (0-based), in a fixed order."""
        start = step * self.global_batch
        positions = range(start, start + self.global_batch)
        return [int(self._perm(p // self.num_samples)[p % self.num_samples]) for p in positions]


def micro_batch_start(micro: int, dp_rank: int, dp_size: int, per_device: int) -> int:
    """Position in the global batch of the first sample of this dp rank's micro-step ``micro``
    (also what ``parallel/runtime/dropout.py`` keys a sample's masks on)."""
    return (micro * dp_size + dp_rank) * per_device


def micro_batch(
    ds: TokenDataset, order: GlobalBatchOrder, step: int, micro: int, dp_rank: int, dp_size: int, per_device: int
) -> Batch:
    """This data-parallel rank's share of accumulation micro-step ``micro`` of global batch ``step``."""
    start = micro_batch_start(micro, dp_rank, dp_size, per_device)
    idx = torch.tensor(order.indices(step)[start : start + per_device])
    return Batch(ds.input_ids[idx], ds.labels[idx], None if ds.position_ids is None else ds.position_ids[idx])
