"""The plan-only sweep: the tp=2 plan of every causal-LM model type, as ``shardlm plan`` prints it.

For each type in transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, the tiny config of
``scripts/tiny.py`` is written to a directory and planned at tp=2 on the meta device, in this
process (no rank is spawned): the text ``shardlm plan --tp 2`` prints (the plan table, packed
projections, what is kept replicated and why), or the one line of a refusal, or the exception a
type raised (``Class: message``; some types do not build at tiny sizes). Written as one JSON
object ``{type: text}`` with sorted keys, so two runs compare with ``cmp``: a refactor of
``parallel/`` that moves code without changing behaviour leaves the file byte-identical.

    python scripts/plan_sweep.py OUT.json [--jobs 2] [--types a,b]
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
sys.path[:0] = [str(REPO / "scripts"), str(REPO / "src")]
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


def plan_text(model_type: str) -> str:
    """What ``shardlm plan <tiny model> --tp 2`` prints for ``model_type``, or its error line."""
    import warnings

    import transformers
    from tiny import tiny_config

    from shardlm.cli import cmd_plan
    from shardlm.errors import ConfigError

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    with tempfile.TemporaryDirectory() as root:
        try:
            config = tiny_config(model_type)
            config.save_pretrained(root)
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


def _worker(model_type: str) -> tuple[str, str]:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return model_type, plan_text(model_type)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--types", default="", help="comma-separated model types (default: all)")
    args = parser.parse_args()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    types = args.types.split(",") if args.types else sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    results: dict[str, str] = {}
    with get_context("spawn").Pool(args.jobs, maxtasksperchild=20) as pool:
        for model_type, text in pool.imap_unordered(_worker, types):
            results[model_type] = text
            print(f"{len(results)}/{len(types)} {model_type}: {text.splitlines()[-1][:100] if text else ''}")
    Path(args.out).write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
