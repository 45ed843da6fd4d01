"""The public API is exactly this list: changing it is a deliberate act (and a CHANGELOG entry)."""

import nexuskv

PUBLIC = {
    "AdapterIdentity", "BlockKeyer", "CHAIN_PERSON", "Calibration", "ChecksumError", "CodecCost", "CommitResult",
    "ConfigError", "ContractError", "ControlPlane", "CostProfile", "DeadlinePassed", "DescriptorEncoder",
    "DescriptorParser", "DictIndex", "EvictionCallback", "ExtraInput", "Frequency", "HeapEntry", "Holding",
    "HoldingCodes", "IndexSnapshot", "Kernel", "KernelConfig", "KeyChain", "Layout", "Lease", "Lineage", "LinkCost",
    "LoadReport", "Location", "Match", "Matcher", "Materialized", "ModelIdentity", "Namespace", "NexusKVError",
    "NodeState", "PersistentTierStore", "Placement", "Plan", "PlanAction", "PlanSpan", "PluginError", "PluginManager",
    "Predicted", "PrefillCost", "Request", "RouteDecision", "RouteOption", "SchemaVersionError", "Slo",
    "StateDescriptor", "StateGroup", "StateKind", "StoredState", "TensorSpec", "TierStore", "TokenSpan",
    "TokenizerIdentity", "Transport", "Usage", "bind_request", "checksum", "configure_logging", "from_dict",
    "from_json", "json_schema", "get_logger", "hookimpl", "load_secret", "longest_restore_point", "parent_slot",
    "parse_bytes", "pick_victims", "refreshed_priority", "slot_of", "to_dict", "valid_restore_point", "verify_checksum",
    "__version__"
}  # fmt: skip


def test_public_api_is_pinned():
    assert set(nexuskv.__all__) == PUBLIC


def test_every_public_name_exists():
    for name in nexuskv.__all__:
        assert hasattr(nexuskv, name), name


def test_version_matches_distribution():
    from importlib.metadata import version

    assert nexuskv.__version__ == version("nexuskv")
