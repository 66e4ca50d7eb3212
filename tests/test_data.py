"""The data pipeline against token streams computed here, row by row, with the shipped tokenizer.

Every expected sample is rebuilt from ``tokenizer(text, add_special_tokens=False)`` and plain
list arithmetic, never from ``shardlm.data.dataset`` itself.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from shardlm.config import DataConfig
from shardlm.data.dataset import GlobalBatchOrder, build_dataset
from shardlm.errors import ConfigError

TOKENIZER = Path(__file__).resolve().parents[1] / "examples" / "tiny-llama"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
LINES = [
    "Nora has a garden behind her house on the hill.",
    "",
    "The lamp turns all night, so the boats at sea can see the rocks and stay safe.",
    "   ",
    "Tom and Rosa are friends.",
    "A crab!",
]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TOKENIZER))


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def config(path, tmp_path, **kw) -> DataConfig:
    return DataConfig(path=str(path), cache_dir=str(tmp_path / "cache"), **kw)


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def expected_padded(docs: list[list[int]], labels: list[list[int]], seq: int, pad_id: int):
    """Reference for packing off: one row per sample, ``seq + 1`` tokens, shifted by one."""
    x = torch.full((len(docs), seq), pad_id)
    y = torch.full((len(docs), seq), -100)
    for i, (d, lab) in enumerate(zip(docs, labels)):
        d, lab = d[: seq + 1], lab[: seq + 1]
        x[i, : len(d) - 1] = torch.tensor(d[:-1])
        y[i, : len(d) - 1] = torch.tensor(lab[1:])
    return x, y


def test_packing_txt_reproduces_token_stream(tmp_path, tok):
    """``packing_strategy: wrapped``: the windows packing made before document packing existed."""
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(LINES * 3) + "\n")
    seq = 8
    docs = [ids(tok, line) + [tok.eos_token_id] for line in LINES * 3 if line.strip()]
    stream = [t for d in docs for t in d]
    n = (len(stream) - 1) // seq
    ds = build_dataset(config(path, tmp_path, seq_len=seq, packing_strategy="wrapped"), tok)
    assert ds.position_ids is None
    assert ds.input_ids.shape == (n, seq)
    assert ds.input_ids.flatten().tolist() == stream[: n * seq]
    assert ds.labels.flatten().tolist() == stream[1 : n * seq + 1]
    assert ds.skipped_rows == 6  # "" and "   " three times
    assert ds.truncated_rows == sum(len(d) > seq + 1 for d in docs) > 0


def test_no_packing_pads_and_masks(tmp_path, tok):
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(LINES) + "\n")
    seq = 12
    docs = [ids(tok, line) + [tok.eos_token_id] for line in LINES if line.strip()]
    ds = build_dataset(config(path, tmp_path, seq_len=seq, packing=False), tok)
    x, y = expected_padded(docs, docs, seq, tok.pad_token_id)
    assert torch.equal(ds.input_ids, x) and torch.equal(ds.labels, y)
    assert tok.pad_token_id != tok.eos_token_id and (ds.labels == -100).sum() > 0
    assert ds.truncated_rows == sum(len(d) > seq + 1 for d in docs) > 0
    assert ds.skipped_rows == 2


PAIRS = [
    {"prompt": "Q: Where is the garden?\nA:", "response": " Behind the house on the hill."},
    {"prompt": "Q: Who are friends?\nA:", "response": " Tom and Rosa."},
    {"prompt": "Say hi.", "response": "Hi!"},
]


@pytest.mark.parametrize("packing", [False, True])
def test_prompt_response_trains_only_response(tmp_path, tok, packing):
    path = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    seq = 24
    eos = tok.eos_token_id
    docs = [ids(tok, r["prompt"]) + ids(tok, r["response"]) + [eos] for r in PAIRS]
    labs = [[-100] * len(ids(tok, r["prompt"])) + ids(tok, r["response"]) + [eos] for r in PAIRS]
    cfg = config(
        path,
        tmp_path,
        seq_len=seq,
        packing=packing,
        packing_strategy="wrapped",
        prompt_field="prompt",
        response_field="response",
    )
    ds = build_dataset(cfg, tok)
    if packing:
        stream, lab_stream = [t for d in docs for t in d], [t for lab in labs for t in lab]
        n = (len(stream) - 1) // seq
        assert ds.input_ids.flatten().tolist() == stream[: n * seq]
        assert ds.labels.flatten().tolist() == lab_stream[1 : n * seq + 1]
    else:
        x, y = expected_padded(docs, labs, seq, tok.pad_token_id)
        assert torch.equal(ds.input_ids, x) and torch.equal(ds.labels, y)
        for row, pair in zip(ds.labels, PAIRS):
            assert tok.decode(row[row != -100].tolist()) == pair["response"] + "</s>"


CHATS = [
    [
        {"role": "system", "content": "You are kind."},
        {"role": "user", "content": "Where is the garden?"},
        {"role": "assistant", "content": "Behind the house."},
        {"role": "user", "content": "And the well?"},
        {"role": "assistant", "content": "Near the wall."},
    ],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, Tom."}],
]


def test_chat_template_trains_only_assistant_turns(tmp_path, tok):
    chat_tok = copy.deepcopy(tok)
    chat_tok.chat_template = CHAT_TEMPLATE
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CHATS])
    cfg = config(path, tmp_path, seq_len=128, packing=False, messages_field="messages")
    ds = build_dataset(cfg, chat_tok)
    assert len(ds) == 2 and ds.skipped_rows == 0
    for x, y, chat in zip(ds.input_ids, ds.labels, CHATS):
        rendered = "".join(f"<|{m['role']}|>{m['content']}\n" for m in chat)
        trained = [t for m in chat if m["role"] == "assistant" for t in ids(tok, m["content"] + "\n")]
        assert y[y != -100].tolist() == trained + [tok.eos_token_id]
        n = int((y != -100).nonzero().max()) + 1
        assert tok.decode(x[:n].tolist() + [y[n - 1].item()]) == rendered + "</s>"
        replies = "".join(m["content"] + "\n" for m in chat if m["role"] == "assistant")
        assert tok.decode(y[y != -100].tolist()) == replies + "</s>"

    with pytest.raises(ConfigError, match="data.messages_field") as err:
        build_dataset(cfg, tok)
    assert "\n" not in str(err.value)


def test_bad_rows_are_skipped_and_counted(tmp_path, tok):
    good = ["one good row", "a much longer good row that will not fit in the window at all", "last"]
    rows = [
        {"text": good[0]},
        {"text": ""},
        {"text": "   "},
        '{"text": "broken',
        {"text": 5},
        {"text": None},
        {"other": "no text here"},
        "[1, 2]",
        "",
        {"text": good[1], "id": 3},
        {"text": ["a list"]},
        {"text": good[2]},
    ]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    seq = 6
    docs = [ids(tok, g) + [tok.eos_token_id] for g in good]
    ds = build_dataset(config(path, tmp_path, seq_len=seq, packing=False), tok)
    x, y = expected_padded(docs, docs, seq, tok.pad_token_id)
    assert torch.equal(ds.input_ids, x) and torch.equal(ds.labels, y)
    assert ds.skipped_rows == 8  # the blank line is not a row
    assert ds.truncated_rows == sum(len(d) > seq + 1 for d in docs) >= 1


def test_prompt_cut_off_leaves_nothing_to_train_and_is_skipped(tmp_path, tok):
    rows = [{"p": "a prompt far longer than the window of six tokens", "r": "yes"}, {"p": "Q", "r": "ok"}]
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    ds = build_dataset(config(path, tmp_path, seq_len=6, packing=False, prompt_field="p", response_field="r"), tok)
    assert len(ds) == 1 and ds.skipped_rows == 1 and ds.truncated_rows == 1
    assert ds.labels[0][ds.labels[0] != -100].tolist() == ids(tok, "ok") + [tok.eos_token_id]


def test_no_usable_row_is_one_line_config_error(tmp_path, tok):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"text": ""}, "{oops", {"text": 3}])
    with pytest.raises(ConfigError, match=r"data\.path: .*bad\.jsonl.*no usable row") as err:
        build_dataset(config(path, tmp_path), tok)
    assert "\n" not in str(err.value)


def test_field_missing_everywhere_names_the_key(tmp_path, tok):
    path = write_jsonl(tmp_path / "rows.jsonl", [{"content": "a", "id": 1}, {"content": "b"}])
    with pytest.raises(ConfigError, match=r"data\.text_field: .*'text'.*content, id") as err:
        build_dataset(config(path, tmp_path), tok)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"data\.response_field: .*'answer'"):
        build_dataset(config(path, tmp_path, prompt_field="content", response_field="answer"), tok)


FORMAT_ROWS = [
    {"text": "The wind from the sea was salty.", "id": 1},
    {"text": None, "id": 2},
    {"text": "", "id": 3},
    {"text": "She built a low wall of grey stones by the gate.", "id": 4},
    {"text": "In spring, Nora plants carrots.", "id": 5},
]


@pytest.mark.parametrize("kind", ["json", "parquet", "dir", "txt"])
def test_formats_give_the_same_samples_as_jsonl(tmp_path, tok, kind):
    ref = build_dataset(config(write_jsonl(tmp_path / "ref.jsonl", FORMAT_ROWS), tmp_path, seq_len=8), tok)
    if kind == "json":
        path = tmp_path / "rows.json"
        path.write_text(json.dumps(FORMAT_ROWS, indent=2))
    elif kind == "parquet":
        path = tmp_path / "rows.parquet"
        pq.write_table(pa.Table.from_pylist(FORMAT_ROWS), path)
    elif kind == "txt":
        path = tmp_path / "rows.txt"
        path.write_text("\n".join(r["text"] or "" for r in FORMAT_ROWS) + "\n")
    else:  # rows split over a .parquet and a .jsonl in a subfolder; sorted order a/ < b.parquet
        path = tmp_path / "data"
        os.makedirs(path / "a")
        write_jsonl(path / "a" / "first.jsonl", FORMAT_ROWS[:2])
        pq.write_table(pa.Table.from_pylist(FORMAT_ROWS[2:]), path / "b.parquet")
        (path / "notes.md").write_text("not data")
    ds = build_dataset(config(path, tmp_path, seq_len=8), tok)
    assert torch.equal(ds.input_ids, ref.input_ids) and torch.equal(ds.labels, ref.labels)
    assert ds.skipped_rows == ref.skipped_rows == 2


def test_tokenized_once_then_loaded_from_cache(tmp_path, tok, monkeypatch):
    calls = []
    original = type(tok).__call__

    def counting(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(tok), "__call__", counting)
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(LINES) + "\n")
    cfg = config(path, tmp_path, seq_len=8)
    first = build_dataset(cfg, tok)
    assert calls
    (meta,) = (tmp_path / "cache" / "shardlm-data").glob("*/meta.json")
    stamp = meta.stat().st_mtime_ns
    calls.clear()
    second = build_dataset(cfg, tok)
    assert not calls and meta.stat().st_mtime_ns == stamp
    assert torch.equal(first.input_ids, second.input_ids) and torch.equal(first.labels, second.labels)
    assert (second.skipped_rows, second.truncated_rows) == (first.skipped_rows, first.truncated_rows)

    build_dataset(config(path, tmp_path, seq_len=8, packing=False), tok)  # other settings: a new cache
    assert calls and len(list((tmp_path / "cache" / "shardlm-data").glob("*/meta.json"))) == 2
    calls.clear()
    with open(path, "a") as fh:
        fh.write("A new line changes the file.\n")
    os.utime(path, ns=(stamp + 10**9, stamp + 10**9))
    assert len(build_dataset(cfg, tok)) >= len(first) and calls


def test_data_config_checks(tmp_path):
    with pytest.raises(ConfigError, match="data.prompt_field and data.response_field"):
        DataConfig(path=str(tmp_path), prompt_field="p").check()
    with pytest.raises(ConfigError, match="data.messages_field"):
        DataConfig(path=str(tmp_path), messages_field="m", prompt_field="p", response_field="r").check()
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ConfigError, match="data.path: .*x.csv"):
        DataConfig(path=str(tmp_path / "x.csv")).check()
    with pytest.raises(ConfigError, match="does not exist"):
        DataConfig(path=str(tmp_path / "nope.txt")).check()


def test_empty_directory_and_txt_with_instruction_fields(tmp_path, tok):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="data.path: directory .* holds no"):
        build_dataset(config(tmp_path / "empty", tmp_path), tok)
    (tmp_path / "a.txt").write_text("hello\n")
    with pytest.raises(ConfigError, match="data.prompt_field: .*plain text"):
        build_dataset(config(tmp_path / "a.txt", tmp_path, prompt_field="p", response_field="r"), tok)


def test_batch_order_is_a_function_of_seed_batch_and_step():
    shared = GlobalBatchOrder(10, 4, seed=3)
    seen = [shared.indices(s) for s in range(6)]  # crosses two epoch boundaries
    assert seen == [GlobalBatchOrder(10, 4, seed=3).indices(s) for s in range(6)]
    assert shared.indices(1) == seen[1]  # going back to an earlier epoch
    epoch0 = seen[0] + seen[1] + seen[2][:2]
    assert sorted(epoch0) == list(range(10))
