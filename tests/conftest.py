"""Shared fixtures: the repository root on sys.path, the real SmolLM2 model, and its HF twin."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Under pytest-xdist the workers share the machine's cores. torch (the HF ground truth) starts
# one OpenMP thread per core in each worker, and those threads spin-wait against the other
# worker's: HF's greedy generate of SmolLM2 ran ~5x slower with 2 threads than with 1 while the
# other worker was busy (the 48-token parity test: 274 s under `-n 2`, ~60 s with this). Each
# worker gets its share of the cores instead; set before any test module imports torch. The
# thread count changes no result the tests compare (HF's tokens and logits are the same).
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _workers)))

import pytest

# Seconds a test file took under `-n 2 --dist loadfile` (its tests' setup + call, from
# `--durations`, 2-core machine, 2026-12-07), the heaviest ones: an ordering hint, nothing more.
# xdist's loadfile hands the files out in order, each to the first worker with room, and by
# default orders them by their number of tests, so the files with few but slow tests (servers,
# multi-device workers) went out last and the run's end waited on one of them while the other
# worker idled. Heaviest first (longest-processing-time first), the many small files fill in at
# the end: the two workers finish together. A file not listed goes after these, by its count of
# tests as before; a stale figure only costs balance, never a test.
FILE_SECONDS = {
    "benchmarks/test_bench_gpu_script.py": 160,
    "serving/test_serve_matrix.py": 158,
    "test_disagg.py": 138,
    "test_qwen3_5_spec.py": 128,
    "test_spec_decode.py": 121,
    "test_engine.py": 117,
    "test_qwen3_moe.py": 109,
    "test_tensor_parallel.py": 104,
    "test_qwen3_5_tp.py": 96,
    "test_model_parity.py": 94,
    "serving/test_server_reasoning_tools.py": 75,
    "test_qwen3_5.py": 66,
    "benchmarks/test_bench_throughput.py": 64,
    "test_compile_cache.py": 60,
    "test_engine_process.py": 59,
    "kernels/test_attention.py": 55,
    "benchmarks/test_bench_real_server.py": 47,
    "test_kv_layout.py": 46,
    "test_multi_host.py": 41,
    "test_qwen3_5_moe.py": 39,
    "serving/test_server_fp8.py": 31,
    "test_kv_scales.py": 30,
    "test_fp8_weights.py": 29,
    "test_kv_fp8.py": 28,
    "test_qwen3_moe_fp8_checkpoint.py": 24,
    "serving/test_server_thinking_model.py": 23,
    "test_background_compile.py": 21,
}
TESTS = os.path.dirname(os.path.abspath(__file__))


def pytest_configure(config):
    """The controller keeps the workers' order of files (pytest_collection_modifyitems's)."""
    if getattr(config.option, "dist", "no") == "loadfile":
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items):
    """Under `--dist loadfile`: the heaviest files first (FILE_SECONDS), then the rest by their
    number of tests (xdist's own order); each file's tests in their order."""
    if getattr(config.option, "dist", "no") != "loadfile" and not os.environ.get(
        "PYTEST_XDIST_WORKER"
    ):
        return
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(str(item.path), []).append(item)

    def key(path):
        rel = os.path.relpath(path, TESTS).replace(os.sep, "/")
        return (-FILE_SECONDS.get(rel, 0), -len(files[path]))

    items[:] = [it for path in sorted(files, key=key) for it in files[path]]


@pytest.fixture(scope="module", autouse=True)
def _release_memory_between_modules():
    """After each test module: its engines collected, JAX's compiled-function caches dropped and
    the freed heap handed back to the system. CI's machine has 24 GiB for two xdist workers and
    their subprocesses (multi-device workers, servers); the workers' resident memory only grew,
    to 9.2 + 7.0 GB beside two 4-5 GB device workers (20 of 24 GiB in use), and the CI run of
    a4a9687 lost a worker ("node down: Not properly terminated") and never finished. With this,
    a module ends at ~2.2-2.9 GB where it ended at 3.2-6.7 GB (six heavy modules in one process:
    9.0 min against 8.5, with other work on the machine both times)."""
    yield
    import ctypes
    import gc

    gc.collect()
    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()
        gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: the memory stays with the process, as before


@pytest.fixture(scope="session")
def smollm():
    """Our load of the embedded SmolLM2-135M-Instruct (float32)."""
    from paxengine.models.loader import load_model

    return load_model(None, "float32", progress=False)


@pytest.fixture(scope="session")
def short_smollm():
    """Four of SmolLM2's layers (devices.truncated_smollm2: an HF directory of their real weights
    and the tokenizer; its path is `.source`), for tests of what every layer does alike: an
    engine against its oracle, one path against another. The 30 layers cost the compiles, the
    oracle's forwards and the Pallas kernels' interpret mode ~7x what these do."""
    from devices import truncated_smollm2

    from paxengine.models.loader import load_model

    return load_model(truncated_smollm2(), "float32", progress=False)


@pytest.fixture(scope="module")
def fp8_params(smollm):
    """The embedded SmolLM2's projections quantized to FP8 (per output channel)."""
    from paxengine.models.quant import quantize_params

    return quantize_params(dict(smollm.params, layers=dict(smollm.params["layers"])))


@pytest.fixture(scope="session")
def hf_tokenizer():
    """transformers' tokenizer of the embedded GGUF file: the tokenizer tests need only this, not
    the dequantized model (~25 s to load on 2 busy cores)."""
    from transformers import AutoTokenizer

    from paxengine.models.loader import default_model_path

    path = default_model_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="session")
def hf_smollm(hf_tokenizer):
    """transformers' load of the same GGUF file (dequantized, float32): the ground truth."""
    import torch
    from transformers import AutoModelForCausalLM

    from paxengine.models.loader import default_model_path

    path = default_model_path()
    saved = _hf_twin_dir(path)
    if (saved / "model.safetensors").exists():
        model = _load_hf_twin(saved)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
        _save_hf_twin(model, saved)
    model.eval()
    return model, hf_tokenizer


def _hf_twin_dir(gguf):
    """Where transformers' own dequantized load of `gguf` is kept as float32 safetensors: its
    GGUF dequantization takes ~25 s on 2 busy cores, its safetensors load ~1 s; the values are
    those of transformers' load (safetensors round-trips float32 exactly). Keyed by the file
    (name, size, mtime) and the transformers and torch versions that dequantized it."""
    import torch
    import transformers

    from paxengine.models.weights_cache import cache_root

    st = gguf.stat()
    key = f"{gguf.stem}-{st.st_size}-{st.st_mtime_ns}-tf{transformers.__version__}-pt{torch.__version__}"
    return cache_root(None) / "hf_twin" / key


def _save_hf_twin(model, saved):
    """The weights (safetensors.torch.save_model: the tied embedding once) and the config, less
    its GGUF quantization entry (transformers refuses to save_pretrained a GGUF-loaded model)."""
    import json
    import shutil
    import tempfile

    from safetensors.torch import save_model

    saved.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=saved.parent)
    os.chmod(tmp, 0o755)
    try:
        cfg = model.config.to_dict()
        cfg.pop("quantization_config", None)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(cfg, f)
        save_model(model, os.path.join(tmp, "model.safetensors"))
        os.rename(tmp, saved)  # atomic: the other xdist worker may write the same twin
    except OSError:
        pass  # the other worker's twin is there already (or the cache is read-only)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _load_hf_twin(saved):
    """The saved twin: the same architecture from its config, every weight loaded (strict)."""
    import json

    import torch
    from safetensors.torch import load_model
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = json.loads((saved / "config.json").read_text())
    config = AutoConfig.for_model(**cfg)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    load_model(model, saved / "model.safetensors", strict=True)
    return model


@pytest.fixture(scope="session")
def two_device_cache(tmp_path_factory):
    """compilation_cache_dir (a JAX cache and an executable store) for the 2-device workers,
    data parallel and disaggregated prefill: both run the same engine configuration on device 0
    and on device 1, so the second of them loads those steps instead of compiling them again.
    Of the session's own: no other test's steps, nothing from an earlier run."""
    return str(tmp_path_factory.mktemp("two_devices") / "jax")
