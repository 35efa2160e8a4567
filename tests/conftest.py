"""Shared fixtures: the repository root on sys.path, the real SmolLM2 model, and its HF twin."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import pytest


@pytest.fixture(scope="session")
def smollm():
    """Our load of the embedded SmolLM2-135M-Instruct (float32)."""
    from paxengine.models.loader import load_model

    return load_model(None, "float32", progress=False)


@pytest.fixture(scope="session")
def hf_smollm():
    """transformers' load of the same GGUF file (dequantized, float32): the ground truth."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from paxengine.models.loader import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model.eval()
    return model, tok


@pytest.fixture(scope="session")
def two_device_cache(tmp_path_factory):
    """compilation_cache_dir (a JAX cache and an executable store) for the 2-device workers,
    data parallel and disaggregated prefill: both run the same engine configuration on device 0
    and on device 1, so the second of them loads those steps instead of compiling them again.
    Of the session's own: no other test's steps, nothing from an earlier run."""
    return str(tmp_path_factory.mktemp("two_devices") / "jax")
