"""NexusKV: the decision layer for LLM model-state reuse. This module is the public API; nothing else is.

Plugins and embedding applications import from `nexuskv` only; a test pins this list.
"""

from __future__ import annotations

from nexuskv.contracts import (
    AdapterIdentity,
    Calibration,
    CodecCost,
    CostProfile,
    ExtraInput,
    Layout,
    LinkCost,
    ModelIdentity,
    Namespace,
    Placement,
    Plan,
    PlanAction,
    PlanSpan,
    Predicted,
    PrefillCost,
    Request,
    Slo,
    StateDescriptor,
    StateGroup,
    StateKind,
    TensorSpec,
    TokenizerIdentity,
    TokenSpan,
    Usage,
    from_dict,
    from_json,
    json_schema,
    to_dict,
)
from nexuskv.descriptors import DescriptorEncoder, DescriptorParser
from nexuskv.errors import (
    ChecksumError,
    ConfigError,
    ContractError,
    DeadlinePassed,
    NexusKVError,
    PluginError,
    SchemaVersionError,
)
from nexuskv.eviction import Frequency, HeapEntry, Lineage, parent_slot, pick_victims, refreshed_priority
from nexuskv.hookspecs import hookimpl
from nexuskv.identity import CHAIN_PERSON, BlockKeyer, KeyChain, checksum, load_secret, verify_checksum
from nexuskv.index import DictIndex, Holding, HoldingCodes, IndexSnapshot, Location, Match, Matcher
from nexuskv.interfaces import (
    ControlPlane,
    EvictionCallback,
    Lease,
    PersistentTierStore,
    StoredState,
    TierStore,
    Transport,
    slot_of,
)

# The kernel facade last: it pulls in the plugin manager, whose builtins import the names above.
from nexuskv.kernel import CommitResult, Kernel, KernelConfig, LoadReport, Materialized
from nexuskv.kinds import longest_restore_point, valid_restore_point
from nexuskv.logs import bind_request, configure_logging, get_logger
from nexuskv.plugins import PluginManager
from nexuskv.routing import NodeState, RouteDecision, RouteOption
from nexuskv.units import parse_bytes

__version__ = "0.1.0"

__all__ = [
    "AdapterIdentity",
    "BlockKeyer",
    "CHAIN_PERSON",
    "Calibration",
    "ChecksumError",
    "CodecCost",
    "CommitResult",
    "ConfigError",
    "ContractError",
    "ControlPlane",
    "CostProfile",
    "DeadlinePassed",
    "DescriptorEncoder",
    "DescriptorParser",
    "DictIndex",
    "EvictionCallback",
    "ExtraInput",
    "Frequency",
    "HeapEntry",
    "Holding",
    "HoldingCodes",
    "IndexSnapshot",
    "Kernel",
    "KernelConfig",
    "KeyChain",
    "Layout",
    "Lease",
    "Lineage",
    "LinkCost",
    "LoadReport",
    "Location",
    "Match",
    "Materialized",
    "Matcher",
    "ModelIdentity",
    "Namespace",
    "NexusKVError",
    "NodeState",
    "Placement",
    "Plan",
    "PlanAction",
    "PersistentTierStore",
    "PlanSpan",
    "PluginError",
    "PluginManager",
    "Predicted",
    "PrefillCost",
    "Request",
    "RouteDecision",
    "RouteOption",
    "SchemaVersionError",
    "Slo",
    "StateDescriptor",
    "StateGroup",
    "StateKind",
    "StoredState",
    "TensorSpec",
    "TierStore",
    "TokenSpan",
    "TokenizerIdentity",
    "Transport",
    "Usage",
    "__version__",
    "bind_request",
    "checksum",
    "configure_logging",
    "from_dict",
    "from_json",
    "json_schema",
    "get_logger",
    "hookimpl",
    "load_secret",
    "longest_restore_point",
    "parent_slot",
    "parse_bytes",
    "pick_victims",
    "refreshed_priority",
    "slot_of",
    "to_dict",
    "valid_restore_point",
    "verify_checksum",
]
