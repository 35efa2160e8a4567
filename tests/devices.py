"""What the multi-device tests share: a small engine, and a worker script run in a subprocess
with N simulated CPU devices (XLA_FLAGS must be set before jax starts, so not in this process)."""

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
SMALL = dict(
    max_model_len=128,
    max_num_seqs=4,
    max_num_batched_tokens=32,
    token_buckets=[16, 32],
    seq_buckets=[4],
    num_kv_blocks=64,
    attention_backend="xla",
)


def run_worker(script: str, args: list[str], devices: int):
    """Runs tests/<script> with `devices` CPU devices; returns the JSON of its last "RESULT "
    line. The callers give every engine a compilation_cache_dir of the test's own (a JAX cache
    and an executable store; the DP and disagg tests share one, conftest.two_device_cache:
    their engines are the same). The converted weights come from this process's
    weights cache (PAXENGINE_CACHE or ~/.cache/paxengine, as every other test's engines): their
    conversion is tested in test_model_parity, not paid again by each multi-device test."""
    env = dict(os.environ)
    flags = f"--xla_force_host_platform_device_count={devices}"
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flags}"
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


# Four of SmolLM2's 30 layers, for tests of what every layer does alike (weights and KV split
# over devices, pages moved between engines, one mesh over processes, an engine against its
# oracle): each of the 30 costs compile and step time in every engine they build. The first two
# and the last two: the first four alone greedily repeat ", and, and" whatever the prompt (19
# distinct top tokens over test_fp8_weights.TEXT's 173 positions, to the whole model's 88), a
# path that breaks attention could still give their tokens; these give 98 distinct ones, and
# their top-1/top-2 logit gaps are the whole model's (median 0.87 nats, 1.09; 0.6% below 0.01).
SMOLLM2_LAYERS = (0, 1, 28, 29)


def truncated_smollm2(layers: tuple[int, ...] = SMOLLM2_LAYERS) -> str:
    """An HF directory of the embedded SmolLM2-135M-Instruct with only `layers` (in order): its
    real weights (as this package loads them), tokenizer, chat template and EOS; written once
    under the paxengine cache (keyed by the GGUF file), so the converted-weights cache keeps one
    entry of it across runs."""
    import numpy as np
    from safetensors.numpy import save_file

    from paxengine.models.loader import default_model_path, load_model
    from paxengine.models.weights import HF_LAYER_NAMES
    from paxengine.models.weights_cache import cache_root

    gguf = default_model_path()
    st = gguf.stat()
    tag = ".".join(map(str, layers))
    d = cache_root(None) / "test_models" / f"{gguf.stem}-{st.st_size}-{st.st_mtime_ns}-L{tag}"
    if (d / "model.safetensors").is_file():
        return str(d)
    m = load_model(None, "float32", progress=False)
    c = m.config
    assert c.arch == "llama" and c.tie_word_embeddings and max(layers) < c.num_layers
    p = {k: np.asarray(v) for k, v in m.params["layers"].items()}
    sd = {
        "model.embed_tokens.weight": np.asarray(m.params["embed"]),
        "model.norm.weight": np.asarray(m.params["final_norm"]),
    }
    for j, i in enumerate(layers):
        for theirs, ours in HF_LAYER_NAMES.items():  # the loader's map, read backwards
            if ours in p:  # projections: ours [in, out], HF's [out, in]
                w = p[ours][i]
                sd[f"model.layers.{j}.{theirs}"] = np.ascontiguousarray(w.T) if w.ndim == 2 else w
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": len(layers),
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "rope_theta": c.rope_theta,
        "rms_norm_eps": c.rms_norm_eps,
        "tie_word_embeddings": True,
        "max_position_embeddings": c.max_position_embeddings,
        "eos_token_id": m.eos_token_ids,
        "_name_or_path": f"{c.name} (layers {tag})",
    }
    tok = m.tokenizer
    tok_cfg = {
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "chat_template": tok.chat_template,
        "add_bos_token": tok.add_bos_token,
    }
    import shutil
    import tempfile

    d.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=d.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(cfg))
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
        tok.tok.save(str(tmp / "tokenizer.json"))
        save_file(sd, str(tmp / "model.safetensors"))
        os.chmod(tmp, 0o755)
        os.rename(tmp, d)  # atomic: the other xdist worker may write the same directory
    except OSError:
        if not (d / "model.safetensors").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(d)
