"""Where the numbers of a run go: progress on the terminal, metrics.jsonl, TensorBoard, a loss plot.

Only global rank 0 writes (``MetricsWriter``); every number it writes is already the same on all
ranks (loss and token counts are reduced over data parallelism, memory is the max over ranks).

* Progress: on a terminal a ``tqdm`` bar (step/max, loss, grad_norm, lr, tokens/s, ETA) updated
  every step; otherwise (a log file, CI, a pipe) one plain line per logging step, never a ``\\r``.
* ``output_dir/metrics.jsonl``: one JSON object per logging step (step, loss, grad_norm,
  learning_rate, tokens_per_second, step_time_s, peak_memory_mb, and mfu on GPU) and one per
  evaluation (step, eval_loss, eval_ppl, eval_tokens), each with the ``run_id`` that wrote it
  (``checkpoint/ownership.py``). A resumed run appends.
* ``report_to: tensorboard``: the same scalars under ``output_dir/tensorboard``.
* At the end ``output_dir/loss.png``: loss and eval loss against step, drawn from metrics.jsonl
  (so a resumed run's plot is whole), with the plotted points stored in the PNG's text chunk
  ``shardlm_series`` (JSON) for anyone who wants the numbers behind the picture.

MFU (GPU only) = 6 x parameters x tokens/s / (peak FLOP/s per GPU x GPUs), the usual dense
transformer estimate that ignores attention FLOPs; the peak comes from ``SHARDLM_PEAK_TFLOPS`` or
the table below (dense bf16 or fp32 peak, by device name).
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from typing import IO

import torch
import torch.distributed as dist
from torch import nn

from shardlm.config import TrainConfig
from shardlm.distributed.shards import as_local

PEAK_TFLOPS = (  # (substring of the lower-cased device name, dense bf16, dense fp32); first match wins
    ("h100 pcie", 756.0, 51.0),
    ("h100", 989.0, 67.0),
    ("h200", 989.0, 67.0),
    ("b200", 2250.0, 80.0),
    ("a100", 312.0, 19.5),
    ("l40s", 362.0, 91.6),
    ("l4", 121.0, 30.3),
    ("a10", 125.0, 31.2),
    ("4090", 165.0, 82.6),
    ("v100", 125.0, 15.7),
)


def peak_memory_mb(device: torch.device) -> float:
    """This process's peak memory: CUDA ``max_memory_allocated`` on GPU, peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


def max_over_ranks(value: float, device: torch.device) -> float:
    """The largest ``value`` of any rank (a collective: every rank calls it)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor(value, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def count_params(model: nn.Module) -> int:
    """Parameters of the whole model (global shapes of DTensors; tied ones once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def describe_trainable(model: nn.Module) -> str:
    """Trainable vs all parameters, and this rank's AdamW state (2 fp32 tensors per trainable
    element, from the pieces it holds) against what full fine-tuning would keep."""
    params = list({id(p): p for p in model.parameters()}.values())
    trainable = sum(p.numel() for p in params if p.requires_grad)
    total = sum(p.numel() for p in params)
    mine = sum(as_local(p).numel() for p in params if p.requires_grad) * 8
    full = sum(as_local(p).numel() for p in params) * 8
    return (
        f"LoRA: {trainable:,} trainable parameters of {total:,} ({100 * trainable / total:.2f}%); "
        f"optimizer state {mine / 1e6:.2f} MB per rank (full fine-tuning: {full / 1e6:.2f} MB)"
    )


def peak_tflops(device: torch.device, bf16: bool) -> float | None:
    """Dense peak TFLOP/s of one device: ``SHARDLM_PEAK_TFLOPS``, else the table; None on CPU or unknown."""
    if os.environ.get("SHARDLM_PEAK_TFLOPS"):
        return float(os.environ["SHARDLM_PEAK_TFLOPS"])
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).lower()
    for key, bf16_peak, fp32_peak in PEAK_TFLOPS:
        if key in name:
            return bf16_peak if bf16 else fp32_peak
    return None


def mfu(num_params: int, tokens_per_second: float, num_devices: int, peak: float) -> float:
    """Model FLOPs utilization: 6 N tokens/s over the devices' peak (``peak`` in TFLOP/s per device)."""
    return 6.0 * num_params * tokens_per_second / (peak * 1e12 * num_devices)


def _eta(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60:02d}:{rest % 60:02d}"


class Progress:
    """A tqdm bar when ``stream`` is a terminal, else one plain line per logging step."""

    def __init__(self, max_steps: int, start_step: int, stream: IO[str] | None = None):
        self.stream = stream if stream is not None else sys.stdout
        self.max_steps, self.start_step, self.start = max_steps, start_step, time.perf_counter()
        self.bar = None
        if getattr(self.stream, "isatty", lambda: False)():
            from tqdm import tqdm

            self.bar = tqdm(total=max_steps, initial=start_step, file=self.stream, unit="step", dynamic_ncols=True)

    def step(self, record: dict) -> None:
        """Every optimizer step: move the bar (terminal only)."""
        if self.bar is not None:
            self.bar.update(record["step"] - self.bar.n)
            self.bar.set_postfix_str(
                f"loss {record['loss']:.4f} grad_norm {record['grad_norm']:.3f} lr {record['learning_rate']:.2e} "
                f"tok/s {record['tokens_per_second']:.0f}"
            )

    def log(self, record: dict) -> None:
        """A logging step: one line (not on a terminal, where the bar already shows it)."""
        if self.bar is None:
            done = record["step"] - self.start_step
            eta = (time.perf_counter() - self.start) / max(done, 1) * (self.max_steps - record["step"])
            self.write(
                f"step {record['step']:>5}/{self.max_steps}  loss {record['loss']:.4f}  "
                f"grad_norm {record['grad_norm']:.4f}  lr {record['learning_rate']:.2e}  "
                f"tok/s {record['tokens_per_second']:.0f}  eta {_eta(eta)}"
            )

    def write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class MetricsWriter:
    """Rank 0's sinks for step and eval records; a no-op object on other ranks."""

    def __init__(
        self,
        cfg: TrainConfig,
        start_step: int,
        append: bool,
        enabled: bool,
        stream: IO[str] | None = None,
        run_id: str | None = None,
    ):
        self.enabled, self.run_id = enabled, run_id
        self.path = os.path.join(cfg.output_dir, "metrics.jsonl")
        self.plot_path = os.path.join(cfg.output_dir, "loss.png")
        self.tb = None
        if not enabled:
            return
        os.makedirs(cfg.output_dir, exist_ok=True)
        if not append:
            open(self.path, "w").close()
        self.progress = Progress(cfg.max_steps, start_step, stream)
        if cfg.report_to == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=os.path.join(cfg.output_dir, "tensorboard"))

    def _append(self, record: dict) -> None:
        with open(self.path, "a") as fh:
            fh.write(json.dumps({**record, "run_id": self.run_id} if self.run_id else record) + "\n")
        if self.tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    name = f"eval/{key[5:]}" if key.startswith("eval_") else f"train/{key}"
                    self.tb.add_scalar(name, value, record["step"])

    def step(self, record: dict) -> None:
        if self.enabled:
            self.progress.step(record)

    def log(self, record: dict) -> None:
        if self.enabled:
            self._append(record)
            self.progress.log(record)

    def log_eval(self, record: dict) -> None:
        if self.enabled:
            self._append(record)
            step, loss, ppl = record["step"], record["eval_loss"], record["eval_ppl"]
            self.progress.write(f"eval  step {step:>5}  eval_loss {loss:.4f}  eval_ppl {ppl:.3f}")

    def close(self, plot: bool = True) -> None:
        """Finish the bar and TensorBoard; draw ``loss.png`` unless ``plot`` is false."""
        if not self.enabled:
            return
        self.progress.close()
        if self.tb is not None:
            self.tb.close()
        if plot:
            plot_loss(self.path, self.plot_path)


def read_series(metrics_path: str) -> dict[str, tuple[list[int], list[float]]]:
    """``{"loss": (steps, values), "eval_loss": (...)}`` from metrics.jsonl; the last record of a step
    wins (a resumed run may log a step again)."""
    series: dict[str, dict[int, float]] = {"loss": {}, "eval_loss": {}}
    with open(metrics_path) as fh:
        for line in fh:
            if line.strip():
                record = json.loads(line)
                for key, points in series.items():
                    if key in record and math.isfinite(record[key]):
                        points[record["step"]] = record[key]
    return {key: (sorted(points), [points[s] for s in sorted(points)]) for key, points in series.items()}


def plot_loss(metrics_path: str, png_path: str) -> dict[str, tuple[list[int], list[float]]]:
    """Draw loss (and eval loss) against step into ``png_path`` (Agg, no pyplot state); returns the points."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    series = read_series(metrics_path)
    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    styles = {"loss": {"label": "train loss", "linewidth": 1.2}, "eval_loss": {"label": "eval loss", "marker": "o"}}
    for key, (steps, values) in series.items():
        if steps:
            ax.plot(steps, values, **styles[key])
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    if any(steps for steps, _ in series.values()):
        ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, format="png", metadata={"shardlm_series": json.dumps(series)})
    return series
