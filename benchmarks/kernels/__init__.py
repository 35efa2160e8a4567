"""Micro-benchmarks of the attention kernels (kernels_pallas) on Llama-3.1-8B attention shapes,
and against vLLM's FlashAttention-3."""
