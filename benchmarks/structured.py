"""Structured output's host costs on the embedded SmolLM2 (49,152 tokens): llguidance's tokenizer
build, each grammar's compile (fresh, then cached), the mask of 32 rows per step, and the compile
time of the sampler variants with and without the token mask.

    python -m benchmarks.structured --result-file benchmarks/results/structured_cpu.json
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from benchmarks.record import environment

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
# the serving benchmark's schema (benchmarks/results/structured_serve_cpu.json)
PEOPLE = {"type": "array", "minItems": 16, "items": PERSON}


def constraints():
    from paxengine.structured import StructuredOutputs
    from serving.tools import forced_constraint

    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                "required": ["city", "unit"],
            },
        },
    }
    return {
        "json_schema person": StructuredOutputs(json=PERSON),
        "json_schema people (serve bench)": StructuredOutputs(json=PEOPLE),
        "json_object": StructuredOutputs(json_object=True),
        "regex": StructuredOutputs(regex=r"[A-Z][a-z]{2,5}-[0-9]{3}"),
        "choice (3)": StructuredOutputs(choice=["sunny", "rainy", "snowy"]),
        "lark": StructuredOutputs(grammar='start: "(" item ("," item)* ")"\nitem: /[0-9]/'),
        "tool_choice required (1 tool)": forced_constraint([weather], "required", True),
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--result-file", default=None)
    p.add_argument("--rows", type=int, default=32)
    args = p.parse_args(argv)

    import jax

    from paxengine.models.loader import load_model
    from paxengine.sampling import ALL_FLAGS, abstract_sampling_tensors, sample
    from paxengine.structured import GrammarCompiler

    m = load_model(None, "float32", progress=False)
    V = m.config.vocab_size
    gc = GrammarCompiler(m.tokenizer, V, m.eos_token_ids)
    t = time.perf_counter()
    gc._tokenizer()
    res = {"tokenizer_build_s": time.perf_counter() - t, "vocab_size": V, "compile_ms": {}}
    for name, spec in constraints().items():
        t = time.perf_counter()
        gc.compile(spec)
        fresh = time.perf_counter() - t
        t = time.perf_counter()
        gc.new_state(spec)
        res["compile_ms"][name] = {
            "first": round(fresh * 1e3, 3),
            "cached_copy": round((time.perf_counter() - t) * 1e3, 3),
        }
    # a step's masks: `rows` sequences, each at its own point of the people schema (one token
    # further along than the last), and all in a string (most of the vocabulary allowed)
    res[f"mask_fill_{args.rows}_rows_ms"] = {}
    item = '{"name": "Alexander", "age": 31, "color": "red"}, '
    walk = m.tokenizer.encode("[" + item * 8, add_special_tokens=False)
    for where in ("each at its own position", "all in a string"):
        spec = constraints()["json_schema people (serve bench)"]
        states = [gc.new_state(spec) for _ in range(args.rows)]
        for i, s in enumerate(states):
            toks = walk[: i + 1] if where.startswith("each") else walk[:5]
            for tok in toks:
                assert s.accept(tok)
        mask = np.full((args.rows, -(-V // 32)), -1, np.int32)
        times = []
        for _ in range(20):
            t = time.perf_counter()
            gc.fill_masks([(s, i) for i, s in enumerate(states)], mask)
            times.append(time.perf_counter() - t)
        res[f"mask_fill_{args.rows}_rows_ms"][where] = round(1e3 * float(np.median(times)), 3)
    # start-up: sampler variants compiled per sequence bucket; and one call of each on the CPU
    S = args.rows
    logits = jax.ShapeDtypeStruct((S, V), jax.numpy.float32)
    comp, run = {}, {}
    rng = np.random.default_rng(0)
    x = jax.numpy.asarray(rng.normal(size=(S, V)).astype(np.float32))
    for flags in ALL_FLAGS:
        t = time.perf_counter()
        st = abstract_sampling_tensors(S, 2048, flags, V)
        exe = jax.jit(sample).lower(logits, st).compile()
        comp[str(flags)] = round(time.perf_counter() - t, 3)
        args_ = jax.tree.map(lambda a: jax.numpy.zeros(a.shape, a.dtype), st)
        args_ = args_.__class__(**{**args_.__dict__, "temperature": jax.numpy.ones(S)})
        if flags[3]:
            args_ = args_.__class__(**{**args_.__dict__, "mask": jax.numpy.asarray(mask)})
        times = []
        for _ in range(10):
            t = time.perf_counter()
            jax.block_until_ready(exe(x, args_))
            times.append(time.perf_counter() - t)
        run[str(flags)] = round(1e3 * float(np.median(times)), 3)
    res[f"sampler_compile_s_S{S}"] = comp
    res[f"sampler_call_ms_S{S}"] = run
    res["sampler_compile_s_total"] = {
        "plain (8 variants)": round(sum(v for k, v in comp.items() if k.endswith("False)")), 3),
        "grammar (3 variants)": round(sum(v for k, v in comp.items() if k.endswith("True)")), 3),
    }
    res["environment"] = environment()
    res["command"] = "python -m benchmarks.structured " + " ".join(argv or [])
    print(json.dumps(res, indent=1))
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
