"""The `splitserve` command."""

from __future__ import annotations

import argparse
import sys


def _generate(args: argparse.Namespace) -> int:
    from common.config import EngineConfig
    from common.engine.llm_engine import LLMEngine
    from common.sampling_params import SamplingParams

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
        )
        engine = LLMEngine.from_config(EngineConfig(model=args.model, dtype=args.dtype, device=args.device))
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    prompt = args.prompt
    if not args.raw:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    for text in engine.stream(prompt, params):
        print(text, end="", flush=True)
    print()
    return 0


def main(argv: list[str] | None = None) -> int:
    from common.runtime.allocator import tune

    try:
        tune()  # before any thread starts: see common/runtime/allocator.py
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog="splitserve", description="Disaggregated LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="answer one prompt with the local engine")
    g.add_argument("prompt")
    g.add_argument("--model", default=None, help="GGUF file or safetensors folder (default: SmolLM2-135M)")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.set_defaults(func=_generate)

    from bench.cli import add_bench_parser
    from splitserve.keys_cli import add_keys_parser
    from splitserve.launch import add_parsers

    add_bench_parser(sub)
    add_parsers(sub)
    add_keys_parser(sub)

    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
