"""`paxengine` console script: serve | generate | bench serve | bench throughput."""

from __future__ import annotations

import argparse
import sys

USAGE = """usage: paxengine <command> [args]

commands:
  serve [--config configs/X.yaml] [flags]   OpenAI-compatible server (default: embedded SmolLM2)
  generate --prompt TEXT [flags]            generate offline and print the text
  bench serve [args]                        serving benchmark against any OpenAI endpoint
  bench throughput [args]                   offline engine throughput
"""


def _generate(argv: list[str]) -> int:
    from paxengine import LLM, SamplingParams
    from paxengine.config import EngineConfig, load_yaml

    ap = argparse.ArgumentParser(prog="paxengine generate")
    ap.add_argument("--prompt", action="append", required=True)
    ap.add_argument("--config")
    ap.add_argument("--model")
    ap.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int)
    ap.add_argument(
        "--speculative-config",
        metavar="JSON",
        help='e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'',
    )
    a = ap.parse_args(argv)
    raw = load_yaml(a.config) if a.config else {}
    cfg = EngineConfig.from_dict({k: v for k, v in raw.items() if k in EngineConfig.fields()})
    if a.model:
        cfg = cfg.replace(model=a.model)
    if a.speculative_config:
        cfg = cfg.replace(speculative_config=a.speculative_config)
    llm = LLM(cfg)
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, seed=a.seed)
    if a.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in a.prompt], params)
    else:
        outs = llm.generate(a.prompt, params)
    for p, o in zip(a.prompt, outs):
        print(f"### {p}\n{o.outputs[0].text}\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "serve":
        from serving.cli import main as serve_main

        return serve_main(rest)
    if cmd == "generate":
        return _generate(rest)
    if cmd == "bench" and rest and rest[0] == "serve":
        from benchmarks.bench.serve import main as bench_serve

        return bench_serve(rest[1:])
    if cmd == "bench" and rest and rest[0] == "throughput":
        from benchmarks.bench.throughput import main as bench_throughput

        return bench_throughput(rest[1:])
    print(USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
