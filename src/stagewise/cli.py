"""`stagewise serve | generate | bench | plan | demo-model`.

Engine flags are generated from EngineConfig's fields (defaults come from the dataclass);
every command that builds an engine accepts all of them.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
import typing

from .config import EngineConfig
from .errors import EngineDeadError

SIZE_FIELDS = ("kv_cache_memory",)    # "2GiB", "512MiB" or bytes
ALIASES = {"pp_size": ["--pipeline-parallel-size"]}
HELP = {
    "model": "HF checkpoint directory or .gguf file; 'demo' for the tiny random demo model "
             "(default: SmolLM2-135M-Instruct, downloaded once)",
    "kv_cache_memory": "KV cache bytes per stage, e.g. 2GiB (default: planned from memory)",
    "chunked_prefill_size": "token budget of one step (prefill chunks + decodes)",
    "pp_size": "pipeline stages (processes)",
    "pp_layer_partition": "layers per stage, e.g. 3,3,2,2",
    "pp_sync": "keep one plan in flight (no micro-batching; for comparison)",
    "prefill_graph": "auto | breakable | full | compiled | off",
    "prefill_graph_max_tokens": "largest captured prefill bucket",
    "prefill_graph_buckets": "explicit bucket list, e.g. 16,32,64",
    "decode_graph": "capture decode graphs per batch size",
    "dist_ifname": "network interface for traffic between pipeline ranks (default: the one routing to "
                   "--master-addr; GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME win when set)",
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    hints = typing.get_type_hints(EngineConfig)
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        flags = ["--" + f.name.replace("_", "-")] + ALIASES.get(f.name, [])
        kind = hints[f.name]
        if kind is bool:
            group.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default,
                               help=HELP.get(f.name))
        else:
            conv = int if kind in (int, int | None) else float if kind in (float, float | None) else str
            conv = str if f.name in SIZE_FIELDS else conv
            group.add_argument(*flags, dest=f.name, type=conv, default=f.default, help=HELP.get(f.name),
                               metavar=f.name.upper())


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The engine config of a command, with `--model` resolved to a local path (default model if absent)."""
    from .model.source import resolve_model
    config = EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})
    return config.replace(model=resolve_model(config.model))


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--sample-seed", dest="sample_seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--stop", action="append", default=None)
    g.add_argument("--ignore-eos", action="store_true")


def sampling_from_args(args):
    from .request import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          seed=args.sample_seed, stop=args.stop, ignore_eos=args.ignore_eos)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stagewise", description="Pipeline-parallel LLM inference with captured prefill graphs.")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("generate", help="generate text offline and stream it to the terminal")
    p.add_argument("--prompt", action="append", help="prompt text (repeat for several)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap each prompt in the model's chat template (default: when the model has one)")
    add_sampling_args(p)
    add_engine_args(p)
    p = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    _add_serve_args(p)
    add_engine_args(p)
    p = sub.add_parser("bench", help="offline throughput on random prompts")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    add_engine_args(p)
    p = sub.add_parser("plan", help="print each stage's layers, weight bytes and KV capacity; launches nothing")
    add_engine_args(p)
    p = sub.add_parser("demo-model", help="write the built-in demo checkpoint (tiny Llama + tokenizer)")
    p.add_argument("--out", default=None, help="output directory (default: the demo cache directory)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return COMMANDS[args.command](args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except EngineDeadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def cmd_demo_model(args) -> int:
    from .model.demo import build_demo_model, ensure_demo_model
    out = build_demo_model(args.out) if args.out else ensure_demo_model()
    print(out)
    return 0


def _worker_role(config: EngineConfig) -> int | None:
    """Run as a stage (torchrun rank > 0 or a non-driver node) and return its exit code; None = driver.
    Every pipeline node first picks the network interface it talks on (errors here are the user's to fix)."""
    from .checkpoint import eos_token_ids_of, load_hf_config
    from .executor.launch import run_headless, torchrun_env
    from .executor.netif import use_interface
    from .executor.watchdog import exit_now, install as install_stop_watchdog
    install_stop_watchdog()
    env = torchrun_env()
    if config.pp_size > 1 or env:
        use_interface(env["addr"] if env else config.master_addr, config.dist_ifname)
    model_dir = config.model
    if not (env and env["rank"] > 0) and config.node_rank == 0:
        return None
    eos_ids = eos_token_ids_of(model_dir, load_hf_config(model_dir))
    if env and env["rank"] > 0:
        from .executor.stage_proc import stage_main
        stage_main(config, model_dir, env["rank"] - 1, env["addr"], env["port"], eos_ids, spawned=False)
        return 0
    exit_now(run_headless(config, model_dir, eos_ids))    # a headless node has nothing to tear down


def _exit_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so `finally` blocks stop every stage process; a process stuck in
    torch.distributed is stopped by a watchdog instead."""
    from .executor.watchdog import install as install_stop_watchdog
    install_stop_watchdog()


def cmd_generate(args) -> int:
    from .llm import LLM
    _exit_on_sigterm()
    config = config_from_args(args)
    role = _worker_role(config)
    if role is not None:
        return role
    with LLM(**dataclasses.asdict(config)) as llm:
        engine = llm.engine
        chat = args.chat if args.chat is not None else bool(getattr(engine.tok.tokenizer, "chat_template", None))
        prompts = args.prompt or ["What is the capital of France?" if chat else "The capital of France is"]
        params = sampling_from_args(args)
        for prompt in prompts:
            text = engine.tok.chat_prompt([{"role": "user", "content": prompt}]) if chat else prompt
            # NOTE: queued before anything is printed, so a refused prompt is only its error
            req = engine.add_request(text, params)
            # with the template, show the question, not the template around it
            print(prompt, end="\n" if chat else "", flush=True)
            _stream(engine, req.request_id)
    return 0


def _stream(engine, request_id: str) -> None:
    shown = 0
    for out in engine.run_until_done():
        if out.request_id == request_id:
            text = out.outputs[0].text
            print(text[shown:], end="", flush=True)
            shown = len(text)
            if out.finished and out.outputs[0].error:
                print(f"\nerror: {out.outputs[0].error}", file=sys.stderr)
    print()


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    from .server import options
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", default=None,
                   help="the model name clients see and send (default: the checkpoint's base name)")
    g.add_argument("--api-key", default=options.api_key_from_env(),
                   help=f"require 'Authorization: Bearer KEY' on /v1/* and /generate (default: ${options.API_KEY_ENV})")
    g.add_argument("--max-request-bytes", type=options.parse_size, default=options.DEFAULT_MAX_REQUEST_BYTES,
                   metavar="SIZE", help="largest request body, e.g. 16MiB; larger ones get 413 (default: 2MiB)")
    g.add_argument("--graceful-timeout", type=float, default=options.DEFAULT_GRACEFUL_TIMEOUT_S, metavar="SECONDS",
                   help="on SIGINT/SIGTERM, how long open requests may finish before they are cut (default: 10)")


def cmd_serve(args) -> int:
    from .server.options import ServerOptions
    options = ServerOptions(served_model_name=args.served_model_name, api_key=args.api_key,
                            max_request_bytes=args.max_request_bytes, graceful_timeout_s=args.graceful_timeout)
    config = config_from_args(args)
    role = _worker_role(config)
    if role is not None:
        return role
    from .server.app import run_server
    run_server(config, args.host, args.port, options, log_level=args.log_level.lower())
    return 0


def cmd_bench(args) -> int:
    import random
    from .llm import LLM
    from .request import SamplingParams
    _exit_on_sigterm()
    config = config_from_args(args)
    with LLM(**dataclasses.asdict(config)) as llm:
        vocab = llm.engine.tok.vocab_size
        rng = random.Random(0)
        ids = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
        params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate(prompt_token_ids=ids, sampling_params=params, use_tqdm=False)
        dt = time.perf_counter() - t0
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        print(f"{args.num_requests} requests, {n_out} output tokens in {dt:.2f} s: {n_out / dt:.1f} tok/s")
    return 0


def cmd_plan(args) -> int:
    from .runtime.plan_report import plan_report
    print(plan_report(config_from_args(args)))
    return 0


COMMANDS = {"generate": cmd_generate, "serve": cmd_serve, "bench": cmd_bench, "plan": cmd_plan,
            "demo-model": cmd_demo_model}

if __name__ == "__main__":
    sys.exit(main())
