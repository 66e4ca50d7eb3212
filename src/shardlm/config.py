"""The run configuration: YAML file + dotted ``KEY=VALUE`` overrides -> validated dataclasses.

Names follow Hugging Face ``TrainingArguments`` where one exists, so a user of the HF Trainer
recognises every key. Everything that can be checked without starting a process is checked
here (unknown keys, types, paths, sizes against the model config), so bad input fails before
any rank is spawned.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import yaml

from shardlm.errors import ConfigError


@dataclass
class DataConfig:
    """Where the training text is and how it becomes samples (see ``data.py`` for every row kind).

    ``path``: a .txt (one document per line), .jsonl, .json or .parquet file, or a directory of
    them. Rows are plain text (``text_field``), a prompt/response pair (``prompt_field`` and
    ``response_field``: only the response is trained) or a chat (``messages_field``: a list of
    ``{role, content}`` rendered with the tokenizer's chat template; only assistant turns are
    trained). ``cache_dir``: where tokenized data is kept (default: the Hugging Face datasets cache).
    """

    EXTENSIONS: ClassVar[tuple[str, ...]] = (".txt", ".jsonl", ".json", ".parquet")

    path: str = ""
    seq_len: int = 128
    packing: bool = True
    text_field: str = "text"
    prompt_field: str | None = None
    response_field: str | None = None
    messages_field: str | None = None
    cache_dir: str | None = None

    def check(self) -> None:
        """Checks of the data section that need no tokenizer: path, extension, field combination."""
        kinds = ", ".join(self.EXTENSIONS)
        if not self.path:
            raise ConfigError(f"config key 'data.path' is required: a {kinds} file or a directory of them")
        if not os.path.exists(self.path):
            raise ConfigError(f"data.path: '{self.path}' does not exist")
        if os.path.isfile(self.path) and not self.path.lower().endswith(self.EXTENSIONS):
            raise ConfigError(f"data.path: '{self.path}' is not a {kinds} file; convert it or point at a directory")
        if (self.prompt_field is None) != (self.response_field is None):
            raise ConfigError("data.prompt_field and data.response_field go together: set both or neither")
        if self.messages_field is not None and self.prompt_field is not None:
            raise ConfigError("data.messages_field excludes data.prompt_field/response_field: set one kind of row")


@dataclass
class ParallelConfig:
    """How the world is split: ``dp_replicate x fsdp x tp`` processes (outermost first)."""

    tp: int = 1
    fsdp: int = 1
    dp_replicate: int = 1

    @property
    def world_size(self) -> int:
        return self.tp * self.fsdp * self.dp_replicate

    @property
    def dp_size(self) -> int:
        """Data-parallel degree: how many different micro-batches are processed at once."""
        return self.fsdp * self.dp_replicate


@dataclass
class LoraConfig:
    """LoRA adapters (``lora.py``), with peft's meaning: ``r`` (default 8), ``alpha`` (peft's
    ``lora_alpha``, default 2*r; the update is scaled by alpha/r), ``dropout`` (``lora_dropout``),
    ``target_modules`` (module names or a regex; null: peft's default for the model type),
    ``modules_to_save`` (modules trained whole and saved with the adapter). ``adapter``: a peft
    adapter directory to continue training; its ``adapter_config.json`` then sets r, alpha and
    the targets (setting them differently here is an error)."""

    r: int | None = None
    alpha: float | None = None
    dropout: float = 0.0
    target_modules: list | str | None = None
    modules_to_save: list | None = None
    adapter: str | None = None


@dataclass
class TrainConfig:
    """Training settings; names follow Hugging Face ``TrainingArguments`` where one exists."""

    OPTIMIZERS: ClassVar[tuple[str, ...]] = ("adamw", "sgd")
    REPORT_TO: ClassVar[tuple[str, ...]] = ("none", "tensorboard")

    output_dir: str = "runs/x"
    max_steps: int = 100
    per_device_train_batch_size: int = 4
    gradient_accumulation_steps: int = 1
    optim: str = "adamw"  # adamw (foreach on CPU, fused on CUDA) | sgd; no weight decay on 1-D params
    learning_rate: float = 3.0e-4
    lr_scheduler_type: str = "cosine"
    warmup_steps: int = 0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1.0e-8
    sgd_momentum: float = 0.0  # optim: sgd only
    max_grad_norm: float = 1.0
    # bf16 compute, fp32 master weights, optimizer state and gradient reduction. With FSDP (dp > 1):
    # FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32); without: torch.autocast(bf16)
    # around the forward. The loss is computed in fp32.
    bf16: bool = False
    gradient_checkpointing: bool = False  # recompute each decoder block's activations in the backward
    seed: int = 0
    logging_steps: int = 1
    report_to: str = "none"  # none | tensorboard (event files under output_dir/tensorboard)
    save_steps: int = 0  # checkpoint every N steps and at the end; 0: no checkpoints
    save_total_limit: int | None = None  # keep the newest N complete checkpoints; None: all
    resume: bool | str = False  # true: newest complete checkpoint of output_dir; or a checkpoint path
    # faults (faults.py): stop after this many non-finite steps in a row (each one's update is skipped)
    max_bad_steps: int = 3
    # seconds any collective may wait for the other ranks before failing (every process group)
    timeout_s: float = 600.0


@dataclass
class EvalConfig:
    """Held-out loss and perplexity during training (``trainer.py``).

    ``path``: same formats as ``data.path``, tokenized with the ``data`` settings (seq_len, packing,
    fields); empty: no evaluation. ``steps``: evaluate every N optimizer steps, and always at the
    end (0: only at the end). ``max_batches``: at most N batches per data-parallel rank, each of
    ``train.per_device_train_batch_size`` samples, taken in file order (null: the whole set).
    """

    path: str = ""
    steps: int = 0
    max_batches: int | None = None


@dataclass
class Config:
    model: str = ""
    tokenizer: str | None = None
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoraConfig | None = field(default=None, metadata={"section": LoraConfig})
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step; the data order depends on this and the seed only."""
        t = self.train
        return t.per_device_train_batch_size * self.parallel.dp_size * t.gradient_accumulation_steps

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SCHEDULERS = ("constant", "linear", "cosine")


def _build(cls: type, values: Any, prefix: str) -> Any:
    """Build dataclass ``cls`` from a mapping, refusing unknown keys and wrong types by name."""
    if values is None:
        values = {}
    if not isinstance(values, dict):
        where = f"'{prefix.rstrip('.')}'" if prefix else "the config"
        raise ConfigError(f"{where} must be a mapping of keys, got {values!r}")
    known = {f.name: f for f in fields(cls)}
    kwargs = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if key not in known:
            raise ConfigError(f"unknown config key '{name}'; valid keys here: {', '.join(known)}")
        f = known[key]
        if "section" in f.metadata:  # an optional section (``lora``): absent or null means off
            kwargs[key] = None if value is None else _build(f.metadata["section"], value, f"{name}.")
        elif dataclasses.is_dataclass(f.default_factory if f.default_factory is not dataclasses.MISSING else None):
            kwargs[key] = _build(f.default_factory, value, f"{name}.")
        else:
            kwargs[key] = _coerce(f, value, name)
    return cls(**kwargs)


def _coerce(f: dataclasses.Field, value: Any, name: str) -> Any:
    """Check a leaf value against the field's declared type (ints accept whole floats, floats ints)."""
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    if value is None:
        if "None" in kind:
            return None
        raise ConfigError(f"config key '{name}' must not be null")
    if kind.startswith("int"):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
            raise ConfigError(f"config key '{name}' must be an integer, got {value!r}")
        return int(value)
    if kind.startswith("float"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"config key '{name}' must be a number, got {value!r}")
        return float(value)
    if kind == "bool" and not isinstance(value, bool):
        raise ConfigError(f"config key '{name}' must be true or false, got {value!r}")
    if kind.startswith("str") and not isinstance(value, str):
        raise ConfigError(f"config key '{name}' must be a string, got {value!r}")
    return value


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply ``a.b.c=value`` strings to a nested dict; values are parsed as YAML scalars."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' must look like KEY=VALUE, e.g. parallel.tp=2")
        key, _, text = item.partition("=")
        node = raw
        parts = key.strip().split(".")
        for part in parts[:-1]:
            if node.get(part) is None:  # absent, or an empty section (``data:`` with nothing under it)
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict):
                raise ConfigError(f"override '{item}': '{part}' is not a section")
        try:
            node[parts[-1]] = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError:
            raise ConfigError(f"override '{item}': the value is not valid YAML; put it in YAML quotes") from None
    return raw


def load_config(path: str | None = None, overrides: list[str] | None = None, raw: dict | None = None) -> Config:
    """Read a YAML file (or take ``raw``), apply overrides, build and validate the config."""
    if raw is None:
        if path is None or not os.path.isfile(path):
            raise ConfigError(f"config file '{path}' not found; pass the path of a YAML config")
        with open(path) as fh:
            try:
                raw = yaml.safe_load(fh) or {}
            except yaml.YAMLError as exc:
                line = getattr(getattr(exc, "problem_mark", None), "line", None)
                where = f" at line {line + 1}" if line is not None else ""
                raise ConfigError(f"config file '{path}' is not valid YAML{where}") from None
    if not isinstance(raw, dict):
        where = f"config file '{path}'" if path else "the config"
        raise ConfigError(f"{where} must be a mapping of keys (model, data, parallel, train)")
    raw = apply_overrides(copy.deepcopy(raw), overrides or [])  # the caller's ``raw`` stays as it was
    cfg = _build(Config, raw, "")
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Checks that need no process group: values, paths, and the layout against the model."""
    p, t, d = cfg.parallel, cfg.train, cfg.data
    for key in ("tp", "fsdp", "dp_replicate"):
        if getattr(p, key) < 1:
            raise ConfigError(f"parallel.{key} must be >= 1, got {getattr(p, key)}")
    for key in ("max_steps", "per_device_train_batch_size", "gradient_accumulation_steps", "logging_steps"):
        if getattr(t, key) < 1:
            raise ConfigError(f"train.{key} must be >= 1, got {getattr(t, key)}")
    if d.seq_len < 2:
        raise ConfigError(f"data.seq_len must be >= 2, got {d.seq_len}")
    if t.lr_scheduler_type not in SCHEDULERS:
        names = ", ".join(SCHEDULERS)
        raise ConfigError(f"train.lr_scheduler_type must be one of {names}, got '{t.lr_scheduler_type}'")
    if not cfg.model:
        raise ConfigError("config key 'model' is required: a Hugging Face model directory")
    if not os.path.isfile(os.path.join(cfg.model, "config.json")):
        raise ConfigError(f"model: '{cfg.model}' has no config.json; point 'model' at a Hugging Face model directory")
    d.check()
    _validate_checkpointing(t)
    _validate_training(t, cfg.eval)
    _validate_faults(t)
    from shardlm.plan import check_geometry  # local import: reading the model config pulls in transformers

    check_geometry(cfg.model, p.tp)
    from shardlm.parallelize import has_weights

    if has_weights(cfg.model):  # the checkpoint's names, converted by transformers' rules, cover the model
        from shardlm.published import check as check_weights

        check_weights(cfg.model)
    if p.world_size > 1:
        from shardlm.dropout import check_layerdrop

        check_layerdrop(cfg.model)
    if cfg.lora is not None:
        from shardlm.lora import check_lora

        check_lora(cfg)  # traces the plan too
    elif p.tp > 1:  # what only the traced plan can refuse (Falcon's fused kv groups, OLMo-2 at kv < tp)
        from shardlm.parallelize import build_meta_model
        from shardlm.plan import infer_plan

        infer_plan(build_meta_model(cfg.model), p.tp)


def _validate_checkpointing(t: TrainConfig) -> None:
    """Checkpoint keys (``checkpoint.py``): counts, and that a resume path exists before spawning."""
    if t.save_steps < 0:
        raise ConfigError(f"train.save_steps must be >= 0 (0 turns checkpoints off), got {t.save_steps}")
    if t.save_total_limit is not None and t.save_total_limit < 1:
        raise ConfigError(f"train.save_total_limit must be >= 1 or null, got {t.save_total_limit}")
    if not isinstance(t.resume, (bool, str)):
        raise ConfigError(f"train.resume must be true, false or a checkpoint path, got {t.resume!r}")
    if isinstance(t.resume, str) and not os.path.isdir(t.resume):
        raise ConfigError(f"train.resume: '{t.resume}' is not a directory; pass a checkpoint step-N or an output_dir")


def _validate_training(t: TrainConfig, e: EvalConfig) -> None:
    """Optimizer, reporting and evaluation keys (``optim.py``, ``metrics.py``, ``trainer.py``)."""
    if t.optim not in t.OPTIMIZERS:
        raise ConfigError(f"train.optim must be one of {', '.join(t.OPTIMIZERS)}, got '{t.optim}'")
    if t.sgd_momentum < 0:
        raise ConfigError(f"train.sgd_momentum must be >= 0, got {t.sgd_momentum}")
    if t.report_to not in t.REPORT_TO:
        raise ConfigError(f"train.report_to must be one of {', '.join(t.REPORT_TO)}, got '{t.report_to}'")
    if e.steps < 0:
        raise ConfigError(f"eval.steps must be >= 0 (0: evaluate only at the end), got {e.steps}")
    if e.max_batches is not None and e.max_batches < 1:
        raise ConfigError(f"eval.max_batches must be >= 1 or null (the whole set), got {e.max_batches}")
    if e.path:
        if not os.path.exists(e.path):
            raise ConfigError(f"eval.path: '{e.path}' does not exist")
        if os.path.isfile(e.path) and not e.path.lower().endswith(DataConfig.EXTENSIONS):
            raise ConfigError(f"eval.path: '{e.path}' is not a {', '.join(DataConfig.EXTENSIONS)} file")


def _validate_faults(t: TrainConfig) -> None:
    """Fault keys (``faults.py``, ``mesh.init_distributed``)."""
    if t.max_bad_steps < 1:
        raise ConfigError(
            f"train.max_bad_steps must be >= 1 (non-finite steps in a row before stopping), got {t.max_bad_steps}"
        )
    if not math.isfinite(t.timeout_s) or t.timeout_s <= 0:
        raise ConfigError(f"train.timeout_s must be a positive number of seconds (default 600), got {t.timeout_s}")
