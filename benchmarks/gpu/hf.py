"""The HF transformers stage: the device's torch on the same shapes (random init from the dummy
model directory's config): batch-1 ITL eager and with a static cache + torch.compile (the
gpt-fast recipe, as VLLM-PEER.md measured it), and batched `generate` on an offline workload."""

from __future__ import annotations

import time
from pathlib import Path

from benchmarks.gpu.dummy_model import write_dummy_model_dir
from benchmarks.gpu.stage import log, save_partial


def stage_hf(spec: dict, out: Path) -> dict:
    """HF transformers on the same dummy weights' shapes (random init on the device): batch-1
    ITL eager and compiled (static cache + torch.compile, reduce-overhead), batched generate."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    hs = spec["hf"]
    d = write_dummy_model_dir(spec["preset"], out.parent / "dummy_model")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if spec["dtype"] == "bfloat16" else torch.float32
    t = time.perf_counter()
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(d), torch_dtype=dtype)
    model.eval()
    res = {"load_s": time.perf_counter() - t, "torch_version": torch.__version__, "device": dev}
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)

    def generate(batch: int, in_len: int, n: int, **kw) -> float:
        ids = torch.randint(2, vocab, (batch, in_len), generator=gen).to(dev)
        sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
        sync()
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
                **kw,
            )
        sync()
        assert out.shape == (batch, in_len + n), out.shape
        return time.perf_counter() - t

    def itl(**kw) -> float:
        """Mean gap between consecutive decode tokens of one batch-1 generate, from a streamer
        stamping each token as generate hands it out (generate syncs on every step). One
        generate length only: a static cache is sized by it, and a second length would compile
        a second graph inside the timed run."""
        from transformers.generation.streamers import BaseStreamer

        class Stamps(BaseStreamer):
            def __init__(self):
                self.t: list[float] = []

            def put(self, value):  # first call: the prompt; then one per new token
                self.t.append(time.perf_counter())

            def end(self):
                pass

        generate(1, hs["input_len"], hs["n2"], **kw)  # warm-up (and compile)
        st = Stamps()
        generate(1, hs["input_len"], hs["n2"], streamer=st, **kw)
        # gaps after the first token (the prefill), the first n1 of them left out as warm-up
        gaps = [b - a for a, b in zip(st.t[1:], st.t[2:])][hs["n1"] :]
        assert len(gaps) >= 1, len(st.t)
        return 1e3 * sum(gaps) / len(gaps)

    res["itl_method"] = (
        "mean gap between consecutive streamed tokens of one generate of n2 "
        "tokens, the first n1 gaps left out"
    )
    res["itl_batch1_eager_ms"] = itl()
    # the earlier method, (generate n2 - generate n1) / (n2 - n1), as a cross-check (eager only:
    # with a static cache each length compiles its own graph)
    t1 = generate(1, hs["input_len"], hs["n1"])
    t2 = generate(1, hs["input_len"], hs["n2"])
    res["itl_batch1_eager_two_lengths_ms"] = 1e3 * (t2 - t1) / (hs["n2"] - hs["n1"])
    log(
        f"HF batch-1 ITL eager {res['itl_batch1_eager_ms']:.2f} ms "
        f"(two lengths: {res['itl_batch1_eager_two_lengths_ms']:.2f} ms)"
    )
    save_partial(**res)
    w = hs["batched"]
    el = generate(w["num_prompts"], w["input_len"], w["output_len"])
    res["batched"] = {
        "name": w["name"],
        "elapsed_s": el,
        "output_tok_s": w["num_prompts"] * w["output_len"] / el,
    }
    log(f"HF batched generate {w['name']}: {res['batched']['output_tok_s']:,.0f} output tok/s")
    save_partial(**res)
    if hs.get("compile"):
        # transformers compiles the forward itself when generate runs on a static cache on CUDA
        # (CompileConfig: inductor, reduce-overhead = CUDA graphs). Wrapping model.forward in our
        # own torch.compile as well made two graph trees fight over the cache: on the H200 one
        # run died with "output of CUDAGraphs overwritten", one with a segfault.
        from transformers import CompileConfig

        cc = CompileConfig(fullgraph=True, mode="reduce-overhead")
        if dev != "cuda":
            cc._compile_all_devices = True  # CPU smoke runs take the same path
        res["itl_batch1_compiled_ms"] = itl(cache_implementation="static", compile_config=cc)
        res["compiled_with"] = (
            "generate(cache_implementation='static', compile_config="
            "CompileConfig(fullgraph=True, mode='reduce-overhead'))"
        )
        log(f"HF batch-1 ITL static cache + torch.compile {res['itl_batch1_compiled_ms']:.2f} ms")
    return res
