"""Disaggregated prefill (issue #23): a prefill engine and a decode engine on devices of their
own, KV pages moved between them by JAX device-to-device copies. `config.py` (the
kv_transfer_config keys), `transfer.py` (the page copies), `roles.py` (the two engines and the
hand-off), `front.py` (the EngineClient a server runs)."""

from paxengine.disagg.config import KVTransferConfig, parse_kv_transfer_config

__all__ = ["KVTransferConfig", "parse_kv_transfer_config"]
