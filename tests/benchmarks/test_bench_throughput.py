"""`paxengine bench throughput` on CPU: SmolLM2 (embedded GGUF) against HF transformers, small."""

from __future__ import annotations

import json

from benchmarks.bench import throughput

SMALL = ["--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--max-model-len", "128"]


def test_bench_throughput_with_hf_baseline(tmp_path, capsys, monkeypatch, hf_smollm):
    """The HF side loads the same float32 GGUF model as the session's `hf_smollm` (~12 s on 2
    cores): it gets that one instead, once the benchmark has asked for exactly it."""
    import torch
    from transformers import AutoModelForCausalLM

    from paxengine.models.loader import default_model_path

    gguf, loads = default_model_path(), []

    def from_pretrained(path, dtype=None, **kw):
        assert (str(path), kw, dtype) == (str(gguf.parent), {"gguf_file": gguf.name}, torch.float32)
        loads.append(path)
        return hf_smollm[0]

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", from_pretrained)
    out = tmp_path / "tp.json"
    rc = throughput.main(
        [
            "--num-prompts",
            "8",
            "--input-len",
            "16",
            "--output-len",
            "8",
            "--baseline",
            "hf",
            "--disable-tqdm",
            "--result-file",
            str(out),
            "--plot",
            str(tmp_path / "tp.png"),
            *SMALL,
        ]
    )
    assert rc == 0
    res = json.loads(out.read_text())
    assert set(res["systems"]) == {"paxengine", "hf_transformers"}
    for name, s in res["systems"].items():
        assert s["num_requests"] == 8 and s["prompt_tokens"] == 128 and s["output_tokens"] == 64, (
            name
        )
        assert s["output_tokens_per_s"] == s["output_tokens"] / s["elapsed_s"]
        assert s["total_tokens_per_s"] == (s["prompt_tokens"] + s["output_tokens"]) / s["elapsed_s"]
        assert s["requests_per_s"] == 8 / s["elapsed_s"]
    pax, hf = res["systems"]["paxengine"], res["systems"]["hf_transformers"]
    assert (
        res["ratio_output_tokens_per_s"] == pax["output_tokens_per_s"] / hf["output_tokens_per_s"]
    )
    assert pax["compiles_during_timed_runs"] == 0
    assert pax["engine_config"]["max_num_seqs"] == 8
    # same model on both sides: greedy outputs agree at least on the first token of most prompts
    assert res["greedy_agreement"]["first_token_match"] >= 0.5
    assert res["workload"] == {
        "num_prompts": 8,
        "input_len": 16,
        "output_len": 8,
        "range_ratio": 0.0,
        "num_iters": 1,
        "seed": 0,
        "vocab_size": 32000,
        "ignore_eos": True,
        "temperature": 0.0,
    }
    assert res["environment"]["jax_version"]
    assert len(loads) == 1
    assert (tmp_path / "tp.png").read_bytes()[:4] == b"\x89PNG"
    text = capsys.readouterr().out
    assert "paxengine / HF output tok/s" in text


def test_bench_throughput_rejects_bad_input(capsys):
    assert throughput.main(["--baseline", "hf", "--range-ratio", "0.5"]) == 2
    assert throughput.main(["--config", "/nonexistent.yaml"]) == 2
