"""NexusKV as a vLLM KV connector.

vLLM loads `nexuskv_vllm.connector.NexusKVConnector` (see docs/vllm.md). `identity` maps vLLM's config and
request fields to NexusKV's identity fields, `scheduler` and `worker` are the connector's two sides, `shared`
keeps one kernel per engine. This package imports nothing from vLLM until the connector module is loaded.
"""

from __future__ import annotations

from nexuskv_vllm.identity import EngineIdentity, RequestScope, adapter_identity, files_digest, request_scope

__all__ = ["EngineIdentity", "RequestScope", "adapter_identity", "files_digest", "request_scope"]
