"""The converted-weights cache: a model once converted (GGUF dequantized, HF safetensors renamed
and stacked, FP8 quantized) is stored under $PAXENGINE_CACHE/weights/<key>/ as one safetensors
file (written a tensor at a time: `StreamWriter`), its config, its tokenizer and the load's
meta, and read back in place of converting again (through a memory map: `mapped`)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from pathlib import Path

import numpy as np

from paxengine.models import registry
from paxengine.models.config import ModelConfig
from paxengine.models.fp8_checkpoint import SAFETENSORS_DTYPES, SafetensorsFile
from paxengine.models.quant import Fp8Weight
from paxengine.models.weights import check_shapes, flatten, unflatten
from paxengine.tokenizer import Tokenizer

CACHE_FORMAT = 2  # 2: FP8 weights stored as e4m3 bytes + float32 scales; quantization in the key
# Cache tensor-name suffixes of an Fp8Weight's two parts.
_FP8_VALUES, _FP8_SCALES = ":fp8_values", ":fp8_scales"
log = logging.getLogger("paxengine")


def cache_root(cache_dir: str | None) -> Path:
    return Path(cache_dir or os.environ.get("PAXENGINE_CACHE", Path.home() / ".cache/paxengine"))


def entry(
    path: Path,
    dtype: str,
    cache_dir: str | None,
    quantization: str | None = None,
    hf_overrides: dict | None = None,
) -> Path:
    """The folder of `path`'s converted weights: keyed by the format, the dtype, the
    quantization, each source file's path, size and mtime, and --hf-overrides where given
    (the entry stores the config built with them: another override, or none, must not read
    it back; without overrides the key is what it always was)."""
    files = (
        [path] if path.is_file() else sorted(path.glob("*.safetensors")) + [path / "config.json"]
    )
    h = hashlib.sha256(f"{CACHE_FORMAT}|{dtype}|{quantization or 'none'}".encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    if hf_overrides:
        h.update(b"|hf_overrides|" + json.dumps(hf_overrides, sort_keys=True).encode())
    return cache_root(cache_dir) / "weights" / h.hexdigest()[:24]


def header_reserve(num_layers: int) -> int:
    """Bytes a streamed file keeps for its header: ~150 a tensor entry, a layer's dozens of
    tensors (FP8 ones twice) well inside 16 KiB, a multiple of 8 (the data stay aligned)."""
    return (64 << 10) + (16 << 10) * num_layers


class StreamWriter:
    """A converted model's params.safetensors written one tensor at a time, so that a model
    converted layer by layer is never whole in host memory (#55): the data go after a header
    space reserved up front, and the header, padded with spaces as the safetensors format
    allows, is written last. The file takes its name only in `finish` (processes may race;
    a failed conversion leaves no entry). OSError where the cache cannot be written."""

    def __init__(self, dst: Path, reserve: int):
        dst.mkdir(parents=True, exist_ok=True)
        self.dst, self.reserve = dst, reserve
        self.tmp = dst / f"params.safetensors.tmp{os.getpid()}"
        self.f = open(self.tmp, "wb")
        self.f.seek(8 + reserve)
        self.header: dict = {}
        self.offset = 0
        self.names = {v: k for k, v in SAFETENSORS_DTYPES.items()}

    def add(self, params: dict, prefix: str = "") -> None:
        """params' leaves under `prefix` + their dotted names (weights.flatten): dense arrays
        as they are (the model dtype is part of the entry's key), FP8 weights as e4m3 bytes and
        float32 scales. Device arrays come to the host one at a time."""
        for k, v in flatten(params, prefix).items():
            if isinstance(v, Fp8Weight):
                self._tensor(k + _FP8_VALUES, np.asarray(v.values).view(np.uint8))
                self._tensor(k + _FP8_SCALES, np.asarray(v.scales, np.float32))
            else:
                self._tensor(k, np.asarray(v))

    def _tensor(self, name: str, a: np.ndarray) -> None:
        a = np.ascontiguousarray(a)
        end = self.offset + a.nbytes
        shape = list(a.shape)
        self.header[name] = {
            "dtype": self.names[a.dtype],
            "shape": shape,
            "data_offsets": [self.offset, end],
        }
        self.f.write(a.reshape(-1).view(np.uint8).data)
        self.offset = end

    def finish(self, cfg: ModelConfig, tokenizer, eos: list[int], meta: dict | None) -> None:
        head = json.dumps(self.header, separators=(",", ":")).encode()
        if len(head) > self.reserve:
            self.abort()
            raise OSError(f"the header ({len(head)} bytes) outgrew its {self.reserve}")
        self.f.seek(0)
        self.f.write(self.reserve.to_bytes(8, "little") + head.ljust(self.reserve, b" "))
        self.f.close()
        _write_beside(self.dst, cfg, tokenizer, eos, meta or {})
        self.tmp.rename(self.dst / "params.safetensors")

    def abort(self) -> None:
        self.f.close()
        self.tmp.unlink(missing_ok=True)


def _write_beside(dst: Path, cfg: ModelConfig, tokenizer, eos: list[int], meta: dict) -> None:
    """The entry's config, load meta and tokenizer (a GGUF's takes seconds to rebuild from its
    metadata: kept too)."""
    if tokenizer is not None:
        tokenizer.tok.save(str(dst / "tokenizer.json"))
        (dst / "tokenizer_meta.json").write_text(
            json.dumps(
                {
                    "bos_token": tokenizer.bos_token,
                    "eos_token": tokenizer.eos_token,
                    "chat_template": tokenizer.chat_template,
                    "add_bos_token": tokenizer.add_bos_token,
                    "eos_token_ids": eos,
                }
            )
        )
    (dst / "model_config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    kv = meta.get("kv_scales")
    (dst / "load_meta.json").write_text(
        json.dumps(
            {
                "kv_scales": None if kv is None else np.asarray(kv, np.float32).tolist(),
                "prequantized": meta.get("prequantized"),
            }
        )
    )


def write(
    dst: Path,
    cfg: ModelConfig,
    params: dict,
    tokenizer: Tokenizer | None,
    eos: list[int],
    meta: dict | None = None,
) -> None:
    """Store a converted model (best effort: a read-only home only means converting again)."""
    try:
        w = StreamWriter(dst, header_reserve(cfg.num_layers))
        try:
            w.add(params)
        except BaseException:
            w.abort()
            raise
        w.finish(cfg, tokenizer, eos, meta)
    except OSError as e:
        # a read-only or full disk must not stop the engine: it converts again next time
        log.warning("the converted weights were not cached in %s: %s", dst, e)


def read_tokenizer(dst: Path) -> tuple[Tokenizer, list[int]] | None:
    """The tokenizer stored beside the weights, or None (the source's is loaded instead)."""
    if not (dst / "tokenizer.json").is_file():
        return None
    from tokenizers import Tokenizer as HFTokenizer

    meta = json.loads((dst / "tokenizer_meta.json").read_text())
    eos = list(meta.pop("eos_token_ids"))
    tok = Tokenizer(HFTokenizer.from_file(str(dst / "tokenizer.json")), eos_token_ids=eos, **meta)
    return tok, list(tok.eos_token_ids)


def mapped(path: Path) -> dict:
    """A safetensors file's tensors as read-only views of one memory map of it
    (fp8_checkpoint.SafetensorsFile, which checks each entry against the file): nothing is read
    until used, and what the device takes is paged in from the file, not copied into the
    process (a 61 GB model placed tensor by tensor never sits whole in host memory)."""
    f = SafetensorsFile(path)
    return {k: f.get(k) for k in f.keys()}


def read(dst: Path) -> tuple[ModelConfig, dict, dict]:
    """(config, params as stored: dense numpy as written, FP8 as e4m3 + scales, each a view of
    the file's memory map (`mapped`), the load's meta)."""
    import ml_dtypes

    raw = json.loads((dst / "model_config.json").read_text())
    if raw.get("rope_scaling"):
        raw["rope_scaling"] = tuple(tuple(x) for x in raw["rope_scaling"])
    cfg = ModelConfig(**raw)
    meta = json.loads((dst / "load_meta.json").read_text())
    if meta["kv_scales"] is not None:
        meta["kv_scales"] = np.asarray(meta["kv_scales"], np.float32)
    flat = mapped(dst / "params.safetensors")
    for k in [k for k in flat if k.endswith(_FP8_VALUES)]:
        name = k.removesuffix(_FP8_VALUES)
        values = flat.pop(k).view(ml_dtypes.float8_e4m3fn)  # the bytes as they are: no float32
        flat[name] = Fp8Weight(values, flat.pop(name + _FP8_SCALES))
    params = unflatten(flat)
    if cfg.family == "llama":
        check_shapes(params, cfg)
    else:
        registry.family(cfg).check_shapes(params, cfg)
    return cfg, params, {"kv_scales": meta["kv_scales"], "prequantized": meta["prequantized"]}
