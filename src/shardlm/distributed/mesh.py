"""Process group and DeviceMesh for a ``ParallelConfig``.

The world is one 5-D mesh ``(pp, dp_replicate, fsdp, cp, tp)``: TP innermost so its frequent
collectives stay between neighbouring ranks (the same GPU node), context parallelism next (its
ranks exchange keys and values every layer), data parallelism outside, the pipeline stages
outermost (``parallel.pp``: one activation per micro-batch crosses between them). gloo on CPU,
NCCL on CUDA. A one-process run still gets a (1, 1, 1, 1, 1) mesh so every code path is the same.

Context parallelism (``parallel.cp``): the ``cp`` ranks of a group read the same samples and hold
different chunks of their sequences (``parallel/runtime/context.py``), so their parameters are
replicated like data-parallel ranks': FSDP2 shards over ``fsdp x cp`` flattened (torchtitan's
``dp_shard_cp``), which sums the parameters' gradients over cp too, and the loss and its token
count are summed over ``dp x cp`` (``sum_over_tokens``).

Expert parallelism (``parallel.ep``) adds no processes: the ranks holding different tokens,
``(dp_replicate, fsdp, cp)`` flattened (cp inner), are unflattened into ``(edp, ep)``, ``ep`` inner
(neighbouring ranks exchange tokens), on the same root mesh. ``ep`` dividing ``fsdp x cp`` carves it
out of those ranks, the cp ranks first (torchtitan carves EP out of its ``dp_shard_cp`` likewise);
``ep`` a multiple of ``fsdp x cp`` also takes ``ep / (fsdp x cp)`` of the ``dp_replicate`` ranks
(``ep=2`` alone is ``dp_replicate=2``: dense parameters replicated, experts halved). Either way the EP
ranks hold different tokens (other micro-batches, or other chunks of the same windows): the
all-to-all only moves each token to its expert and back, whichever window it came from, so an
expert's gradient sums every token routed to it from the EP group. The experts' parameters live on
``(ep, tp)`` and their gradients are summed over the ranks left, ``edp``, which hold the same
experts (the loss is token-weighted over ``dp x cp``, so that sum is the one FSDP makes for the
dense parameters). Under ``parallel.pp`` all of this is per stage (the flattened ranks are a
pipeline rank's): an EP group's all-to-alls never wait on another stage's ranks.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardlm.config import ParallelConfig
from shardlm.errors import ConfigError

MESH_DIMS = ("pp", "dp_replicate", "fsdp", "cp", "tp")  # pp outermost: stages exchange one activation per micro-batch


@dataclass
class Mesh:
    """The world mesh and the views of it the rest of the code needs."""

    world: DeviceMesh
    parallel: ParallelConfig
    ep_world: DeviceMesh | None = None  # (edp, ep, tp) when parallel.ep > 1
    # the sub-meshes sliced so far, by dim names: slicing builds a new DeviceMesh each time (~1 ms of
    # Python), and the trainer asks for the tp and dp views several times every step
    _views: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def _view(self, *names: str) -> DeviceMesh:
        """``world[names]``, sliced once."""
        if names not in self._views:
            self._views[names] = self.world[names[0] if len(names) == 1 else names]
        return self._views[names]

    @property
    def experts(self) -> DeviceMesh:
        """The ``(ep, tp)`` mesh the experts' parameters are placed on (``parallel/runtime/ep.py``)."""
        if self.ep_world is None:
            raise ValueError("Mesh.experts: parallel.ep is 1, the experts are placed by TP and FSDP")
        return self.ep_world["ep", "tp"]

    @property
    def expert_dp_group(self) -> dist.ProcessGroup | None:
        """The data- and context-parallel ranks holding the same experts, over which their gradients are
        summed (None: there are none besides this rank)."""
        if self.ep_world is None or self.parallel.dp_size * self.parallel.cp == self.parallel.ep:
            return None
        return self.ep_world["edp"].get_group()

    @property
    def tp(self) -> DeviceMesh:
        return self._view("tp")

    @property
    def pp(self) -> DeviceMesh:
        """The pipeline stages holding this rank's place in the other dims (``parallel.pp``)."""
        return self._view("pp")

    @property
    def cp(self) -> DeviceMesh:
        return self._view("cp")

    @property
    def dp(self) -> DeviceMesh:
        """Mesh that FSDP2 shards over: 1-D ``fsdp``, or 2-D ``(dp_replicate, fsdp)`` for HSDP;
        with context parallelism ``fsdp`` is ``fsdp x cp`` flattened (``fsdp_cp``)."""
        shard = "fsdp_cp" if self.parallel.cp > 1 else "fsdp"
        if self.parallel.dp_replicate > 1:
            return self._view("dp_replicate", shard)
        return self._view(shard)

    @property
    def shards_parameters(self) -> bool:
        """FSDP2 is applied: more than one rank holds the same parameters (data- or context-parallel)."""
        return self.parallel.dp_size * self.parallel.cp > 1

    def sum_over_tokens(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` summed in place over every rank holding different tokens of the global batch (the
        data-parallel ranks and, within each, the context-parallel ranks), and returned."""
        self.sum_over_dp(value)
        if self.parallel.cp > 1:
            dist.all_reduce(value, group=self.cp.get_group())
        return value

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """One group over every data-parallel rank (both dp dims), for loss and token counts."""
        if self.parallel.dp_replicate > 1:
            return self._view("dp_replicate", "fsdp")._flatten("dp").get_group()
        return self._view("fsdp").get_group()

    def sum_over_dp(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` summed in place over every data-parallel rank (token counts, loss sums), and
        returned; a no-op on one data-parallel rank."""
        if self.parallel.dp_size > 1:
            dist.all_reduce(value, group=self.dp_group)
        return value

    @property
    def dp_rank(self) -> int:
        return self._view("dp_replicate").get_local_rank() * self.parallel.fsdp + self._view("fsdp").get_local_rank()

    @property
    def device(self) -> torch.device:
        if self.world.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


# glibc's mallopt parameter numbers, and the threshold shardlm fixes on CPU (``tune_cpu_allocator``)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_BYTES = 8 * 2**20


def tune_cpu_allocator() -> None:
    """On CPU, fix glibc's mmap threshold at 8 MiB (trim threshold 16 MiB), once per process.

    Why: left to itself glibc mmaps blocks of 128 KiB and up at first, but raises that threshold
    (up to 32 MiB) each time such a block is freed, so later tensors come from the heap, which
    keeps what they freed. The resident memory of a rank then grew step after step above what is
    alive (349M Llama, tp2 x fsdp2: 2125, 2853, 3165, 2964 MiB peaks in steps 1-4, even with a
    trim after each step), a peak ``shardlm estimate`` cannot predict. Fixing the threshold low,
    at 128 KiB, kept it flat (2.08 GB) but made every activation a fresh mapping that the kernel
    faults in and zeroes on each allocation: a step a third slower than glibc's own threshold
    (tp=2 1.31x, fsdp=2 1.40x, tp2 x fsdp2 1.58x the CPU time, ``benchmarks/against.py``; 160M
    Llama at tp=2 40.2 s against 23.8 s a step). At 8 MiB only tensors that large are mapped,
    whose fault-in is small against the matmul that fills them, and the peaks stay flat: 2051,
    2271, 2270, 2251 MiB (160M at tp=2: 23.4 s a step, 1549 MiB -> 1503). A
    ``MALLOC_MMAP_THRESHOLD_`` set in the environment wins; on CUDA the caching allocator holds
    tensors, so nothing is changed.
    """
    libc = _glibc()
    if libc is not None and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        libc.mallopt(M_TRIM_THRESHOLD, 2 * MMAP_THRESHOLD_BYTES)  # glibc's own ratio, fixed with it


class FreedMemory:
    """On CPU, hands the heap's free pages back to the OS (``malloc_trim``) after a training step
    when the resident memory has grown: after the first two steps, which set a ceiling (the higher
    of their two levels: the first makes the optimizer's state, from the second on every step makes
    the same tensors), and after any later step that ends more than glibc's trim threshold
    (``M_TRIM_THRESHOLD``, 16 MiB) above that ceiling.

    Why not after every step: the heap's freed pages are what the next step allocates again, so
    trimming them only makes the kernel fault in and zero them once more: measured 25-40 ms of a
    190 ms tp=2 bench step (CPU, ``benchmarks/README.md``), 3.5 ms of it the trim itself. What the
    trim guards against is creep, the heap growing step after step above what is alive (fragments,
    a changed allocation pattern: eval, a checkpoint save); the ceiling catches that, so a step
    never ends more than 16 MiB above the level of the second. When the memory alive itself grows
    past the ceiling (a trim leaves more than it), that step's level becomes the ceiling. No-op on
    CUDA and off glibc."""

    def __init__(self) -> None:
        self.ceiling = 0
        self.steps = 0

    def after_step(self) -> bool:
        """Trim if this is one of the first two steps or the resident memory is above the ceiling
        (class docstring); whether it did."""
        libc = _glibc()
        if libc is None:
            return False
        self.steps += 1
        rss = resident_bytes()
        if self.steps > 2 and rss <= self.ceiling + 2 * MMAP_THRESHOLD_BYTES:
            return False
        libc.malloc_trim(0)
        if self.steps <= 2 or resident_bytes() > self.ceiling:
            self.ceiling = max(self.ceiling, rss)
        return True


def resident_bytes() -> int:
    """Resident memory of this process (Linux's /proc); 0 where there is none."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """glibc on a CPU-only Linux process, else None (musl has neither ``mallopt``'s thresholds
    nor ``malloc_trim``)."""
    if device_type() != "cpu" or not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def init_distributed(timeout_s: float = 600.0) -> None:
    """Join the process group described by the environment (torchrun / our launcher), or make a
    one-process group when there is none.

    ``timeout_s`` (``train.timeout_s``) bounds every collective of every process group: a rank
    that never joins makes the others fail after that long instead of hanging. torch's
    ``new_group`` (which DeviceMesh uses for its dimensions and ``_flatten``) does not inherit the
    default group's timeout but reads ``distributed_c10d.default_pg_timeout`` (and
    ``default_pg_nccl_timeout``), 30 and 10 minutes; both are set to ``timeout_s`` here so that
    every group created later gets it too."""
    if dist.is_initialized():
        return
    tune_cpu_allocator()
    # on CUDA, CPU tensors go through gloo: the shards ``parallel.fsdp_offload=cpu`` keeps on the host
    # (gradient norm, TP-partial sums) are summed where they are, as torchtitan does for its offload
    backend = "cuda:nccl,cpu:gloo" if device_type() == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    c10d.default_pg_timeout = timeout
    if isinstance(c10d.default_pg_nccl_timeout, timedelta):  # None in a build without NCCL
        c10d.default_pg_nccl_timeout = timeout
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if device_type() == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def leave_distributed() -> None:
    """After a run that ended well on every rank: wait for the others, then destroy the process groups.

    Why: under torchrun every rank is a process of its own that exits when its run returns; one leaving while
    another is still in its last collective, or still reading the rendezvous store another node's agent hosts,
    aborts that one (SIGABRT in the two-node test, under load, after the last step). Only where every rank got
    here: a rank that failed is not waited for."""
    if dist.is_initialized():
        dist.barrier()
        _BUILT.clear()
        dist.destroy_process_group()


def build_mesh(parallel: ParallelConfig) -> Mesh:
    """Mesh for ``parallel``; refuses a layout whose product is not the world size."""
    world_size = dist.get_world_size()
    if parallel.world_size != world_size:
        raise ConfigError(
            f"parallel: pp*dp_replicate*fsdp*cp*tp = "
            f"{parallel.pp}*{parallel.dp_replicate}*{parallel.fsdp}*{parallel.cp}*{parallel.tp} = "
            f"{parallel.world_size} but the world has {world_size} processes; make the product equal the process count"
        )
    key = (device_type(), parallel.pp, parallel.dp_replicate, parallel.fsdp, parallel.cp, parallel.tp, parallel.ep)
    built = _BUILT.get(key)
    if built is None or built[0] is not dist.group.WORLD:  # a group made again (a test) makes them again
        built = _BUILT[key] = (dist.group.WORLD, *_world_meshes(parallel))
    return Mesh(built[1], parallel, built[2])


# The meshes already built in this process, by layout, with the default group they were built in. torch's
# ``init_device_mesh`` makes new process groups at every call, and a gloo group keeps its threads and sockets
# until the process ends: a process that trains one model after another (the test suite's pooled ranks, a
# notebook) gathered 15 threads and 22 file descriptors a rank for every tp2 x fsdp2 mesh (4 ranks, 30 meshes:
# 455 threads a rank), until the machine ran out of threads. Built once, the same groups serve every run.
_BUILT: dict[tuple, tuple] = {}


def _world_meshes(parallel: ParallelConfig) -> tuple[DeviceMesh, DeviceMesh | None]:
    """The world mesh of ``parallel`` (its flattened views made) and the experts' mesh when ``parallel.ep > 1``."""
    shape = (parallel.pp, parallel.dp_replicate, parallel.fsdp, parallel.cp, parallel.tp)
    world = init_device_mesh(device_type(), shape, mesh_dim_names=MESH_DIMS)
    if parallel.cp > 1:
        world["fsdp", "cp"]._flatten("fsdp_cp")  # FSDP2's shard dim (``Mesh.dp``)
    ep_world = None
    if parallel.ep > 1:
        tokens = parallel.dp_size * parallel.cp  # the ranks holding different tokens, cp inner
        dp = world["dp_replicate", "fsdp", "cp"]._flatten("dp_cp")
        flat = DeviceMesh._concatenate([dp, world["tp"]])  # (dp_cp, tp), the stage's ranks
        ep_world = flat._unflatten("dp_cp", (tokens // parallel.ep, parallel.ep), ("edp", "ep"))
    return world, ep_world
