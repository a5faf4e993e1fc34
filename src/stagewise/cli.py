"""`stagewise serve | generate | bench | plan | demo-model`.

Flags are generated from dataclasses (cli_flags.py): engine flags from EngineConfig (every
command that builds an engine accepts all of them), sampling flags from SamplingParams, server
flags from ServerOptions; each field carries its help text and default.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from .cli_flags import HelpFormatter, add_dataclass_args, values_of
from .config import CONCERNS, EngineConfig
from .errors import EngineDeadError

# NOTE: SamplingParams' defaults are the API's (OpenAI's temperature 1, max_tokens 16), which the
# server keeps; a terminal user trying a model wants a reproducible answer of some length.
GENERATE_DEFAULTS = {"temperature": 0.0, "max_tokens": 64}
# NOTE: a compile (10-50 s on 2 cores, background or not) saves a few ms per token; below this many
# new tokens in all, `generate` with --prefill-graph auto never wins it back, so it does not compile.
GENERATE_COMPILE_MIN_TOKENS = 4096
SAMPLING_NOTE = ("`generate` is greedy by default (temperature 0, up to 64 tokens); the server follows the OpenAI "
                 "defaults (temperature 1; max_tokens 16 for completions) unless a request says otherwise.")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag group per concern of EngineConfig (model and load, KV cache, scheduler, ...)."""
    for _, cls, title in CONCERNS:
        add_dataclass_args(parser.add_argument_group(title), cls)


def engine_config_of(args: argparse.Namespace) -> EngineConfig:
    """The engine config the flags of `add_engine_args` parsed, as given."""
    return EngineConfig.from_kwargs(**{k: v for _, cls, _ in CONCERNS for k, v in values_of(cls, args).items()})


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The engine config of a command, with `--model` resolved to a local path (default model if absent)."""
    from .model.source import resolve_models
    config = resolve_models(engine_config_of(args))
    check_before_loading(config)
    return config


def check_before_loading(config: EngineConfig) -> None:
    """Refuse, in one sentence, what the model's config alone shows cannot run, before anything loads."""
    from .checkpoint.facts import read_facts
    facts = read_facts(str(config.load.model))
    layers = facts.num_layers
    if config.parallel.pp_size > layers:
        raise ValueError(f"--pp-size {config.parallel.pp_size} asks for more stages than the model's {layers} layers; "
                         f"use --pp-size {layers} or fewer.")
    if config.parallel.tp_size > 1:
        _check_tp_size(facts, config.parallel.tp_size)


def _check_tp_size(facts, size: int) -> None:
    """The ranks must split the model's heads, vocabulary and MLP: name the sizes that do."""
    from .model.loader import _architecture
    from .model.registry import get_model_class
    from .parallel import tp
    hf = facts.hf
    model_cls = get_model_class(_architecture(hf, facts.path))
    try:
        tp.check_model(hf, model_cls, size)
    except ValueError as exc:
        fits = [n for n in range(1, facts.heads + 1) if _tp_fits(hf, model_cls, n)]
        if fits == [1]:
            raise
        raise ValueError(f"--tp-size {size} cannot split this model ({facts.heads} attention heads, {facts.kv_heads} "
                         f"KV heads, {facts.vocab} vocabulary entries); use --tp-size "
                         f"{', '.join(map(str, fits[:-1]))} or {fits[-1]}.") from exc


def _tp_fits(hf, model_cls, size: int) -> bool:
    from .parallel import tp
    try:
        tp.check_model(hf, model_cls, size)
    except ValueError:
        return False
    return True


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    from .request import SamplingParams
    add_dataclass_args(parser.add_argument_group("sampling", SAMPLING_NOTE), SamplingParams, GENERATE_DEFAULTS)


def sampling_from_args(args):
    from .request import SamplingParams
    return SamplingParams(**values_of(SamplingParams, args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stagewise", description="Pipeline-parallel LLM inference with captured "
                                     "prefill graphs.", formatter_class=HelpFormatter)
    _add_log_level(parser, "INFO")
    parser.add_argument("--version", action="version", version=f"stagewise {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
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
    p = sub.add_parser("plan", help="print the layer partition, each stage's layers, weight bytes and KV capacity; "
                       "launches nothing")
    p.add_argument("--measure-rate", action="store_true",
                   help="also time this machine's decode-shaped matmuls with one stage's threads (GMAC/s): run it "
                        "on every node and pass the numbers as --pp-node-rates")
    p.add_argument("--cluster", metavar="MEM:SPEED,...",
                   help="plan over a described cluster instead of this machine: each node's available memory and "
                        "relative speed, node 0 (the driver's) first, e.g. 16GiB:1.0,8GiB:0.6,4GiB:0.3; prints which "
                        "node runs each stage and the nodes left out (with --pp-size: that many stages)")
    add_engine_args(p)
    p = sub.add_parser("demo-model", help="write the built-in demo checkpoint (tiny Llama + tokenizer)")
    p.add_argument("--out", default=None, help="output directory (default: the demo cache directory)")
    return parser


class _Parser(argparse.ArgumentParser):
    """Every command's parser shows defaults in --help and takes --log-level after the command too."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        # SUPPRESS: unless given here, the value before the command (or its default) stays
        _add_log_level(self, argparse.SUPPRESS)


def _add_log_level(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--log-level", default=default, type=str.upper, choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                        metavar="LEVEL", help="DEBUG | INFO | WARNING | ERROR (default: INFO); before or after the "
                        "command")


def _version() -> str:
    from importlib import metadata
    try:
        return metadata.version("stagewise")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def _process_age_s() -> float:
    """Seconds since this process started (/proc/self/stat's start time), so a printed total
    includes the interpreter's start and imports; 0.0 where /proc cannot tell."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return 0.0


# the command's start on time.perf_counter()'s clock (main() may run long after the process started)
_STARTED = time.perf_counter() - _process_age_s()


def main(argv: list[str] | None = None) -> int:
    global _STARTED
    if argv is not None:          # called in-process (tests, embedding): this call is the command
        _STARTED = time.perf_counter()
    args = build_parser().parse_args(argv)
    from .runtime import allocator
    if argv is None:              # the command line's own process: tcmalloc where the machine has it
        try:
            allocator.reexec()
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    _start_process()
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if argv is None and args.command in ("generate", "serve", "bench"):
        logging.getLogger("stagewise.cli").info(allocator.describe())
    code = _run(args)
    if argv is None and "torch" in sys.modules:
        # the command line's process: skip torch's second of teardown, so the printed total is its wall time
        from .executor.hygiene import exit_now
        exit_now(code)
    return code


def _run(args: argparse.Namespace) -> int:
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


def _start_process() -> None:
    """This process runs the engine: OpenMP's wait default and Inductor's cache directory go into
    its environment before torch loads (OpenMP reads them once), for it and the processes it starts.
    Importing stagewise alone does neither."""
    from .graph import compile_cache
    from .runtime import threads
    threads.set_wait_default(openmp_started="torch" in sys.modules)
    compile_cache.claim()


def cmd_demo_model(args) -> int:
    from .model.demo import build_demo_model, ensure_demo_model
    out = build_demo_model(args.out) if args.out else ensure_demo_model()
    print(out)
    return 0


def _worker_role(config: EngineConfig) -> int | None:
    """Run as a stage (torchrun rank > 0 or a non-driver node) and return its exit code; None = driver.
    Every pipeline node first picks the network interface it talks on (errors here are the user's to fix)."""
    from .cluster.netif import use_interface
    from .cluster.rendezvous import torchrun_env
    from .executor.watchdog import install as install_stop_watchdog
    install_stop_watchdog()
    env = torchrun_env()
    if config.parallel.pp_size > 1 or env:
        use_interface(env["addr"] if env else config.cluster.master_addr, config.cluster.dist_ifname)
    if not (env and env["rank"] > 0) and config.cluster.node_rank == 0:
        return None
    # below: a stage or headless node only (these import torch; `serve`'s HTTP front process never does)
    from .checkpoint.facts import read_facts
    from .executor.generations import run_headless
    from .executor.hygiene import exit_now
    model_dir = str(config.load.model)        # resolved by config_from_args
    eos_ids = read_facts(model_dir).eos_token_ids
    if env and env["rank"] > 0:
        from .cluster.auth import cluster_token, warn_if_open
        from .cluster.netif import master_ip
        from .executor.stage_proc import stage_main
        warn_if_open(cluster_token(config.cluster.cluster_token), master_ip(env["addr"]), True)
        stage_main(config, model_dir, env["rank"] - 1, env["addr"], env["port"], eos_ids, spawned=False)
        return 0
    exit_now(run_headless(config, model_dir, eos_ids))    # a headless node has nothing to tear down


def _exit_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so `finally` blocks stop every stage process; a process stuck in
    C code is stopped by a watchdog instead."""
    from .executor.watchdog import install as install_stop_watchdog
    install_stop_watchdog()


def cmd_generate(args) -> int:
    from .llm import LLM
    _exit_on_sigterm()
    params = sampling_from_args(args)          # a bad sampling flag fails before the model loads
    config = config_from_args(args)
    role = _worker_role(config)
    if role is not None:
        return role
    config = _small_jobs_skip_compiling(config, len(args.prompt or [None]) * params.max_tokens)
    build_kernels(config)
    logging.getLogger("stagewise").info("loading %s (checkpoint, tokenizer, weights) ...", config.load.model)
    num_tokens, generate_s = 0, 0.0
    with LLM(**config.options()) as llm:
        engine, t_ready = llm.engine, time.perf_counter()
        chat = args.chat if args.chat is not None else bool(getattr(engine.tok.tokenizer, "chat_template", None))
        prompts = args.prompt or ["What is the capital of France?" if chat else "The capital of France is"]
        failed = 0
        for prompt in prompts:
            text = engine.tok.chat_prompt([{"role": "user", "content": prompt}]) if chat else prompt
            # NOTE: queued before anything is printed, so a refused prompt is only its error
            req = engine.add_request(text, params)
            # with the template, show the question, not the template around it
            print(prompt, end="\n" if chat else "", flush=True)
            shown, ok = _stream(engine, req.request_id)
            num_tokens, failed = num_tokens + shown, failed + (not ok)
        generate_s = time.perf_counter() - t_ready
        kernels = llm.stats().get("kernels") or []
    total_s = time.perf_counter() - _STARTED
    from .kernels.report import summary
    print(summary(kernels), file=sys.stderr)      # which kernels ran: ours (and their ISA) or PyTorch's
    print(f"{num_tokens} tokens in {generate_s:.2f} s ({num_tokens / max(generate_s, 1e-9):.1f} tok/s); "
          f"{total_s:.1f} s in all since the command started ({total_s - generate_s:.1f} s of it start-up)",
          file=sys.stderr)
    if failed:
        print(f"error: {failed} of {len(prompts)} prompt(s) failed (the error follows each one's text)",
              file=sys.stderr)
    return 1 if failed else 0


def build_kernels(config: EngineConfig) -> None:
    """Build (or load from the cache) the CPU kernels the model will run before any prompt is shown:
    a first run's builds are then reported as such, not counted in tokens/s. Stage processes find
    the built libraries in the shared cache."""
    if config.load.resolved_device != "cpu":
        return
    from .checkpoint.files import gguf_file_of
    from .kernels import attention, build, gemm, quant_kernels
    before = len(build.built_seconds)
    gemm.available()
    attention.available()
    if config.load.quantization or gguf_file_of(str(config.load.model)) is not None:
        quant_kernels.available()
    built = build.built_seconds[before:]
    if built:
        print(f"built the CPU kernels in {sum(built):.1f} s (once per machine; cached in {build.cache_dir()})",
              file=sys.stderr, flush=True)


def _small_jobs_skip_compiling(config: EngineConfig, max_new_tokens: int) -> EngineConfig:
    if config.graphs.prefill_graph != "auto" or max_new_tokens >= GENERATE_COMPILE_MIN_TOKENS:
        return config
    logging.getLogger("stagewise").info(
        "at most %d new tokens: too few to win back compiling the graphs, so this run is eager "
        "(--prefill-graph compiled compiles anyway)", max_new_tokens)
    return config.replace(prefill_graph="off")


def _stream(engine, request_id: str) -> tuple[int, bool]:
    """Print the request's text as it grows; returns its number of output tokens and whether it
    ended without an error."""
    shown, num_tokens, ok = 0, 0, True
    for out in engine.run_until_done():
        if out.request_id == request_id:
            text, num_tokens = out.outputs[0].text, len(out.outputs[0].token_ids)
            print(text[shown:], end="", flush=True)
            shown = len(text)
            if out.finished and out.outputs[0].error:
                ok = False
                print(f"\nerror: {out.outputs[0].error}", file=sys.stderr)
    print(flush=True)
    return num_tokens, ok


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    from .server.options import ServerOptions, api_key_from_env
    add_dataclass_args(p.add_argument_group("server"), ServerOptions, {"api_key": api_key_from_env()})
    p.epilog = SAMPLING_NOTE


def cmd_serve(args) -> int:
    from .server.options import ServerOptions
    options = ServerOptions(**values_of(ServerOptions, args))
    if args.node_rank == 0 and int(os.environ.get("RANK", "0")) == 0:    # only the driver listens (torchrun: rank 0)
        check_port_free(options.host, options.port)
    config = config_from_args(args)
    ray_nodes = None
    if options.distributed_executor_backend == "ray":
        from .cluster.ray_nodes import start_ray_nodes
        config, ray_nodes = start_ray_nodes(config, options.ray_address, args.log_level)
    try:
        role = _worker_role(config)
        if role is not None:
            return role
        from .server.app import run_server
        run_server(config, options, log_level=args.log_level.lower())
        return 0
    finally:
        if ray_nodes is not None:
            ray_nodes.close()            # after the driver ended: its nodes are leaving already


def check_port_free(host: str, port: int) -> None:
    """Refuse a port something already listens on before the model loads (seconds to minutes),
    not after, as the server's own bind would."""
    import socket
    if port == 0:                     # the system picks a free one
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ValueError(f"--host {host} is not an address this machine can listen on ({exc.strerror}); "
                         f"pass an address such as 127.0.0.1 or 0.0.0.0.") from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)     # as the server binds: TIME_WAIT is free
        try:
            sock.bind(address)
        except OSError as exc:
            raise ValueError(f"Port {port} on {host} is not free ({exc.strerror}); stop what listens there or "
                             f"pass --port with another port.") from None


def cmd_bench(args) -> int:
    import random

    from .llm import LLM
    from .request import SamplingParams
    _exit_on_sigterm()
    config = config_from_args(args)
    role = _worker_role(config)          # a worker node runs its stages; node 0 measures
    if role is not None:
        return role
    build_kernels(config)
    with LLM(**config.options()) as llm:
        waited_s = _wait_for_compiled_graphs(llm)
        vocab = llm.engine.tok.vocab_size
        rng = random.Random(0)
        ids = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
        params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        stats = llm.stats()
        before, steps = _graph_steps(stats), stats["num_steps"]
        logging.getLogger("stagewise.cli").info("bench: timing %d requests", args.num_requests)
        t0 = time.perf_counter()
        outs = llm.generate(prompt_token_ids=ids, sampling_params=params, use_tqdm=False)
        dt = time.perf_counter() - t0
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        stats = llm.stats()
        replayed, eager = (after - was for after, was in zip(_graph_steps(stats), before))
        print(f"{args.num_requests} requests, {n_out} output tokens in {dt:.2f} s: {n_out / dt:.1f} tok/s "
              f"({_steps_text(replayed, eager, waited_s, config.graphs.prefill_graph)}); {_ttft_text(outs)}; "
              f"{stats['num_steps'] - steps} engine steps")
    return _failures(outs)


def _ttft_text(outs) -> str:
    """Time to first token (from each request's arrival: all arrive at once), mean and max."""
    ttft = [o.metrics["first_token_time"] - o.metrics["arrival_time"] for o in outs if "first_token_time" in o.metrics]
    if not ttft:
        return "no first token"
    return f"time to first token {sum(ttft) / len(ttft):.2f} s mean, {max(ttft):.2f} s max"


def _failures(outs) -> int:
    """1 (and one sentence) when requests failed: a benchmark of failed requests measured nothing."""
    failed = [o.outputs[0] for o in outs if o.outputs[0].finish_reason == "error"]
    if not failed:
        return 0
    print(f"error: {len(failed)} of {len(outs)} requests failed, so the figure above measures nothing; the "
          f"first: {failed[0].error}", file=sys.stderr)
    return 1


def _wait_for_compiled_graphs(llm) -> float | None:
    """Seconds waited for a one-stage engine's background compile before timing (a throughput figure
    is the compiled engine's, not a mix); None for a pipeline, whose stages compile in their own
    processes."""
    worker = getattr(llm.engine.executor, "worker", None)
    if worker is None:
        return None
    t0 = time.perf_counter()
    worker.runner.wait_compiled()
    return time.perf_counter() - t0


def _graph_steps(stats: dict) -> tuple[int, int]:
    """(steps planned to replay a graph, steps planned eager), prefill and decode together."""
    kinds = [stats.get(k) or {} for k in ("prefill_graph", "decode_graph")]
    return (sum(sum(k.get("replays", {}).values()) for k in kinds),
            sum(sum(k.get("eager", {}).values()) for k in kinds))


def _steps_text(replayed: int, eager: int, waited_s: float | None, prefill_graph: str) -> str:
    """How the timed steps ran: a number measured while graphs compiled is not the compiled speed."""
    if not replayed:
        return f"eager: every step, --prefill-graph {prefill_graph}"
    if waited_s is None:
        return ("graphs: the stages compile in the background, and a step before its stage's compile ended ran "
                "eager; --prefill-graph compiled compiles before the first step")
    ran = "compiled graphs" if not eager else f"compiled graphs, {eager} of {eager + replayed} steps eager"
    return f"{ran}; waited {waited_s:.1f} s for the background compile first" if waited_s >= 0.1 else ran


def cmd_plan(args) -> int:
    from .planning.report import plan_report
    config = config_from_args(args)
    if args.cluster:
        from .checkpoint.facts import read_facts
        from .planning.cluster import cluster_report, parse_cluster
        assert config.load.model is not None, "resolved by config_from_args"
        print(cluster_report(config, read_facts(config.load.model), parse_cluster(args.cluster)))
        return 0
    print(plan_report(config))
    if args.measure_rate:
        import torch

        from .planning.stage_cost import measure_node_rate
        from .runtime.threads import thread_choice
        threads, _ = thread_choice(config)
        torch.set_num_threads(threads)
        print(f"node rate: {measure_node_rate():.1f} GMAC/s with {threads} thread(s) per stage "
              "(pass each node's number, in node order, as --pp-node-rates)")
    return 0


COMMANDS = {"generate": cmd_generate, "serve": cmd_serve, "bench": cmd_bench, "plan": cmd_plan,
            "demo-model": cmd_demo_model}

if __name__ == "__main__":
    sys.exit(main())
