"""Pre-quantized FP8 checkpoints (issue #17): reading safetensors with float8 tensors, the
`quantization_config` of config.json, and each checkpoint weight's scales as an `Fp8Weight`.

Two families ship FP8 Llama checkpoints:
- compressed-tensors (`quant_method: "compressed-tensors"`, `format: "float-quantized"`), as
  RedHatAI's `*-FP8-dynamic` (per-channel `weight_scale` [out, 1], activations quantized per
  token at run time) and `*-FP8` (per-tensor `weight_scale`, static `input_scale`, often
  `kv_cache_scheme` with per-layer `k_scale` / `v_scale`) models;
- `quant_method: "fp8"` (transformers' FP8 / DeepSeek): per-tensor `weight_scale`, or 128 x 128
  block scales `weight_scale_inv` [ceil(out/128), ceil(in/128)].

Qwen ships its FP8 checkpoints (Qwen3.5-27B-FP8) in the second form, 128 x 128 blocks, leaving
small modules (the Gated DeltaNet's per-head in_proj_a / in_proj_b, norms, lm_head, the vision
tower) dense. `CheckpointReader` reads either form for every family's loader (the Llama layout
in loader.py, Qwen3.5's in qwen3_5.py): by each tensor's own dtype, so whatever a config's
ignore list says, an FP8 projection loads as an `Fp8Weight` and an FP8 tensor of a module the
engine keeps dense is dequantized.

A weight's value is `values * scale` in every scheme. Per-tensor and per-channel scales are an
`Fp8Weight` exactly (a per-tensor scale is every channel's); block scales are not, so those
weights are dequantized and quantized again per output channel (logged, and a small error
against quantizing the dense weight online). Static activation scales are not used: the engine
quantizes activations per token at run time, which is at least as accurate.

safetensors' own numpy path has no float8 dtypes, so `SafetensorsFile` reads the format itself
(8 bytes of little-endian header length, a JSON header of dtype / shape / data_offsets, the
data) into memory-mapped numpy arrays with ml_dtypes' float8 and bfloat16.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from paxengine.models.quant import Fp8Weight

log = logging.getLogger("paxengine")

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)

# -- safetensors --------------------------------------------------------------------------------
SAFETENSORS_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": E4M3,
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),  # UE8M0 block scales (power-of-two)
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64),
    "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_MAX_HEADER = 100 << 20


class SafetensorsFile:
    """One .safetensors file: `keys()`, `dtype(key)` (the format's name, e.g. "F8_E4M3") and
    `get(key)`, a read-only numpy array over the memory-mapped file (nothing is read until it is
    used). The constructor raises ValueError for a file whose header is not valid; `get` raises
    for a tensor whose entry does not fit the file."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise ValueError("shorter than the 8-byte header length")
                n = int.from_bytes(head, "little")
                if n > min(size - 8, _MAX_HEADER):
                    raise ValueError(f"header length {n} does not fit a {size}-byte file")
                header = json.loads(f.read(n))
            if not isinstance(header, dict):
                raise ValueError("the header is not a JSON object")
        except (OSError, ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{self.path}: corrupt or unreadable safetensors file ({e})") from e
        header.pop("__metadata__", None)
        self.header = header
        self.data_start = 8 + n
        self.data_size = size - self.data_start
        self._map = None

    def keys(self) -> list[str]:
        return list(self.header)

    def dtype(self, key: str) -> str:
        return str(self.header[key].get("dtype"))

    def get(self, key: str) -> np.ndarray:
        entry = self.header[key]
        dtype = SAFETENSORS_DTYPES.get(entry.get("dtype"))
        if dtype is None:
            raise ValueError(f"unknown dtype {entry.get('dtype')!r}")
        shape = tuple(int(d) for d in entry["shape"])
        begin, end = (int(o) for o in entry["data_offsets"])
        nbytes = math.prod(shape) * dtype.itemsize
        if not 0 <= begin <= end <= self.data_size or end - begin != nbytes:
            raise ValueError(
                f"data_offsets [{begin}, {end}] do not hold {shape} {entry['dtype']} in "
                f"{self.data_size} bytes of data"
            )
        if nbytes == 0:
            return np.zeros(shape, dtype)
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        start = self.data_start + begin
        return self._map[start : start + nbytes].view(dtype).reshape(shape)


# -- quantization_config -------------------------------------------------------------------------
SUPPORTED = (
    "quant_method 'compressed-tensors' (format float-quantized: 8-bit float weights, per-tensor, "
    "per-channel, group or block scales) or 'fp8' (per-tensor or block scales)"
)
_CT_FORMATS = (None, "float-quantized", "naive-quantized")


@dataclass(frozen=True)
class Fp8Scheme:
    """What a pre-quantized checkpoint's config.json says about its weights."""

    method: str  # "compressed-tensors" | "fp8"
    strategies: tuple[str, ...]  # weight scale strategies: tensor, channel, group, block
    block: tuple[int, int] | None  # [out, in] block of a 2-D scale (group: (1, group_size))
    static_inputs: bool  # static activation scales (`input_scale` tensors), not used
    kv_cache: bool  # a kv_cache_scheme: per-layer k / v scales
    ignore: tuple[str, ...]  # modules the checkpoint keeps dense

    def describe(self) -> str:
        return f"{self.method}, {'/'.join(self.strategies)} weight scales"

    def ignored(self, module: str) -> bool:
        """Whether the checkpoint says it keeps this module (e.g. "model.layers.0.mlp.up_proj")
        dense: compressed-tensors matches names exactly or "re:" patterns with re.match;
        transformers' modules_to_not_convert by substring."""
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.match(entry[3:], module):
                    return True
            elif entry == module or (self.method == "fp8" and entry in module):
                return True
        return False


def parse_quantization_config(qc: dict | None) -> Fp8Scheme | None:
    """config.json's `quantization_config` -> Fp8Scheme (None when there is none); a method or
    scheme paxengine cannot load is a ValueError naming it."""
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _parse_compressed_tensors(qc)
    if method == "fp8":
        return _parse_fp8(qc)
    raise ValueError(
        f"quantization_config: quant_method {method!r} is not supported: paxengine loads FP8 "
        f"checkpoints, {SUPPORTED}"
    )


def _parse_compressed_tensors(qc: dict) -> Fp8Scheme:
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ValueError("quantization_config: compressed-tensors without config_groups")
    strategies: list[str] = []
    block = None
    static_inputs = False
    for gname, group in groups.items():
        fmt = group.get("format") or qc.get("format")
        if fmt not in _CT_FORMATS:
            raise ValueError(
                f"quantization_config: compressed-tensors format {fmt!r} (config_groups.{gname}) "
                f"is not supported: paxengine loads {SUPPORTED}"
            )
        w = group.get("weights")
        if not w:
            raise ValueError(
                f"quantization_config: compressed-tensors config_groups.{gname} quantizes no "
                f"weights (only activations): not supported; paxengine loads {SUPPORTED}"
            )
        bits, kind, strategy = w.get("num_bits"), w.get("type"), w.get("strategy")
        if bits != 8 or kind != "float":
            raise ValueError(
                f"quantization_config: compressed-tensors scheme config_groups.{gname} with "
                f"weights num_bits={bits} type={kind!r} strategy={strategy!r} is not "
                f"supported: paxengine loads {SUPPORTED}"
            )
        if strategy == "block":
            bs = w.get("block_structure") or [128, 128]
            if isinstance(bs, str):  # older releases: "128x128"
                bs = [int(x) for x in bs.lower().split("x")]
            block = (int(bs[0]), int(bs[1]))
        elif strategy == "group":
            block = (1, int(w["group_size"]))
        elif strategy not in ("tensor", "channel"):
            raise ValueError(
                f"quantization_config: compressed-tensors weight strategy {strategy!r} "
                f"(config_groups.{gname}) is not supported: paxengine loads {SUPPORTED}"
            )
        if strategy not in strategies:
            strategies.append(strategy)
        acts = group.get("input_activations") or {}
        static_inputs |= bool(acts) and not acts.get("dynamic", False)
    kv = qc.get("kv_cache_scheme")
    if kv:
        bits, kind, strategy = kv.get("num_bits"), kv.get("type"), kv.get("strategy", "tensor")
        if bits != 8 or kind != "float" or strategy != "tensor":
            raise ValueError(
                f"quantization_config: compressed-tensors kv_cache_scheme num_bits={bits} "
                f"type={kind!r} strategy={strategy!r} is not supported: paxengine reads 8-bit "
                f"float per-tensor KV scales"
            )
    return Fp8Scheme(
        "compressed-tensors",
        tuple(strategies),
        block,
        static_inputs,
        bool(kv),
        tuple(qc.get("ignore") or ()),
    )


def _parse_fp8(qc: dict) -> Fp8Scheme:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(
            f"quantization_config: quant_method 'fp8' with fmt {fmt!r} is not supported: "
            f"paxengine loads e4m3 weights"
        )
    bs = qc.get("weight_block_size")
    block = (int(bs[0]), int(bs[1])) if bs else None
    return Fp8Scheme(
        "fp8",
        ("block",) if block else ("tensor",),
        block,
        qc.get("activation_scheme", "dynamic") == "static",
        False,
        tuple(qc.get("modules_to_not_convert") or ()),
    )


# -- weights ---------------------------------------------------------------------------------------
SCALE_NAMES = ("weight_scale", "weight_scale_inv")


def _expand_blocks(scale: np.ndarray, block: tuple[int, int], out: int, inp: int) -> np.ndarray:
    """A [ceil(out/b0), ceil(in/b1)] block scale -> one scale per element [out, in]."""
    return np.repeat(np.repeat(scale, block[0], axis=0)[:out], block[1], axis=1)[:, :inp]


def _scale_kind(scale: np.ndarray, out: int, inp: int, block) -> str:
    if scale.size == 1:
        return "tensor"
    if scale.shape in ((out,), (out, 1)):
        return "channel"
    if (
        block is not None
        and scale.ndim == 2
        and scale.shape == (-(-out // block[0]), -(-inp // block[1]))
    ):
        return "block"
    return "unknown"


def dequantize_np(values: np.ndarray, scale: np.ndarray, block, name: str) -> np.ndarray:
    """An [out, in] FP8 checkpoint weight and its scale -> the dense float32 weight."""
    out, inp = values.shape
    scale = np.asarray(scale, np.float32)
    kind = _scale_kind(scale, out, inp, block)
    v = values.astype(np.float32)
    if kind == "tensor":
        return v * scale.reshape(())
    if kind == "channel":
        return v * scale.reshape(out, 1)
    if kind == "block":
        return v * _expand_blocks(scale, block, out, inp)
    raise ValueError(_bad_scale(name, scale, values, block))


def _bad_scale(name: str, scale: np.ndarray, values: np.ndarray, block) -> str:
    return (
        f"{name}: scale shape {tuple(scale.shape)} fits neither a per-tensor scale, a "
        f"per-channel [out] / [out, 1] one nor a block one (block {block}) for an FP8 weight of "
        f"shape {tuple(values.shape)}"
    )


_requantize = None


def to_fp8_weight(
    values: np.ndarray, scale: np.ndarray, block, name: str
) -> tuple[Fp8Weight, bool]:
    """An [out, in] e4m3 checkpoint weight and its scale -> (Fp8Weight with numpy leaves,
    exact). Per-tensor and per-channel scales map exactly (values untouched); a block scale
    whose blocks along the input axis share one scale per row is per channel too; any other
    block scale is dequantized and quantized again per output channel (exact=False)."""
    global _requantize
    out, inp = values.shape
    scale = np.asarray(scale, np.float32)
    kind = _scale_kind(scale, out, inp, block)
    if kind == "tensor":
        return Fp8Weight(values, np.full((out,), scale.reshape(()), np.float32)), True
    if kind == "channel":
        return Fp8Weight(values, np.ascontiguousarray(scale.reshape(out))), True
    if kind != "block":
        raise ValueError(_bad_scale(name, scale, values, block))
    if np.all(scale == scale[:, :1]):
        return Fp8Weight(values, np.repeat(scale[:, 0], block[0])[:out].copy()), True
    if _requantize is None:
        import jax

        from paxengine.models.quant import quantize_fp8

        _requantize = jax.jit(quantize_fp8)
    dense = values.astype(np.float32) * _expand_blocks(scale, block, out, inp)  # [out, in]
    q = _requantize(dense.T)
    return Fp8Weight(np.asarray(q.values), np.asarray(q.scales)), False


def scale_key(module: str, keys) -> str | None:
    """The checkpoint name of an FP8 weight's scale tensor, if there is one."""
    return next((f"{module}.{s}" for s in SCALE_NAMES if f"{module}.{s}" in keys), None)


def np_dtype(dtype: str) -> np.dtype:
    """A model dtype's name ("bfloat16", "float16", "float32") as a numpy dtype."""
    if dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


class CheckpointReader:
    """A Hugging Face model directory's *.safetensors by tensor name, read the way every
    family's loader wants them: `weight(key, projection)` is a numpy array, or for an FP8
    tensor an `Fp8Weight` (projections) or its dequantized form (anything else: an FP8 lm_head,
    embedding or small gate). Matrices come in `dtype` (the model's: a bfloat16 checkpoint's
    tensors are then views of the mapped file, and a 30B model is not 120 GB of float32 on the
    host before it reaches the device), vectors (norms, biases, gates' constants) in float32.
    The quantization_config (or compression_config) is parsed here: a method or scheme
    paxengine cannot load is a ValueError naming it."""

    def __init__(self, path: Path, raw_cfg: dict, dtype: str = "float32"):
        self.path = Path(path)
        self.matrix_dtype = np_dtype(dtype)
        self.scheme = parse_quantization_config(
            raw_cfg.get("quantization_config") or raw_cfg.get("compression_config")
        )
        self.block = self.scheme.block if self.scheme is not None else None
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{self.path}: no *.safetensors weight files")
        self.where: dict[str, SafetensorsFile] = {}
        for f in files:
            st = SafetensorsFile(f)  # a ValueError "corrupt or unreadable" for a bad header
            self.where.update((k, st) for k in st.keys())
        self.requantized: list[str] = []  # block-scaled weights quantized again per channel
        self.fp8_projections = 0

    def keys(self) -> list[str]:
        return list(self.where)

    def tensor(self, key: str) -> np.ndarray:
        st = self.where[key]
        try:
            return st.get(key)
        except Exception as e:
            raise ValueError(f"{st.path}: corrupt tensor {key} ({e})") from e

    def weight(self, key: str, projection: bool):
        """numpy (a matrix in the model dtype, else float32), or an Fp8Weight ([out, in]
        values) for an FP8 projection."""
        w, kind = self.tensor(key), self.where[key].dtype(key)
        if not kind.startswith("F8_"):
            return np.asarray(w, dtype=self.matrix_dtype if w.ndim >= 2 else np.float32)
        if kind != "F8_E4M3":
            raise ValueError(
                f"{self.where[key].path}: tensor {key} is {kind}: paxengine loads FP8 weights "
                f"in e4m3 (F8_E4M3)"
            )
        module = key.removesuffix(".weight")
        skey = scale_key(module, self.where)
        if skey is None:
            raise ValueError(
                f"{self.path}: FP8 weight {key} has no scale: tensor {module}.weight_scale (or "
                f"{module}.weight_scale_inv) is missing"
            )
        if w.ndim != 2:
            raise ValueError(
                f"{self.path}: FP8 tensor {key} has shape {tuple(w.shape)}: paxengine reads "
                f"FP8 weights of 2-D (Linear) layers only"
            )
        scale = self.tensor(skey)
        if not projection:
            return dequantize_np(w, scale, self.block, skey).astype(self.matrix_dtype)
        q, exact = to_fp8_weight(w, scale, self.block, skey)
        self.fp8_projections += 1
        if not exact:
            self.requantized.append(key)
        return q

    def prequantized(self) -> str | None:
        """What the meta says of the checkpoint's FP8 form (None: a dense checkpoint), logged."""
        name = self.path.name
        if self.fp8_projections:
            what = self.scheme.describe() if self.scheme else "fp8 (no quantization_config)"
            log.info("%s: FP8 checkpoint (%s)", name, what)
        elif self.scheme is not None:
            what = self.scheme.describe()
            log.info("%s: %s checkpoint without FP8 projections", name, what)
        else:
            return None
        if self.requantized:
            log.info(
                "%s: %d weights have block scales that one scale per output channel cannot "
                "hold: dequantized and quantized again per output channel (e.g. %s)",
                name,
                len(self.requantized),
                self.requantized[0],
            )
        return what


# Per-layer KV-cache scale tensors (compressed-tensors kv_cache_scheme, and older exports).
KV_SCALE_NAMES = {
    "self_attn.k_scale": (0,),
    "self_attn.v_scale": (1,),
    "self_attn.k_proj.output_scale": (0,),
    "self_attn.v_proj.output_scale": (1,),
    "self_attn.attn.k_scale": (0,),
    "self_attn.attn.v_scale": (1,),
    "self_attn.kv_scale": (0, 1),
}


def kv_scales_array(
    found: dict[tuple[int, int], float], num_layers: int, layers=None
) -> np.ndarray | None:
    """{(layer, 0 = k | 1 = v): scale} -> np.float32 [len(layers), 2] (layers: the model's
    attention layers, default all `num_layers`); None when there are none; a checkpoint with
    some but not all is a ValueError naming the first missing one."""
    if not found:
        return None
    layers = list(range(num_layers) if layers is None else layers)
    out = np.zeros((len(layers), 2), np.float32)
    for row, i in enumerate(layers):
        for j, kv in enumerate("kv"):
            if (i, j) not in found:
                raise ValueError(
                    f"the checkpoint has KV-cache scales but not model.layers.{i}.self_attn."
                    f"{kv}_scale (nor model.layers.{i}.self_attn.{kv}_proj.output_scale)"
                )
            out[row, j] = found[(i, j)]
    return out
