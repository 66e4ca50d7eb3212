"""Bad input, as a new user would give it, answered before any rank is spawned: exit code 2, one line
``error: ...`` naming the config key, no rank started, no earlier file of output_dir changed; the
same answer at one process and at tp=2 (issue 25).

Each case starts from a fresh copy of the shipped examples (``examples/tiny-llama``, the demo corpus)
with seq_len 32, 2 steps, batch 2. Most cases go through ``shardlm.cli.main`` in this process (the
code path of the command, without paying seconds of process start per case): the fast tier. A
handful run the real command in a subprocess (``ranks``) to prove the contract end to end, and one
2-rank job checks that ids outside the vocabulary are refused by the trainer at tp=2 with the same
line as at one process (at tp=2 the vocabulary-parallel embedding would mask them to zero rows).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml
from helpers import finish_cli, start_cli, train_config, write_cli_model

from shardlm.config import load_config
from shardlm.config.ranges import NULLABLE, RULES
from shardlm.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
GPT2 = {  # a tiny GPT-2: learned positions, n_positions of them (IndexError beyond, before the check)
    "model_type": "gpt2",
    "vocab_size": 512,
    "n_positions": 24,
    "n_embd": 32,
    "n_layer": 1,
    "n_head": 2,
    "bos_token_id": 0,
    "eos_token_id": 1,
}
CHAT = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}] * 4


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    """A fresh copy of the examples and the bad inputs the cases point at."""
    root = tmp_path_factory.mktemp("bad")
    shutil.copytree(REPO / "examples" / "tiny-llama", root / "tiny-llama")
    shutil.copytree(REPO / "examples" / "data", root / "data")
    small = root / "v256"  # the shipped 512-id tokenizer beside a model of 256 ids
    shutil.copytree(root / "tiny-llama", small)
    config = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**config, "vocab_size": 256}))
    (root / "bin-weights").mkdir()  # weights were meant, in a format shardlm does not read
    shutil.copy(root / "tiny-llama" / "config.json", root / "bin-weights")
    (root / "bin-weights" / "pytorch_model.bin").write_bytes(b"\0" * 64)
    (root / "config-only").mkdir()
    shutil.copy(root / "tiny-llama" / "config.json", root / "config-only")
    (root / "gpt2").mkdir()
    (root / "gpt2" / "config.json").write_text(json.dumps(GPT2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(root / "tiny-llama" / name, root / "gpt2")
    (root / "empty-dir").mkdir()
    (root / "blank.txt").write_text("   \n\n \t \n")
    # NUL and bytes no UTF-8 decoder takes, without the ASCII bytes that end a line
    elf = b"\x7fELF\x02\x01\x01\x00" + bytes(b for b in range(256) if b not in b"\n\v\f\r\x1c\x1d\x1e") * 8
    (root / "binary.txt").write_bytes(b"\n".join([elf] * 6))
    (root / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1") * 6)
    (root / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in CHAT))
    (root / "a-file").write_text("not a directory\n")
    return root


def base_config(ws: Path, name: str) -> dict:
    return {
        "model": str(ws / "tiny-llama"),
        "data": {"path": str(ws / "data" / "corpus.txt"), "seq_len": 32, "cache_dir": str(ws / "cache")},
        "parallel": {"tp": 1},
        "train": {
            "output_dir": str(ws / f"out-{name}"),
            "max_steps": 2,
            "per_device_train_batch_size": 2,
            "learning_rate": 1.0e-3,
            "save_steps": 1,
        },
    }


def write_case(ws: Path, name: str) -> tuple[Path, Path]:
    """The case's config file, and its output_dir holding an earlier file (to prove nothing changed)."""
    out = ws / f"out-{name}"
    out.mkdir(exist_ok=True)
    (out / "notes.txt").write_text(f"written before the run of {name}\n")
    config = ws / f"{name}.yaml"
    config.write_text(yaml.safe_dump(base_config(ws, name)))
    return config, out


def tree_hash(path: Path) -> dict[str, str]:
    if not path.is_dir():
        return {"": hashlib.sha256(path.read_bytes()).hexdigest()} if path.exists() else {}
    return {
        str(f.relative_to(path)): hashlib.sha256(f.read_bytes()).hexdigest() for f in path.rglob("*") if f.is_file()
    }


# name -> (overrides with {ws} for the workspace, substrings of the error line: the key first)
CASES = {
    "vocab_smaller_than_tokenizer": (["model={ws}/v256"], ["tokenizer", "512 ids", "vocab_size is 256"]),
    "config_only_model_without_tokenizer": (["model={ws}/config-only"], ["model", "no tokenizer files", "tokenizer"]),
    "tokenizer_path_missing": (["tokenizer=./no-such-tokenizer"], ["tokenizer", "no-such-tokenizer", "not a dir"]),
    "model_path_missing": (["model=./no-such-model"], ["model", "no-such-model", "config.json"]),
    "model_weights_not_safetensors": (["model={ws}/bin-weights"], ["model", "pytorch_model.bin", "no .safetensors"]),
    "data_dir_without_data": (["data.path={ws}/empty-dir"], ["data.path", "holds no"]),
    "eval_dir_without_data": (["eval.path={ws}/empty-dir"], ["eval.path", "holds no"]),
    "eval_blank_only": (["eval.path={ws}/blank.txt"], ["eval.path", "no usable row", "3 empty"]),
    "data_blank_only": (["data.path={ws}/blank.txt"], ["data.path", "no usable row", "3 empty"]),
    "data_blank_only_tp2": (["data.path={ws}/blank.txt", "parallel.tp=2"], ["data.path", "no usable row"]),
    "data_binary_only": (["data.path={ws}/binary.txt"], ["data.path", "no usable row", "invalid UTF-8 or binary"]),
    "data_latin1": (["data.path={ws}/latin1.txt"], ["data.path", "no usable row", "6 invalid UTF-8 or binary"]),
    "chat_rows_without_template": (
        ["data.path={ws}/chat.jsonl", "data.messages_field=messages"],
        ["data.messages_field", "chat_template"],
    ),
    "output_dir_is_a_file": (["train.output_dir={ws}/a-file"], ["train.output_dir", "a-file", "is a file"]),
    "seq_len_beyond_positions": (["data.seq_len=300"], ["data.seq_len=300", "max_position_embeddings=256"]),
    "seq_len_beyond_gpt2_positions": (["model={ws}/gpt2", "data.seq_len=32"], ["data.seq_len=32", "n_positions=24"]),
    "seq_len_beyond_gpt2_positions_tp2": (
        ["model={ws}/gpt2", "data.seq_len=32", "parallel.tp=2"],
        ["data.seq_len=32", "n_positions=24"],
    ),
    "negative_learning_rate": (["train.learning_rate=-1"], ["train.learning_rate", "> 0", "-1.0"]),
    "nan_learning_rate": (["train.learning_rate=.nan"], ["train.learning_rate", "finite"]),
    "negative_warmup": (["train.warmup_steps=-5"], ["train.warmup_steps", ">= 0", "-5"]),
    "negative_max_grad_norm": (["train.max_grad_norm=-1"], ["train.max_grad_norm", "0 turns clipping off"]),
    "modules_to_save_unknown": (["lora.modules_to_save=[nope_head]"], ["lora.modules_to_save", "'nope_head'"]),
}
# the real command in a subprocess: the exit code, the one line and no rank, end to end
AS_SUBPROCESS = ("vocab_smaller_than_tokenizer", "data_blank_only_tp2", "seq_len_beyond_gpt2_positions_tp2")


def check_refusal(code: int, stderr: str, stdout: str, expected: list[str], out: Path, before: dict) -> str:
    """The contract: exit 2, exactly one ``error:`` line (the last) naming the key, no traceback, no
    rank started (a rank writes output_dir/logs/rankN.log), output_dir as it was."""
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert code == 2, (code, stderr[-3000:])
    assert len(errors) == 1 and stderr.strip().splitlines()[-1] == errors[0], stderr[-3000:]
    assert "Traceback" not in stderr + stdout
    for part in expected:
        assert part in errors[0], (part, errors[0])
    assert not (out / "logs").exists() and tree_hash(out) == before
    return errors[0]


def run_in_process(ws: Path, name: str, capsys) -> tuple[int, str, str]:
    from shardlm.cli import main

    config, _ = write_case(ws, name)
    overrides = [a.format(ws=ws) for a in CASES[name][0]]
    cwd = os.getcwd()
    os.chdir(ws)  # relative paths (./no-such-model) as a user in the workspace writes them
    try:
        code = main(["train", str(config), *overrides])
    finally:
        os.chdir(cwd)
    captured = capsys.readouterr()
    return code, captured.err, captured.out


@pytest.mark.parametrize("name", [n for n in CASES if n not in AS_SUBPROCESS])
def test_refused_before_spawning(ws, capsys, name):
    out = ws / f"out-{name}"
    write_case(ws, name)
    before = tree_hash(ws / "a-file") if name == "output_dir_is_a_file" else tree_hash(out)
    code, err, stdout = run_in_process(ws, name, capsys)
    target = ws / "a-file" if name == "output_dir_is_a_file" else out
    check_refusal(code, err, stdout, CASES[name][1], target, before)


@pytest.mark.ranks
def test_refused_by_the_command(ws):
    """The subprocess cases, started at once: tp=2 ones among them refused before any rank."""
    procs, outs, befores = {}, {}, {}
    for name in AS_SUBPROCESS:
        config, outs[name] = write_case(ws, name)
        befores[name] = tree_hash(outs[name])
        procs[name] = start_cli(config, *[a.format(ws=ws) for a in CASES[name][0]])
    for name, (code, stdout, stderr) in finish_cli(procs, timeout=300).items():
        check_refusal(code, stderr, stdout, CASES[name][1], outs[name], befores[name])


def test_same_line_at_one_process_and_tp2(ws, capsys):
    """Layout-independent checks give the very same line (the tp=2 case without spawning)."""
    for one, two in (
        ("data_blank_only", "data_blank_only_tp2"),
        ("seq_len_beyond_gpt2_positions", "seq_len_beyond_gpt2_positions_tp2"),
    ):
        lines = [run_in_process(ws, n, capsys)[1].strip().splitlines()[-1] for n in (one, two)]
        assert lines[0] == lines[1], lines


@pytest.fixture
def read_only_dir(ws, monkeypatch):
    """A read-only mount (a tmpfs mounted ro); where mounting is not allowed, ``os.access`` answers
    as it would on one (root passes every permission check, so a chmod proves nothing)."""
    target = ws / "ro-mount"
    target.mkdir(exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(target)], capture_output=True)
    if mounted.returncode != 0:
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if str(p) == str(target) else real(p, mode))
    try:
        yield target
    finally:
        if mounted.returncode == 0:
            subprocess.run(["umount", str(target)], check=True)


def test_read_only_output_dir(ws, read_only_dir, capsys):
    from shardlm.cli import main

    config, _ = write_case(ws, "read_only")
    code = main(["train", str(config), f"train.output_dir={read_only_dir}/run"])
    captured = capsys.readouterr()
    check_refusal(code, captured.err, captured.out, ["train.output_dir", "not writable"], read_only_dir, {})


def test_disk_too_small_for_a_checkpoint(ws, capsys, monkeypatch):
    """The tiny Llama's checkpoint (fp32 weights + two AdamW states) against 1 MiB free."""
    from shardlm import preflight
    from shardlm.cli import main

    usage = shutil.disk_usage(ws)
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda p: usage._replace(free=2**20))
    config, out = write_case(ws, "disk")
    before = tree_hash(out)
    code = main(["train", str(config)])
    captured = capsys.readouterr()
    line = check_refusal(code, captured.err, captured.out, ["train.output_dir", "GiB", "save_steps"], out, before)
    params = sum(p.numel() for p in preflight.build_meta_model(str(ws / "tiny-llama")).parameters())
    assert f"{12 * params / 2**30:.2f} GiB" in line, line  # 4 bytes x (weight + exp_avg + exp_avg_sq)


# every rule of the table refuses a value below it, NaN and inf, and takes its lower bound (and null
# where the key allows it): the table is what ``validate`` checks
@pytest.mark.parametrize("key", list(RULES))
def test_every_numeric_key_has_its_range(ws, key):
    rule, (section, _, leaf) = RULES[key], key.partition(".")
    raw = {**base_config(ws, "ranges"), "lora": {}} if section == "lora" else base_config(ws, "ranges")
    for bad in (rule.low if rule.low_open else rule.low - 1, math.nan, math.inf):
        raw[section] = {**raw.get(section, {}), leaf: bad}
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):  # integer keys: "must be an integer"
            load_config(raw=raw)
    if not rule.low_open:
        raw[section][leaf] = rule.low
        assert getattr(getattr(load_config(raw=raw), section), leaf) == rule.low
    if key in NULLABLE:
        raw[section][leaf] = None
        assert getattr(getattr(load_config(raw=raw), section), leaf) is None


def test_yaml_exponent_without_dot_is_a_float(ws):
    """PyYAML reads ``1e-4`` as a string; a numeric key takes it as the number it says."""
    config = ws / "exp.yaml"
    config.write_text(yaml.safe_dump(base_config(ws, "exp")).replace("0.001", "1e-4"))
    assert "1e-4" in config.read_text()
    cfg = load_config(str(config))
    assert cfg.train.learning_rate == 1e-4 and isinstance(cfg.train.learning_rate, float)
    with pytest.raises(ConfigError, match="'train.learning_rate' must be a number, got 'fast'"):
        load_config(str(config), ["train.learning_rate=fast"])


def test_undecodable_rows_are_skipped_and_counted(ws):
    """Invalid UTF-8 and binary lines are skipped and counted, never trained as U+FFFD: the samples
    are exactly those of the good rows alone."""
    from transformers import AutoTokenizer

    from shardlm.config import DataConfig
    from shardlm.data.dataset import build_dataset

    good = "the cat sat on the mat and looked at the dog\n" * 8
    (ws / "clean.txt").write_text(good)
    bad = "caf\xe9\n".encode("latin-1") + b"a\x00b\n" + (ws / "binary.txt").read_bytes()
    (ws / "mixed.txt").write_bytes(good.encode() + bad)
    tok = AutoTokenizer.from_pretrained(ws / "tiny-llama")
    mixed, clean = (
        build_dataset(DataConfig(path=str(ws / name), seq_len=8, cache_dir=str(ws / "cache")), tok)
        for name in ("mixed.txt", "clean.txt")
    )
    assert mixed.skipped_rows == 2 + 6 and clean.skipped_rows == 0  # Latin-1, NUL, and the six binary lines
    assert torch.equal(mixed.input_ids, clean.input_ids) and torch.equal(mixed.labels, clean.labels)


def test_local_looking_paths_never_reach_the_hub(ws, capsys, monkeypatch):
    """``plan nomodel`` and ``estimate`` of a missing path answer at once, offline or not."""
    from shardlm.cli import main

    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # a request would fail slowly, with retries
    start = time.perf_counter()
    for argv, part in (
        (["plan", "nomodel", "--tp", "2"], "model: 'nomodel' is not a directory"),
        (["estimate", "./x"], "model: './x' is not a directory"),
        (["estimate", str(ws / "tiny-llama"), "--seq", "100000000", "--fsdp", "1000000"], "1000000 ranks"),
        (["estimate", str(ws / "tiny-llama"), "--seq", "100000000"], "--seq=100000000 exceeds"),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and part in err[0], err
    assert time.perf_counter() - start < 20


def out_of_range_ids(model_path: str, layout: dict) -> str | None:
    """Rank body: a Trainer handed samples with the id ``vocab_size``; the error line, or None."""
    from shardlm import Trainer, build_mesh, init_distributed, parallelize
    from shardlm.data.dataset import TokenDataset

    init_distributed()
    cfg = train_config(model_path, layout, 2, 1, steps=1)
    ids = torch.arange(64).view(4, 16) * 7 % 500
    ids[2, 5] = 512
    mesh = build_mesh(cfg.parallel)
    model = parallelize(model_path, mesh, seed=0)
    try:
        Trainer(model, cfg, TokenDataset(ids, ids.clone()), mesh).train()
    except ConfigError as exc:
        return str(exc)
    return None


@pytest.mark.ranks
def test_ids_outside_the_vocabulary_refused_at_every_layout(tmp_path, one_process):
    """At one process and at tp=2 (where the vocab-parallel embedding masks them), the same line."""
    from helpers import run_ranks

    model = str(write_cli_model(tmp_path / "model"))
    one = out_of_range_ids(model, {"tp": 1})
    two = run_ranks(out_of_range_ids, 2, model, {"tp": 2})
    assert (
        one
        == two
        == (
            "data.path: token id 512 is outside the model's vocabulary [0, 512): the tokenizer does not match "
            "the model; use the model's own tokenizer"
        )
    ), (one, two)


def test_unsupported_activation_checkpointing_refused_before_spawning(ws, capsys, monkeypatch):
    """Refused by the preflight at tp=2 (before: by every rank's Trainer, exit 1 with tracebacks)."""
    from transformers import LlamaForCausalLM

    from shardlm.cli import main

    monkeypatch.setattr(LlamaForCausalLM, "supports_gradient_checkpointing", False)
    config, out = write_case(ws, "no_ckpt")
    before = tree_hash(out)
    code = main(["train", str(config), "parallel.tp=2", "train.gradient_checkpointing=true"])
    captured = capsys.readouterr()
    expected = ["train.gradient_checkpointing", "LlamaForCausalLM does not support"]
    check_refusal(code, captured.err, captured.out, expected, out, before)
