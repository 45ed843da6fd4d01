"""NexusKV: the decision layer for LLM model-state reuse. This module is its public API.

Plugins, benches, examples and embedding applications import from `nexuskv` (and the public modules
`nexuskv.cel`, `nexuskv.cel.conformance`, `nexuskv.cli`, `nexuskv.testing`, `nexuskv.testing.stress` and the
builtin plugins `nexuskv.builtins.*`); every other module is private, and a test fails when one is imported from
outside the kernel. `tests/test_api.py` pins this list.
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
from nexuskv.contracts.checksums import checksum, verify_checksum
from nexuskv.contracts.descriptor_codec import DescriptorEncoder, DescriptorParser
from nexuskv.errors import (
    ChecksumError,
    ConfigError,
    ContractError,
    DeadlinePassed,
    NexusKVError,
    PluginError,
    SchemaVersionError,
)
from nexuskv.kernel import CommitResult, Kernel, KernelConfig, LoadReport, Materialized
from nexuskv.logs import bind_request, configure_logging, get_logger
from nexuskv.paths.route import NodeState, RouteDecision, RouteOption
from nexuskv.planning.cost import CostModel, default_profile, load_profile
from nexuskv.planning.decision import to_plan
from nexuskv.planning.planner import RESIDENT_TIER
from nexuskv.plugins.hookspecs import hookimpl
from nexuskv.plugins.interfaces import (
    ControlPlane,
    EvictionCallback,
    Lease,
    PersistentTierStore,
    StoredState,
    TierStore,
    Transport,
    slot_named,
    slot_of,
    store_name,
)
from nexuskv.plugins.manager import PluginManager
from nexuskv.policy.bundle import BundleError, PolicyBundle
from nexuskv.policy.loader import Policies, PolicyError
from nexuskv.policy.model import Candidate
from nexuskv.policy.serving.live import LivePolicies
from nexuskv.policy.serving.rollout import PolicyChannel, Rollout
from nexuskv.state.identity import CHAIN_PERSON, BlockKeyer, KeyChain, load_secret
from nexuskv.state.index import DictIndex, Holding, HoldingCodes, IndexSnapshot, Location, Match, Matcher
from nexuskv.state.restore_points import longest_restore_point, valid_restore_point
from nexuskv.storage.eviction import Frequency, HeapEntry, Lineage, parent_slot, pick_victims, refreshed_priority
from nexuskv.storage.handoff import HandoffResult
from nexuskv.storage.state_seal import StateSeal
from nexuskv.units import parse_bytes

__version__ = "0.1.0"

__all__ = [
    "AdapterIdentity",
    "BlockKeyer",
    "BundleError",
    "CHAIN_PERSON",
    "Calibration",
    "Candidate",
    "ChecksumError",
    "CodecCost",
    "CommitResult",
    "ConfigError",
    "ContractError",
    "ControlPlane",
    "CostModel",
    "CostProfile",
    "DeadlinePassed",
    "DescriptorEncoder",
    "DescriptorParser",
    "DictIndex",
    "EvictionCallback",
    "ExtraInput",
    "Frequency",
    "HandoffResult",
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
    "LivePolicies",
    "LoadReport",
    "Location",
    "Match",
    "Matcher",
    "Materialized",
    "ModelIdentity",
    "Namespace",
    "NexusKVError",
    "NodeState",
    "PersistentTierStore",
    "Placement",
    "Plan",
    "PlanAction",
    "PlanSpan",
    "PluginError",
    "PluginManager",
    "Policies",
    "PolicyBundle",
    "PolicyChannel",
    "PolicyError",
    "Predicted",
    "PrefillCost",
    "RESIDENT_TIER",
    "Request",
    "Rollout",
    "RouteDecision",
    "RouteOption",
    "SchemaVersionError",
    "Slo",
    "StateDescriptor",
    "StateGroup",
    "StateSeal",
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
    "default_profile",
    "from_dict",
    "from_json",
    "get_logger",
    "hookimpl",
    "json_schema",
    "load_profile",
    "load_secret",
    "longest_restore_point",
    "parent_slot",
    "parse_bytes",
    "pick_victims",
    "refreshed_priority",
    "slot_named",
    "slot_of",
    "store_name",
    "to_dict",
    "to_plan",
    "valid_restore_point",
    "verify_checksum",
]
