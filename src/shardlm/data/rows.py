"""Data files -> rows -> token ids with per-token labels, each row judged on its own.

Split from ``data/dataset.py`` so that module keeps the data set as a whole (cache, ranks, samples,
order) and this one the single row: how a file is read and what a row of each kind becomes.
A row never stops the run: one that cannot be used gets a status code (``REASONS``) and no
tokens, and ``data/dataset.py`` counts it. Only a property of the whole data set (no usable row, a
field no row has) is an error.

Reading uses Hugging Face ``datasets`` so the rows live in memory-mapped Arrow files and the
tokenized result is cached next to them: ``load_dataset("text")`` for .txt (one row per line)
and ``load_dataset("parquet")``. JSON is read here instead, each row kept as its JSON text: the
``json`` builder aborts the whole file on one bad line, and Arrow refuses a field whose type
varies between rows, both of which are row-level faults that must only skip the row.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

from shardlm.config import DataConfig
from shardlm.errors import ConfigError

IGNORE_INDEX = -100  # the label of a token that is not trained (the loss and torch skip it)
JSON_COLUMN = "__shardlm_json__"
OK, EMPTY, MISSING, WRONG_TYPE, BAD_JSON, TEMPLATE, NO_LABEL, UNDECODABLE = range(8)
REASONS = (
    "usable",
    "empty",
    "missing field",
    "field of the wrong type",
    "invalid JSON or not an object",
    "rejected by the chat template",
    "nothing trained within data.seq_len",
    "invalid UTF-8 or binary",
)
# what a row's text holds when its bytes were not text: the replacement character reading with
# ``errors="replace"`` puts for every undecodable byte, and NUL, which no text file contains
NOT_TEXT = ("\ufffd", "\x00")


def data_files(path: str, key: str = "data.path") -> list[str]:
    """The file itself, or every supported file under the directory (hidden ones skipped), sorted;
    ``key``: the config key that named ``path``, for the error line."""
    if os.path.isfile(path):
        return [path]
    found = []
    for root, dirs, files in os.walk(path):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found += [os.path.join(root, f) for f in files if f.lower().endswith(DataConfig.EXTENSIONS) and f[0] != "."]
    if not found:
        kinds = ", ".join(DataConfig.EXTENSIONS)
        raise ConfigError(f"{key}: directory '{path}' holds no {kinds} file; point it at your data")
    return sorted(found, key=lambda f: os.path.relpath(f, path))


def _json_rows(path: str) -> Iterator[dict]:
    """A .json list of objects, or JSON Lines (in .jsonl, or .json that is not one document)."""
    if path.lower().endswith(".json"):
        with open(path, encoding="utf-8", errors="replace") as fh:
            try:
                doc = json.load(fh)
            except json.JSONDecodeError:
                doc = None
        if doc is not None:
            for row in doc if isinstance(doc, list) else [doc]:
                yield {JSON_COLUMN: json.dumps(row)}
            return
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if line.strip():  # blank lines are not rows in JSON Lines
                yield {JSON_COLUMN: line}


def load_rows(path: str, fingerprint: str, cache_dir: str | None):
    """One file as a ``datasets.Dataset`` of raw rows (columns as in the file, or JSON text)."""
    import datasets

    if path.lower().endswith(".txt"):
        return datasets.load_dataset(
            "text", data_files=path, split="train", cache_dir=cache_dir, encoding_errors="replace"
        )
    if path.lower().endswith(".parquet"):
        return datasets.load_dataset("parquet", data_files=path, split="train", cache_dir=cache_dir)
    features = datasets.Features({JSON_COLUMN: datasets.Value("string")})
    return datasets.Dataset.from_generator(
        _json_rows, features=features, gen_kwargs={"path": path}, cache_dir=cache_dir, fingerprint=fingerprint
    )


def encode_file(path: str, cfg: DataConfig, tokenizer, fingerprint: str, cache_dir: str | None = None):
    """Rows of ``path`` -> columns input_ids, labels (IGNORE_INDEX where not trained), status,
    missing (the field a row lacks) and keys (the fields it has, kept only for rows that miss one)."""
    is_txt = path.lower().endswith(".txt")
    if is_txt and (cfg.prompt_field or cfg.messages_field):
        key = "data.messages_field" if cfg.messages_field else "data.prompt_field"
        raise ConfigError(f"{key}: '{path}' is plain text (one document per line); use .jsonl/.json/.parquet rows")
    import datasets

    rows = load_rows(path, fingerprint, cache_dir)
    wanted = {JSON_COLUMN, cfg.text_field, cfg.prompt_field, cfg.response_field, cfg.messages_field} - {None}
    columns = [c for c in rows.column_names if c in wanted] or rows.column_names[:1]  # one keeps the row count
    other = sorted(set(rows.column_names) - set(columns))
    rows = rows.select_columns(columns)
    spec = dict(cfg.__dict__, text_field="text" if is_txt else cfg.text_field)
    tokens = datasets.List(datasets.Value("int32"))
    features = datasets.Features(
        input_ids=tokens,
        labels=tokens,
        status=datasets.Value("int8"),
        missing=datasets.Value("string"),
        keys=datasets.List(datasets.Value("string")),
    )
    return rows.map(
        _encode_batch,
        batched=True,
        remove_columns=columns,
        new_fingerprint=fingerprint + "-encoded",
        features=features,
        fn_kwargs={"tokenizer": tokenizer, "spec": spec, "other_columns": other},
        desc=f"shardlm: tokenizing {os.path.basename(path)}",
    )


def _encode_batch(batch: dict, tokenizer, spec: dict, other_columns: list[str]) -> dict:
    n = len(next(iter(batch.values()))) if batch else 0
    if JSON_COLUMN in batch:
        rows = [_parse(text) for text in batch[JSON_COLUMN]]
    else:
        rows = [{k: v[i] for k, v in batch.items()} for i in range(n)]
    judged = [(BAD_JSON, "", [], False) if row is None else _pieces(row, spec, tokenizer) for row in rows]
    texts = [text for _, _, pieces, _ in judged for text, _ in pieces]
    encoded = iter(tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else [])
    eos = tokenizer.eos_token_id
    out = {"input_ids": [], "labels": [], "status": [], "missing": [], "keys": []}
    for row, (status, missing, pieces, eos_trained) in zip(rows, judged):
        ids, labels = [], []
        for _, trained in pieces:
            piece = next(encoded)
            ids += piece
            labels += piece if trained else [IGNORE_INDEX] * len(piece)
        if status == OK and (not ids or ids[-1] != eos):
            ids.append(eos)
            labels.append(eos if eos_trained else IGNORE_INDEX)
        out["input_ids"].append(ids)
        out["labels"].append(labels)
        out["status"].append(status)
        out["missing"].append(missing)
        out["keys"].append(sorted(set(row) - {JSON_COLUMN}) + other_columns if status == MISSING else [])
    return out


def _parse(text: str) -> dict | None:
    try:
        row = json.loads(text)
    except json.JSONDecodeError:
        return None
    return row if isinstance(row, dict) else None


def _pieces(row: dict, spec: dict, tokenizer) -> tuple[int, str, list[tuple[str, bool]], bool]:
    """(status, missing field, [(text, trained)], whether the appended EOS is trained) of one row."""
    if spec["messages_field"]:
        return _chat_pieces(row, spec["messages_field"], tokenizer)
    fields = (spec["prompt_field"], spec["response_field"]) if spec["prompt_field"] else (spec["text_field"],)
    values = [row.get(f) for f in fields]
    for f, v in zip(fields, values):
        if v is None:
            return MISSING, f, [], False
    if not all(isinstance(v, str) for v in values):
        return WRONG_TYPE, "", [], False
    if not values[-1].strip():
        return EMPTY, "", [], False
    if _not_text(values):
        return UNDECODABLE, "", [], False
    pieces = [(values[0], False), (values[1], True)] if len(values) == 2 else [(values[0], True)]
    return OK, "", pieces, True


def _not_text(values) -> bool:
    """Undecodable bytes or NUL in any of the row's texts: a binary file or a wrong encoding, which
    would otherwise train as replacement characters (the row is skipped and counted instead)."""
    return any(mark in v for v in values for mark in NOT_TEXT)


def _chat_pieces(row: dict, field: str, tokenizer) -> tuple[int, str, list[tuple[str, bool]], bool]:
    """Render the chat with the template and mark each assistant turn: the text that rendering
    ``messages[:i+1]`` adds to rendering ``messages[:i]`` with the generation prompt."""
    messages = row.get(field)
    if messages is None:
        return MISSING, field, [], False
    ok = isinstance(messages, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    )
    if not ok:
        return WRONG_TYPE, "", [], False
    messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
        return EMPTY, "", [], False
    if _not_text(m["content"] for m in messages):
        return UNDECODABLE, "", [], False

    def render(part: list[dict], prompt: bool) -> str:
        return tokenizer.apply_chat_template(part, tokenize=False, add_generation_prompt=prompt)

    try:
        full, pieces, pos = render(messages, False), [], 0
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = render(messages[:i], True) if i else ""
            upto = render(messages[: i + 1], False)
            if not (full.startswith(upto) and upto.startswith(before) and len(before) >= pos):
                return TEMPLATE, "", [], False  # the template rewrites earlier turns: no clean span
            pieces += [(full[pos : len(before)], False), (full[len(before) : len(upto)], True)]
            pos = len(upto)
    except Exception:  # noqa: BLE001 - a template may raise on a row (e.g. roles must alternate)
        return TEMPLATE, "", [], False
    pieces.append((full[pos:], False))
    return OK, "", pieces, messages[-1]["role"] == "assistant"
