"""The shipped `paxengine bench` commands: `serve` (online, any OpenAI-compatible server) and
`throughput` (offline engine throughput, optionally against HF transformers)."""
