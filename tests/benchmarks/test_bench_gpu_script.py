"""The GPU run's pieces that need no GPU: roofline arithmetic, the dummy model dir, the report,
the shell scripts, the HF stage on CPU, the engines' settings (their defaults), and the stages
themselves at CPU size."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from benchmarks.gpu import hf, offline, report, roofline, serving
from benchmarks.gpu.dummy_model import write_dummy_model_dir, write_model_dir
from benchmarks.gpu.workloads import FULL, QUICK, engine_args, vocab_size
from paxengine.config import EngineConfig
from paxengine.models.config import PRESETS, from_hf_config

ROOT = Path(__file__).resolve().parents[2]


def test_roofline_arithmetic_llama8b():
    c = roofline.model_costs(PRESETS["llama-3.1-8b"], 2)
    assert c["weight_bytes_per_step"] == pytest.approx(
        15.0e9, rel=0.01
    )  # 7.5 B params read per step
    assert c["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 2
    bw, rate = 4.0e12, 7.0e14
    one = roofline.decode_step_floor(c, 1, 1024, bw, rate)
    assert one == pytest.approx(c["weight_bytes_per_step"] / bw, rel=0.02)  # batch 1: weight-bound
    assert roofline.decode_step_floor(c, 64, 1024, bw, rate) > one
    # prefill of 1024 tokens is compute-bound: ~2 * 7 GFLOP per token
    assert roofline.prefill_floor(c, 1, 1024, bw, rate) == pytest.approx(
        2 * 1024 * 6.98e9 / rate, rel=0.05
    )
    t = roofline.workload_floor(c, 300, 1000, 1000, 256, bw, rate)
    assert 5_000 < 300 * 1000 / t < 20_000


def test_dummy_model_dir(tmp_path):
    d = write_dummy_model_dir("tiny", tmp_path / "m")
    cfg = from_hf_config(json.loads((d / "config.json").read_text()))
    tiny = PRESETS["tiny"]
    for k in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
    ):
        assert getattr(cfg, k) == getattr(tiny, k), k
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    assert tok.get_vocab_size() == tiny.vocab_size
    ids = [5, 17, 511, 0]
    text = tok.decode(ids)
    assert text == "t5 t17 t511 t0" and tok.encode(text).ids == ids
    llama = from_hf_config(
        json.loads(
            write_dummy_model_dir("llama-3.1-8b", tmp_path / "l")
            .joinpath("config.json")
            .read_text()
        )
    )
    assert llama.rope_scaling == PRESETS["llama-3.1-8b"].rope_scaling


def test_model_dir_of_another_architecture(tmp_path):
    """A stage's "models" entry (Qwen3.5-9B's multimodal config): its config as is, and a word
    tokenizer of its text model's vocabulary (248,320), which the served stages' random prompts
    and both servers need."""
    from tokenizers import Tokenizer

    config = FULL["models"]["qwen35"]["config"]
    d = write_model_dir(str(ROOT / config), tmp_path / "q")
    assert json.loads((d / "config.json").read_text()) == json.loads((ROOT / config).read_text())
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    assert tok.get_vocab_size() == vocab_size({"config": str(ROOT / config)}) == 248_320
    ids = [248_319, 7, 0]
    assert tok.encode(tok.decode(ids)).ids == ids


def test_report_table():
    merged = {
        "spec": FULL,
        "date": "d",
        "environment": {
            "device": "NVIDIA H200",
            "jax_version": "0.11.2",
            "commit": "abcdef1234567",
        },
        "stages": {
            "roofline": {
                "ok": True,
                "copy_bandwidth_Bps": 4.2e12,
                "matmul_flops_per_s": 7.5e14,
                "dtype": "bfloat16",
                "device": "H200",
                "floors": {"itl_batch1_ms": 3.8, "serve_c1_output_tok_s": 250.0},
            },
            "pax-offline": {
                "ok": True,
                "itl_batch1_ms": 5.0,
                "itl_batch8_ms": 5.5,
                "startup_s": 40,
                "jax_compiles_during_timed_runs": 0,
                "offline": {"256x(1024,128)": {"output_tok_s": 3000.0}},
            },
            "pax-offline-fp8": {"ok": True, "itl_batch1_ms": 3.25},
            "pax-serve": {"ok": False, "error": "boom", "runs": {}},
            "vllm-offline": {"ok": True, "itl_batch1_ms": 4.74},
        },
    }
    md = report.markdown_table(merged)
    assert "| FP8 batch-1 ITL (ms) | 3.25 | - | 3.33 |" in md
    assert "| batch-1 ITL (ms) | 5.00 | 4.74 | 4.74 | 3.80 |" in md
    assert "| offline 256x(1024,128) output tok/s | 3,000 | - | 3,962 | - |" in md
    assert "JAX compiles during timed runs (must be 0) | 0 offline |" in md
    assert "Failed stages: pax-serve: boom" in md and "4.2 TB/s" in md


@pytest.mark.parametrize(
    "script",
    ["gpu_run.sh", "gpu_kernels.sh", "gpu_vllm_install.sh"],
)
def test_gpu_scripts_parse(script):
    subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu" / script)], check=True)


def test_vllm_install_without_parts_is_a_no_op(tmp_path):
    """No /tmp/vparts: the installer says nothing, changes nothing, and does not fail the caller."""
    if Path("/tmp/vparts").exists() or Path("/tmp/vsite").exists():
        pytest.skip("this machine has vLLM parts")
    r = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu" / "gpu_vllm_install.sh")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0 and r.stdout == "" and not Path("/tmp/vsite").exists()


def test_hf_stage_runs_on_cpu_and_reports(tmp_path):
    """The HF baseline stage (tiny model, eager only) measures ITL and batched generate; the
    report prints its line."""
    res = hf.stage_hf(QUICK, tmp_path / "stage_hf.json")
    assert res["device"] == "cpu" and res["itl_batch1_eager_ms"] == res["itl_batch1_eager_ms"]
    w = QUICK["hf"]["batched"]
    b = res["batched"]
    assert b["output_tok_s"] == pytest.approx(w["num_prompts"] * w["output_len"] / b["elapsed_s"])
    merged = {"spec": QUICK, "environment": {}, "stages": {"hf": {"ok": True, **res}}}
    assert f"batched generate {w['name']}" in report.markdown_table(merged)


def test_fp8_and_two_device_stages_run_and_report(tmp_path):
    """The stages the next GPU leases run (FP8 weights + KV offline and served; the model over
    two devices), at CPU size with two simulated devices, paxengine at its defaults: all finish,
    and the report has their rows."""
    env = dict(os.environ, PAXENGINE_CACHE=str(tmp_path / "cache"))
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.gpu.main",
            "--quick",
            "--stages",
            "pax-offline-fp8,pax-offline-tp2,pax-serve-fp8",
            "--out",
            str(tmp_path / "out"),
            "--work",
            str(tmp_path / "work"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    merged = json.loads((tmp_path / "out" / "gpu_bench.json").read_text())
    for stage in ("pax-offline-fp8", "pax-offline-tp2"):
        assert merged["stages"][stage]["ok"], merged["stages"][stage]
        assert merged["stages"][stage]["jax_compiles_during_timed_runs"] == 0
    serve = merged["stages"]["pax-serve-fp8"]
    assert serve["ok"], serve
    # the server builds its rarer buckets in the background; the timed runs wait for them
    assert serve["all_built_s"] >= serve["startup_s"] > 0
    c = QUICK["serve"]["concurrency"][0]
    assert serve["runs"][f"c{c}"]["completed"] > 0
    table = report.markdown_table(merged)
    assert "| FP8 batch-1 ITL (ms) |" in table and "| TP=2 offline 8x(32,8) output tok/s |" in table
    assert merged["stages"]["pax-offline-fp8"]["kv_block_size"] == 64  # fp8 caches' default
    assert merged["stages"]["pax-offline-fp8"]["engine_args"] == engine_args(QUICK, "fp8")
    # what XLA assigned the largest of each kind of step as temporaries (the activation
    # reserve's measure)
    temp = merged["stages"]["pax-offline-fp8"]["step_temp"]
    assert temp["forward"][0] > 0 and temp["sampler"][0] > 0, temp
    assert f"| FP8 serve c={c} output tok/s |" in table


# What a stage may give an engine besides the model and its dtype: the context, and what the
# variants are about (FP8 weights and KV, two GPUs). Everything else stays at each engine's
# default, as a user starts it; vLLM runs the same way.
ALLOWED = {"max_model_len", "quantization", "kv_cache_dtype", "tensor_parallel_size"}
# the CPU smoke run's engine size (QUICK only: two cores), never a GPU stage's
CPU_SIZE = {"max_num_seqs", "max_num_batched_tokens", "num_kv_blocks"}
# a server's own flags: the model's source and name, where it listens, what it logs
SERVER = {"--model", "--tokenizer", "--dtype", "--served-model-name", "--port", "--host"}


class Started(Exception):
    """Raised by a fake engine with what it was given."""


def _keys(o) -> set:
    if isinstance(o, dict):
        return set(o) | {k for v in o.values() for k in _keys(v)}
    return {k for v in o for k in _keys(v)} if isinstance(o, list) else set()


@pytest.mark.parametrize("spec", [FULL, QUICK], ids=["full", "quick"])
def test_stages_run_both_engines_at_their_defaults(spec, tmp_path, monkeypatch):
    """No tuning flags: every stage, offline or served, paxengine's or vLLM's, gives its engine
    the model, its dtype, max_model_len and its variant's settings, the same for both engines,
    and nothing else (the CPU smoke run adds its size); the spec names no other engine setting
    anywhere."""
    import paxengine

    cpu = spec.get("cpu_size", {})
    assert set(cpu) <= CPU_SIZE and (spec is QUICK or not cpu)
    knobs = EngineConfig.fields() - {"model", "dtype", "tokenizer", *ALLOWED}
    bad = _keys({k: v for k, v in spec.items() if k != "cpu_size"}) & knobs
    assert not bad, f"engine settings in the spec: {sorted(bad)}"
    defaults = EngineConfig()

    def fake_llm(*args, **kwargs):
        raise Started(args, kwargs)

    monkeypatch.setattr(paxengine, "LLM", fake_llm)
    fake_vllm = types.SimpleNamespace(LLM=fake_llm, SamplingParams=None, __version__="0")
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm)
    monkeypatch.setattr(offline, "stage_model_dir", lambda *a: tmp_path)
    monkeypatch.setattr(serving, "stage_model_dir", lambda *a: tmp_path)
    monkeypatch.setattr(serving, "serve_stage", lambda spec, out, cmd, *a: cmd)
    out = tmp_path / "stage.json"
    for variant in (None, *spec["variants"]):
        args = engine_args(spec, variant)
        assert set(args) <= ALLOWED | set(cpu) and args["max_model_len"] == spec["max_model_len"]
        with pytest.raises(Started) as pax:
            offline.stage_pax_offline(spec, out, variant)
        cfg = pax.value.args[1]["config"]
        given = {
            f.name
            for f in dataclasses.fields(cfg)
            if getattr(cfg, f.name) != getattr(defaults, f.name)
        }
        assert given <= {"model", "dtype", *args}, given
        assert {k: getattr(cfg, k) for k in args} == args
        with pytest.raises(Started) as vl:
            offline.stage_vllm_offline(spec, out, variant)
        assert vl.value.args[1] == dict(
            model=str(tmp_path),
            load_format="dummy",
            skip_tokenizer_init=True,
            dtype=spec["dtype"],
            seed=0,
            **args,
        )
        for model, m in spec["models"].items():  # other architectures: the same, on their config
            with pytest.raises(Started) as pax:
                offline.stage_pax_offline(spec, out, variant, model=model)
            cfg = pax.value.args[1]["config"]
            assert cfg.model == f"dummy:{m['config']}"
            assert {k: getattr(cfg, k) for k in args} == args
            with pytest.raises(Started) as vl:
                offline.stage_vllm_offline(spec, out, variant, model=model)
            assert vl.value.args[1] == dict(
                model=str(tmp_path),
                load_format="dummy",
                skip_tokenizer_init=True,
                dtype=spec["dtype"],
                seed=0,
                **args,
                **m["vllm_required"],  # what it needs to run the model at all, no tuning
            )
        flags = {"--" + k.replace("_", "-") for k in args}
        for stage, own in (
            (serving.stage_pax_serve, SERVER | {"--log-level"}),
            (serving.stage_vllm_serve, SERVER - {"--model", "--tokenizer"} | {"--load-format"}),
        ):
            cmd = stage(spec, out, "serve", variant)
            assert {x for x in cmd if x.startswith("--")} == own | flags, cmd
            for k, v in args.items():
                assert cmd[cmd.index("--" + k.replace("_", "-")) + 1] == str(v)
        for model, m in spec["models"].items():  # served: the same, and vLLM what it needs
            pax_cmd = serving.stage_pax_serve(spec, out, "serve", variant, model)
            assert {x for x in pax_cmd if x.startswith("--")} == SERVER | {"--log-level"} | flags
            assert pax_cmd[pax_cmd.index("--model") + 1] == f"dummy:{m['config']}"
            vl_cmd = serving.stage_vllm_serve(spec, out, "serve", variant, model)
            required = {"--" + k.replace("_", "-"): v for k, v in m["vllm_required"].items()}
            own = SERVER - {"--model", "--tokenizer"} | {"--load-format"}
            assert {x for x in vl_cmd if x.startswith("--")} == own | flags | set(required)
            for flag, v in required.items():  # a boolean bare, a dict as JSON
                if v is not True:
                    assert json.loads(vl_cmd[vl_cmd.index(flag) + 1]) == v


def test_moe_probe_runs_its_variants_on_cpu(tmp_path, monkeypatch):
    """The grouped-GEMM probe the next lease runs first for the MoE (#55), at tiny shapes with
    the Pallas kernel interpreted: every row timed, the kernel's products the same as XLA's."""
    from benchmarks.gpu import moe_probe

    monkeypatch.setenv("PAXENGINE_KERNEL_MOE", "xla")  # the probe sets it per variant
    out = tmp_path / "moe.json"
    assert moe_probe.main(["--tiny", "--variants", "xla", "pallas", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["T"], r["variant"]) for r in rows] == [(8, "xla"), (8, "pallas")]
    for r in rows:
        assert "error" not in r and r["us"] > 0 and r["experts_hit"] >= 1, r
    assert all(r["max_abs_diff_vs_xla"] < 1e-5 for r in rows if r["variant"] == "pallas")


def test_moe_probe_sweeps_the_kernels_tunings_on_cpu(tmp_path):
    """--sweep at tiny shapes (interpreted): a timed row per projection and tuning of the grid,
    the fastest of each projection printed."""
    from benchmarks.gpu import moe_probe

    out = tmp_path / "sweep.json"
    assert moe_probe.main(["--tiny", "--sweep", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert {(r["proj"], r["block_n"]) for r in rows} == {
        (p, n) for p in ("gate_up", "down") for n in moe_probe.TINY_SWEEP["block_n"]
    }
    assert all("error" not in r and r["us"] > 0 for r in rows), rows
