"""The GPU run: paxengine (and optionally vLLM and HF transformers) on Llama-3.1-8B shapes in one
device call, with the roofline floors measured on the same card (`gpu_run.sh`)."""
