"""Where a shardlm step goes, profiled alone: the share of DTensor's dispatch in one step of a bench layout.

``bench.py`` profiles one step beside transformers in the same ranks; this runs shardlm only (from the
``shardlm`` on ``PYTHONPATH``: point it at an older ``src/``, e.g. one ``git archive`` exported, to compare),
2 warm-up steps, then ``--repeats`` profiled steps on rank 0 (``bench._profile``, without cProfile): per
step its wall time, the self CPU time of every op the profiler records, of the collectives, and of DTensor's
dispatch (``PythonSubclass``, ``_FromTorchTensor``/``_ToTorchTensor``, ``Redistribute``), each as a share of
the wall time; the median over the repeats.

    PYTHONPATH=src python benchmarks/tp_profile.py [--layout tp2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402


def rank_main(path: str, layout: dict, repeats: int) -> list[dict]:
    from shardlm import init_distributed

    init_distributed()
    run = bench.ShardlmRun(path, layout, bench.make_dataset(repeats + bench.WARMUP))
    for _ in range(bench.WARMUP):
        run.step()
    return [bench._profile(run.step, python=False) for _ in range(repeats)]


def main() -> None:
    import shardlm
    from shardlm.distributed.launch import spawn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", default="tp2")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    _, layout = bench.LAYOUTS[args.layout]
    world = layout.get("tp", 1) * layout.get("fsdp", 1)
    with tempfile.TemporaryDirectory() as tmp:
        path = bench.write_model(os.path.join(tmp, "llama"))
        steps = spawn(rank_main, world, path, layout, args.repeats)[0]

    def share(key: str) -> float:
        return statistics.median(s[key] / s["wall_s"] for s in steps)

    out = {
        "shardlm": os.path.dirname(shardlm.__file__),
        "layout": args.layout,
        "wall_ms": statistics.median(s["wall_s"] for s in steps) * 1e3,
        "dtensor_share": share("dtensor_s"),
        "collectives_share": share("collectives_s"),
        "ops_share": share("aten_self_s"),
        "top_ops": steps[0]["top_ops"][:8],
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
