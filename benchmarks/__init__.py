"""paxengine benchmarks: `paxengine bench serve` (online, any OpenAI-compatible server) and
`paxengine bench throughput` (offline engine throughput, optionally against HF transformers)."""
