"""`kv_transfer_config`: vLLM's keys where they mean the same here, checked before a model loads.

One process serves disaggregated prefill: a prefill engine (vLLM's `kv_producer`) and a decode
engine (`kv_consumer`) on devices of their own, KV pages moved between them by JAX's device-to-
device copies (`transfer.py`). `kv_role: kv_both` asks for that pair. A lone producer or consumer
would hand pages to a peer in another process, which is not built yet: refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass

from paxengine.config import json_object_option

CONNECTOR = "JaxDeviceConnector"  # jax.device_put between devices this process sees
ROLES = ("kv_producer", "kv_consumer", "kv_both")
# vLLM's cross-process connectors and their settings: named, so the refusal can say why
_OTHER_CONNECTORS = (
    "NixlConnector",
    "P2pNcclConnector",
    "PyNcclConnector",
    "LMCacheConnectorV1",
    "MooncakeConnector",
    "SharedStorageConnector",
    "MultiConnector",
)
_CROSS_PROCESS_KEYS = ("kv_ip", "kv_port", "kv_rank", "kv_parallel_size", "engine_id")


@dataclass(frozen=True)
class KVTransferConfig:
    kv_role: str = "kv_both"
    kv_connector: str = CONNECTOR
    prefill_device: int = 0  # the prefill engine's first device
    decode_device: int = 1  # the decode engine's first device
    # pages per device-to-device copy: a request's pages go in pieces of at most this many
    # (gathered into one buffer each); large pieces reach the link's bandwidth (issue #23:
    # 479 GB/s at 64 MiB, 874 GB/s at 1 GiB on the H200 pair), small ones bound the staging
    # memory. 256 pages of Llama-3.1-8B (16-token blocks) are 512 MiB.
    max_blocks_per_copy: int = 256
    # bytes of arrived pages the decode engine may hold before it can admit them (device memory
    # outside its KV pool); past it the prefill engine starts no new prompt (vLLM's key, whose
    # connectors buffer KV too)
    kv_buffer_size: float = 4e9
    # wait for every copy to land and time it (bytes / seconds in stats): for benchmarks; it
    # stalls the prefill engine's thread for the copy, which otherwise overlaps its next step
    measure_transfers: bool = False


def parse_kv_transfer_config(raw, tensor_parallel_size: int = 1) -> KVTransferConfig | None:
    """A dict (or its JSON text) -> KVTransferConfig; None/{} -> None. Raises ValueError naming
    the offending key for anything this engine cannot run."""
    if isinstance(raw, KVTransferConfig):
        return raw
    raw = json_object_option(raw, "kv_transfer_config")
    if raw is None:
        return None
    connector = raw.pop("kv_connector", CONNECTOR)
    if connector in _OTHER_CONNECTORS:
        raise ValueError(
            f"kv_transfer_config: kv_connector {connector!r} is not implemented (it moves KV "
            f"between processes); {CONNECTOR!r} moves it between the devices of this process"
        )
    if connector != CONNECTOR:
        raise ValueError(
            f"kv_transfer_config: unknown kv_connector {connector!r} (supported: {CONNECTOR!r})"
        )
    role = raw.pop("kv_role", None)
    if role not in ROLES:
        raise ValueError(f"kv_transfer_config: kv_role must be one of {ROLES}, got {role!r}")
    if role != "kv_both":
        raise ValueError(
            f"kv_transfer_config: kv_role {role!r} alone needs a peer engine in another process, "
            "which is not implemented yet; 'kv_both' runs a prefill and a decode engine in this "
            "process, on prefill_device and decode_device"
        )
    buffer = raw.pop("kv_buffer_device", "device")
    if buffer not in ("device", "cuda", "gpu"):
        raise ValueError(
            f"kv_transfer_config: kv_buffer_device {buffer!r}: pages are copied device to "
            "device; staging them in host memory is not implemented"
        )
    cross = sorted(set(raw) & set(_CROSS_PROCESS_KEYS))
    if cross:
        raise ValueError(
            f"kv_transfer_config: {cross} address a peer in another process, which is not "
            "implemented yet (both engines run in this process)"
        )
    known = {
        f for f in KVTransferConfig.__dataclass_fields__ if f not in ("kv_role", "kv_connector")
    }
    unknown = set(raw) - known
    if unknown:
        raise ValueError(
            f"kv_transfer_config: unknown keys {sorted(unknown)} (known: kv_connector, kv_role, "
            f"kv_buffer_device, {', '.join(sorted(known))})"
        )
    for key in ("prefill_device", "decode_device", "max_blocks_per_copy"):
        v = raw.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise ValueError(f"kv_transfer_config: {key} must be an integer, got {v!r}")
    size = raw.get("kv_buffer_size", KVTransferConfig.kv_buffer_size)
    if isinstance(size, bool) or not isinstance(size, (int, float)) or not size > 0:
        raise ValueError(f"kv_transfer_config: kv_buffer_size must be bytes > 0, got {size!r}")
    if not isinstance(raw.get("measure_transfers", False), bool):
        raise ValueError("kv_transfer_config: measure_transfers must be true or false")
    prefill = raw.get("prefill_device", 0)
    decode = raw.get("decode_device", prefill + tensor_parallel_size if prefill == 0 else 0)
    tp = tensor_parallel_size
    if prefill < 0 or decode < 0:
        raise ValueError("kv_transfer_config: prefill_device and decode_device must be >= 0")
    if prefill < decode + tp and decode < prefill + tp:
        raise ValueError(
            f"kv_transfer_config: the prefill engine's devices [{prefill}, {prefill + tp}) and "
            f"the decode engine's [{decode}, {decode + tp}) overlap; each needs its own"
        )
    copy = raw.get("max_blocks_per_copy", KVTransferConfig.max_blocks_per_copy)
    if copy < 1:
        raise ValueError(f"kv_transfer_config: max_blocks_per_copy must be >= 1, got {copy}")
    return KVTransferConfig(
        kv_role=role,
        prefill_device=prefill,
        decode_device=decode,
        max_blocks_per_copy=copy,
        kv_buffer_size=float(size),
        measure_transfers=raw.get("measure_transfers", False),
    )
