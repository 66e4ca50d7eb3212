"""The run configuration as dataclasses: what every key means and its default (no I/O here).

Names follow Hugging Face ``TrainingArguments`` where one exists, so a user of the HF Trainer
recognises every key. ``load.py`` builds these from YAML and checks the values; checks that
need the model (its geometry, the traced plan, LoRA targets) are in ``shardlm.preflight``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import ClassVar

from shardlm.errors import ConfigError


@dataclass
class DataConfig:
    """Where the training text is and how it becomes samples (see ``data/dataset.py`` for every row kind).

    ``path``: a .txt (one document per line), .jsonl, .json or .parquet file, or a directory of
    them. Rows are plain text (``text_field``), a prompt/response pair (``prompt_field`` and
    ``response_field``: only the response is trained) or a chat (``messages_field``: a list of
    ``{role, content}`` rendered with the tokenizer's chat template; only assistant turns are
    trained). ``cache_dir``: where tokenized data is kept (default: the Hugging Face datasets cache).
    ``packing_strategy`` (with ``packing``; TRL's names): ``bfd``, whole documents best-fit into
    windows, each attending only to itself; ``wrapped``, one stream of all rows cut into windows
    (pretraining-style: tokens attend across documents). See docs/packing.md.
    """

    EXTENSIONS: ClassVar[tuple[str, ...]] = (".txt", ".jsonl", ".json", ".parquet")
    PACKING_STRATEGIES: ClassVar[tuple[str, ...]] = ("bfd", "wrapped")

    path: str = ""
    seq_len: int = 128
    packing: bool = True
    packing_strategy: str = "bfd"
    text_field: str = "text"
    prompt_field: str | None = None
    response_field: str | None = None
    messages_field: str | None = None
    cache_dir: str | None = None

    def check(self, key: str = "data.path") -> None:
        """Checks of the data section that need no tokenizer: path, extension, field combination;
        ``key``: the config key that named ``path`` (``eval.path`` for the eval set)."""
        kinds = ", ".join(self.EXTENSIONS)
        if not self.path:
            raise ConfigError(f"config key '{key}' is required: a {kinds} file or a directory of them")
        if not os.path.exists(self.path):
            raise ConfigError(f"{key}: '{self.path}' does not exist")
        if os.path.isfile(self.path) and not self.path.lower().endswith(self.EXTENSIONS):
            raise ConfigError(f"{key}: '{self.path}' is not a {kinds} file; convert it or point at a directory")
        if (self.prompt_field is None) != (self.response_field is None):
            raise ConfigError("data.prompt_field and data.response_field go together: set both or neither")
        if self.messages_field is not None and self.prompt_field is not None:
            raise ConfigError("data.messages_field excludes data.prompt_field/response_field: set one kind of row")


# the schedules of torch.distributed.pipelining that run several (virtual) stages on each rank, the V-shaped
# ones (stage ``s`` and ``2 pp - 1 - s`` on rank ``s``) named by PP_V_SHAPED; the others loop (``s``, ``s + pp``, ...)
PP_MULTI_STAGE = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
PP_V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
# the schedules that split a stage's backward into an input pass and a weight pass run later (zero bubble)
PP_SPLIT_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


@dataclass
class ParallelConfig:
    """How the world is split: ``pp x dp_replicate x fsdp x cp x tp`` processes (outermost first).

    ``ep``: expert parallelism, the experts of each mixture-of-experts layer divided between ``ep``
    ranks carved out of the data- and context-parallel ranks (as torchtitan does), ``fsdp x cp`` first: those
    ranks hold different tokens and exchange them with all-to-all (``parallel/runtime/ep.py``); it adds no processes.

    ``sequence_parallel``: with ``tp`` > 1, the residual stream inside the decoder blocks holds this
    rank's slice of the sequence (norms, residual adds, dropout on ``seq_len / tp`` positions;
    ``parallel/plan/sequence.py``, docs/long_sequences.md); it adds no processes.

    ``fsdp_offload``: ``cpu`` keeps each rank's FSDP shards of parameters, gradients and optimizer
    state in host memory between uses (FSDP2's ``CPUOffloadPolicy``, ``parallel/build.py``).

    ``cp``: context parallelism, each sample's sequence split between ``cp`` ranks that see the same
    samples, attention gathering the keys and values of the others (``parallel/runtime/context.py``);
    it adds processes, and FSDP shards over ``fsdp x cp``. ``cp_attention``: how those ranks meet in
    attention: ``all_gather`` of the keys and values (the default), or ``ulysses`` (DeepSpeed Ulysses /
    ALST: all-to-all exchanging tokens for heads, ``parallel/runtime/ulysses.py``).
    """

    OFFLOADS: ClassVar[tuple[str, ...]] = ("none", "cpu")
    CP_ATTENTIONS: ClassVar[tuple[str, ...]] = ("all_gather", "ulysses")

    tp: int = 1
    fsdp: int = 1
    dp_replicate: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    fsdp_offload: str = "none"  # none | cpu (needs dp_replicate*fsdp > 1)
    # pipeline parallelism (docs/pipeline.md): ``pp`` stages of decoder blocks, run by the named schedule of
    # torch.distributed.pipelining over ``pp_microbatches`` micro-batches per data-parallel rank and step
    pp: int = 1
    pp_schedule: str = "1F1B"
    pp_microbatches: int | None = None  # None: ``pp``
    # stages each rank holds under a multi-stage schedule (PP_MULTI_STAGE)
    pp_virtual_stages: int | None = None  # None: 2 under those, 1 under 1F1B and GPipe
    cp: int = 1
    cp_attention: str = "all_gather"  # all_gather | ulysses

    @property
    def world_size(self) -> int:
        return self.pp * self.tp * self.cp * self.fsdp * self.dp_replicate

    @property
    def pp_stages_per_rank(self) -> int:
        """Pipeline stages each rank holds: ``pp_virtual_stages``, by default 2 under a schedule that runs
        several a rank (``PP_MULTI_STAGE``), else 1."""
        if self.pp_virtual_stages is not None:
            return self.pp_virtual_stages
        return 2 if self.pp_schedule.lower() in (name.lower() for name in PP_MULTI_STAGE) else 1

    @property
    def pp_v_shaped(self) -> bool:
        """Whether the schedule places the stages in a V (``PP_V_SHAPED``) rather than in loops."""
        return self.pp_schedule.lower() in (name.lower() for name in PP_V_SHAPED)

    @property
    def pp_split_backward(self) -> bool:
        """Whether the schedule runs each stage's weight gradients in a pass of their own (``PP_SPLIT_BACKWARD``)."""
        return self.pp > 1 and self.pp_schedule.lower() in (name.lower() for name in PP_SPLIT_BACKWARD)

    @property
    def pp_chunks(self) -> int:
        """Micro-batches the schedule cuts each data-parallel rank's batch of a step into."""
        return self.pp_microbatches or self.pp

    @property
    def dp_size(self) -> int:
        """Data-parallel degree: how many different micro-batches are processed at once."""
        return self.fsdp * self.dp_replicate

    @property
    def ep_fits(self) -> bool:
        """``ep`` ranks can be carved out of the ranks holding different tokens, ``fsdp x cp`` (inner)
        first: ``ep`` divides ``fsdp x cp``, or is a multiple of it that divides ``dp_replicate x fsdp x cp``
        (``distributed/mesh.py``)."""
        inner, tokens = self.fsdp * self.cp, self.dp_size * self.cp
        return inner % self.ep == 0 or (self.ep % inner == 0 and tokens % self.ep == 0)


@dataclass
class LoraConfig:
    """LoRA adapters (``parallel/runtime/lora.py``), with peft's meaning: ``r`` (default 8), ``alpha`` (peft's
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
    compile: bool = False  # torch.compile each decoder block's forward (train/compile.py)
    seed: int = 0
    logging_steps: int = 1
    report_to: str = "none"  # none | tensorboard (event files under output_dir/tensorboard)
    save_steps: int = 0  # checkpoint every N steps and at the end; 0: no checkpoints
    save_total_limit: int | None = None  # keep the newest N complete checkpoints; None: all
    resume: bool | str = False  # true: newest complete checkpoint of output_dir; or a checkpoint path
    # a run that does not resume into an output_dir holding another run's checkpoints or metrics is
    # refused; true: remove them first, saying so (checkpoint/ownership.py)
    overwrite_output_dir: bool = False
    # faults (faults.py): stop after this many non-finite steps in a row (each one's update is skipped)
    max_bad_steps: int = 3
    # seconds any collective may wait for the other ranks before failing (every process group)
    timeout_s: float = 600.0
    # a multimodal checkpoint (Gemma 3's ForConditionalGeneration) trains on text rows: its language
    # model splits as any decoder; its vision/audio tower and projector stay whole and, unless this is
    # true, frozen (text rows give them no gradient either way)
    train_vision_tower: bool = False


@dataclass
class EvalConfig:
    """Held-out loss and perplexity during training (``train/trainer.py``).

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
