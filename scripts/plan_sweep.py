"""The plan-only sweep: the tp=2 plan of every causal-LM model type, as ``shardlm plan`` prints it.

For each type in transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, the tiny config of
``scripts/tiny.py`` is written to a directory and planned at tp=2 on the meta device, in this
process (no rank is spawned): the text ``shardlm plan --tp 2`` prints (the plan table, packed
projections, what is kept replicated and why), or the one line of a refusal, or the exception a
type raised (``Class: message``; some types do not build at tiny sizes). Then the same for every config
the tests change from a type's defaults (``tests/families.py: TEST_VARIANTS``, e.g. Doge-MoE), keyed by
type and overrides: the defaults alone miss a plan that regresses only there. Written as one JSON
object ``{type: text}`` with sorted keys, so two runs compare with ``cmp``: a refactor of
``parallel/`` that moves code without changing behaviour leaves the file byte-identical.

    python scripts/plan_sweep.py OUT.json [--jobs 2] [--types a,b] [--no-variants]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import sys
import tempfile
from multiprocessing import get_context
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "scripts"), str(REPO / "tests"), str(REPO / "src")]
PLAN_TIMEOUT_S = 600  # HRM's nested recurrent loops take a while on shared cores


class _Timeout(BaseException):
    """Not an Exception: shardlm's plan turns any Exception while tracing into a refusal."""


def _alarm(seconds: int) -> None:
    def handler(signum, frame):
        raise _Timeout(f"over {seconds} s")

    signal.signal(signal.SIGALRM, handler)
    signal.alarm(seconds)


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def plan_text(name: str) -> str:
    """What ``shardlm plan <tiny model> --tp 2`` prints for ``name`` (a model type, or a key of
    ``TEST_VARIANTS``), or its error line."""
    import warnings

    import transformers
    from families import TEST_VARIANTS, write_tiny_config

    from shardlm.cli import cmd_plan
    from shardlm.errors import ConfigError

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    with tempfile.TemporaryDirectory() as root:
        try:
            model_type, overrides = TEST_VARIANTS.get(name, (name, {}))
            write_tiny_config(root, model_type, overrides, round_trip=bool(overrides))
        except Exception as exc:  # noqa: BLE001 - recorded: the type has no tiny config
            return f"config: {_one_line(exc)}"
        out = io.StringIO()
        args = argparse.Namespace(model=root, tp=2, ep=1, pp=1, pp_microbatches=None, json=False)
        try:
            _alarm(PLAN_TIMEOUT_S)
            with contextlib.redirect_stdout(out):
                cmd_plan(args)
        except ConfigError as exc:
            return out.getvalue() + f"error: {' '.join(str(exc).replace(root, '<model>').split())}"
        except (Exception, _Timeout) as exc:  # noqa: BLE001 - a bug in shardlm, recorded with its class
            return out.getvalue() + _one_line(exc).replace(root, "<model>")
        finally:
            signal.alarm(0)
        return out.getvalue()


def _worker(name: str) -> tuple[str, str]:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return name, plan_text(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--types", default="", help="comma-separated model types (default: all)")
    parser.add_argument("--no-variants", action="store_true", help="the types' defaults alone, not TEST_VARIANTS")
    args = parser.parse_args()
    from families import TEST_VARIANTS
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    types = args.types.split(",") if args.types else sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    if not args.no_variants:
        types += [name for name, (model_type, _) in sorted(TEST_VARIANTS.items()) if model_type in types]
    results: dict[str, str] = {}
    with get_context("spawn").Pool(args.jobs, maxtasksperchild=20) as pool:
        for name, text in pool.imap_unordered(_worker, types):
            results[name] = text
            print(f"{len(results)}/{len(types)} {name}: {text.splitlines()[-1][:100] if text else ''}")
    Path(args.out).write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
