"""`python -m stagewise.server --model DIR --port P [engine options]`: a minimal launcher used by
tests and benchmarks. Every EngineConfig field is a flag (defaults from the dataclass); the
user-facing command is `stagewise serve`.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from ..config import EngineConfig

_STRING_FIELDS = {"kv_cache_memory", "pp_layer_partition", "prefill_graph_buckets"}   # parsed by EngineConfig


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        kind = str(f.type)
        if kind == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        elif f.name in _STRING_FIELDS or kind.startswith("str"):
            parser.add_argument(flag, type=str, default=f.default)
        elif kind.startswith("int"):
            parser.add_argument(flag, type=int, default=f.default)
        elif kind.startswith("float"):
            parser.add_argument(flag, type=float, default=f.default)
        else:
            parser.add_argument(flag, type=str, default=f.default)


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    return EngineConfig(**{k: v for k, v in vars(args).items() if k in names})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m stagewise.server", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--graceful-timeout", type=float, default=10.0, help="seconds to wait for open requests")
    parser.add_argument("--log-level", default="info")
    add_engine_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    from .app import run_server
    try:
        run_server(config, args.host, args.port, args.served_model_name,
                   graceful_timeout_s=args.graceful_timeout, log_level=args.log_level)
    except (ValueError, FileNotFoundError) as exc:
        print(f"stagewise server: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
