"""The `splitserve` command."""

from __future__ import annotations

import argparse
import sys


def _generate(args: argparse.Namespace) -> int:
    import jinja2
    from pydantic import ValidationError

    from common.config import EngineConfig
    from common.engine.llm_engine import LLMEngine
    from common.runtime.logs import configure_logging
    from common.sampling_params import SamplingParams
    from common.text.model_info import read_chat_template
    from splitserve.flags import config_errors
    from splitserve.launch import ENGINE_FLAGS, ConfigError, check_model

    configure_logging(args.log_level, args.log_format, process="generate")
    given = {
        k: v
        for k, v in (
            ("model", args.model),
            ("dtype", args.dtype),
            ("device", args.device),
            ("kv_cache_dtype", args.kv_cache_dtype),
            ("kv_exact_prefill", args.kv_exact_prefill),
            ("max_model_len", args.max_model_len),
        )
        if v is not None
    }
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
        )
        config = EngineConfig(**given)
        check_model(config.model)
        template = read_chat_template(args.chat_template) if args.chat_template else None
        engine = LLMEngine.from_config(config)
    except ValidationError as e:
        print(config_errors(e, {v: k for k, v in ENGINE_FLAGS.items()}, "SPLITSERVE_"), file=sys.stderr)
        return 2
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError, NotImplementedError) as e:  # the model cannot be served
        print(f"error: {e}", file=sys.stderr)
        return 2
    if template is not None:
        engine.tokenizer.chat_template = template
    prompt: str | list[int] = args.prompt
    if not args.raw:
        try:
            text = engine.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
        except (ValueError, jinja2.TemplateError) as e:  # a base model without a chat template, a bad one
            print(f"error: {e} (or pass --raw)", file=sys.stderr)
            return 2
        # the template places the special tokens (a BOS of its own included), as the router sends it
        prompt = engine.tokenizer.encode(text, add_special_tokens=False)
    for text in engine.stream(prompt, params):
        print(text, end="", flush=True)
    print()
    return 0


def _config(args: argparse.Namespace) -> int:
    """`splitserve config --markdown`: every serving flag, its variable and default, as a table."""
    print(markdown_table(build_parser()), end="")
    return 0


def _version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("splitserve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    from bench.cli import add_bench_parser
    from common.config import EngineConfig
    from splitserve.flags import Parser, add_log_flags, flag
    from splitserve.keys_cli import add_keys_parser
    from splitserve.launch import add_config_flag, add_parsers

    parser = Parser(prog="splitserve", description="Disaggregated LLM serving.")
    parser.add_argument("--version", action="version", version=f"splitserve {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    g = sub.add_parser("generate", help="answer one prompt with the local engine")
    g.add_argument("prompt", help="the question (the model's chat template wraps it unless --raw)")
    flag(g, "--model", env="SPLITSERVE_MODEL", help="GGUF file or safetensors folder (default: SmolLM2-135M)")
    flag(g, "--max-tokens", type=int, default=128, help="tokens to generate at most")
    flag(g, "--temperature", type=float, default=0.0, help="0: greedy")
    flag(
        g, "--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set of tokens this likely"
    )
    flag(g, "--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: all)")
    flag(g, "--seed", type=int, help="a seed makes sampling repeatable")
    flag(g, "--dtype", env="SPLITSERVE_DTYPE", choices=["auto", "float32", "bfloat16"], shown_default="auto",
         help="weights and activations (auto: bfloat16 on a GPU, float32 on the CPU)")  # fmt: skip
    flag(g, "--device", env="SPLITSERVE_DEVICE", choices=["auto", "cpu", "cuda"], shown_default="auto",
         help="auto: cuda when a GPU is visible")  # fmt: skip
    flag(g, "--kv-cache-dtype", env="SPLITSERVE_KV_CACHE_DTYPE", shown_default="auto",
         choices=["auto", "float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2"],
         help="what the KV cache stores")  # fmt: skip
    add_config_flag(
        g, "--kv-exact-prefill", EngineConfig, "kv_exact_prefill", "SPLITSERVE_", dest="kv_exact_prefill"
    )
    flag(
        g,
        "--max-model-len",
        type=int,
        env="SPLITSERVE_MAX_MODEL_LEN",
        help="context length (default: the model's)",
    )
    flag(g, "--chat-template", help="a Jinja chat template, or the path of a file holding one")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    add_log_flags(g)
    g.set_defaults(func=_generate)

    c = sub.add_parser("config", help="print every serving flag with its environment variable and default")
    c.add_argument("--markdown", action="store_true", required=True, help="as a Markdown table")
    c.set_defaults(func=_config)

    add_bench_parser(sub)
    add_parsers(sub)
    _add_planner_parser(sub)
    add_keys_parser(sub)
    return parser


def _add_planner_parser(sub: argparse._SubParsersAction) -> None:
    from splitserve.flags import add_law_flags, add_log_flags, env_or, flag, parse_bool

    p = sub.add_parser(
        "planner",
        help="decide how many prefill and decode workers to run, and set them (Kubernetes) or log them",
        description="Reads the worker registry (Redis) and the router's TTFT/TPOT histograms, decides the "
        "prefill and decode worker counts (planner/policy.py has the rules), hands them to the actuator "
        "(dry run, or the Kubernetes Deployments' replicas) and prints each decision with its inputs as "
        "one JSON line.",
    )
    flag(p, "--actuator", env="SPLITSERVE_PLANNER_ACTUATOR", choices=["dry-run", "kubernetes"],
         default=env_or("SPLITSERVE_PLANNER_ACTUATOR") or "dry-run", shown_default="dry-run",
         help="dry-run: log what it would do; kubernetes: set the Deployments' replicas")  # fmt: skip
    for name, what in [
        ("namespace", "kubernetes: the Deployments' namespace (default: the pod's own)"),
        ("prefill-deployment", "kubernetes: the prefill Deployment's name"),
        ("decode-deployment", "kubernetes: the decode Deployment's name"),
        ("kube-api", "kubernetes: the API server's URL (default: in the pod, KUBERNETES_SERVICE_HOST/PORT)"),
        ("kube-token-file", "kubernetes: a bearer token file, read on every call (default: the pod's)"),
        ("kube-ca-file", "kubernetes: the API server's CA (default: the pod's; with --kube-api: system CAs)"),
    ]:
        env = "SPLITSERVE_PLANNER_" + name.upper().replace("-", "_")
        flag(p, f"--{name}", env=env, default=env_or(env), shown_default=None, help=what)
    flag(p, "--redis-url", env="SPLITSERVE_REDIS_URL", default=env_or("SPLITSERVE_REDIS_URL"),
         shown_default=None, help="the worker registry (required)")  # fmt: skip
    flag(p, "--router-url", help="the router whose /metrics gives TTFT and TPOT (none: load signals only)")
    flag(p, "--discover-routers", action="store_true", env="SPLITSERVE_PLANNER_DISCOVER_ROUTERS",
         default=bool(env_or("SPLITSERVE_PLANNER_DISCOVER_ROUTERS", parse_bool)), shown_default=False,
         help="read every live router the Redis registry lists (each registers its URL), their figures "
         "summed; instead of --router-url")  # fmt: skip
    check = env_or("SPLITSERVE_PLANNER_ROUTER_TLS_CHECK_HOSTNAME", parse_bool)
    flag(p, "--router-tls-check-hostname", action=argparse.BooleanOptionalAction,
         env="SPLITSERVE_PLANNER_ROUTER_TLS_CHECK_HOSTNAME", default=True if check is None else check,
         shown_default=True, help="match the routers' HTTPS certificates to their URLs' hosts; off: the "
         "chain to SSL_CERT_FILE's CA alone (routers registered at pod IPs)")  # fmt: skip
    flag(p, "--api-key", env="SPLITSERVE_PLANNER_API_KEY", default=env_or("SPLITSERVE_PLANNER_API_KEY"),
         shown_default=None, help="a key with the metrics scope, when the router requires keys")  # fmt: skip
    flag(p, "--interval-s", type=float, default=10.0, help="seconds between decisions")
    flag(p, "--rounds", type=int, help="stop after this many decisions (default: run until stopped)")
    flag(p, "--ttft-target-s", type=float, default=1.0, help="p90 time to first token to keep under")
    flag(p, "--tpot-target-s", type=float, default=0.05, help="p90 time per output token to keep under")
    for role in ("prefill", "decode"):
        flag(p, f"--min-{role}", type=int, default=1, help=f"{role} workers at least")
        flag(p, f"--max-{role}", type=int, default=8, help=f"{role} workers at most")
    flag(p, "--budget", type=int, default=16, help="prefill + decode workers at most")
    add_law_flags(p)
    add_log_flags(p)

    def run(args: argparse.Namespace) -> int:
        from planner.main import main

        return main(args)

    p.set_defaults(func=run)


def markdown_table(parser: argparse.ArgumentParser) -> str:
    from splitserve.flags import markdown_table as table

    return table(parser)


def main(argv: list[str] | None = None) -> int:
    from common.runtime.allocator import tune

    try:
        tune()  # before any thread starts: see common/runtime/allocator.py
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
