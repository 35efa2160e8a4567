"""The attention kernels' benchmark (kernels_pallas) on Llama-3.1-8B attention shapes: against
the oracle, upstream Pallas and XLA."""
