"""NexusKV from vLLM's KV events: which prefixes each engine holds in its own cache, so routes price them.

`EngineResidency` keeps one engine's cache as `RESIDENT_TIER` locations of its node in a kernel's index;
`KVEventSubscriber` follows the engine's ZMQ event stream into it, with gap detection and replay.
"""

from nexuskv_vllm_events.residency import EngineResidency
from nexuskv_vllm_events.subscriber import KVEventSubscriber
from nexuskv_vllm_events.wire import WireError

__all__ = ["EngineResidency", "KVEventSubscriber", "WireError"]
