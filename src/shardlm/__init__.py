"""shardlm: train Hugging Face causal LMs with tensor parallelism x FSDP2 on PyTorch's own engine.

Imports are eager on purpose: ``shardlm.parallel.build`` is both a submodule and the function it
exports, and a lazy (PEP 562) package would hand out the module once any code imported it.
"""

from shardlm.config import Config, DataConfig, LoraConfig, ParallelConfig, TrainConfig, load_config
from shardlm.distributed.mesh import Mesh, build_mesh, init_distributed
from shardlm.distributed.shards import full_tensor
from shardlm.errors import ConfigError
from shardlm.parallel.build import parallelize
from shardlm.parallel.infer.autotp import infer_tp_plan
from shardlm.train.trainer import Trainer, run

__all__ = [
    "Config",
    "ConfigError",
    "DataConfig",
    "LoraConfig",
    "Mesh",
    "ParallelConfig",
    "TrainConfig",
    "Trainer",
    "build_mesh",
    "full_tensor",
    "infer_tp_plan",
    "init_distributed",
    "load_config",
    "parallelize",
    "run",
]

__version__ = "0.1.0"
