"""The GPU run: paxengine (and optionally vLLM and HF transformers) on Llama-3.1-8B shapes in one
device call, with the roofline floors measured on the same card (`gpu_run.sh`)."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]  # stages and servers run from here
