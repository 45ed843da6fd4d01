"""The public API is exactly this list: changing it is a deliberate act (and a CHANGELOG entry)."""

import nexuskv
from tests.test_architecture import PUBLIC_MODULES

PUBLIC = {
    "AdapterIdentity", "BlockKeyer", "CHAIN_PERSON", "Calibration", "ChecksumError", "CodecCost", "CommitResult",
    "ConfigError", "ContractError", "ControlPlane", "CostProfile", "DeadlinePassed", "DescriptorEncoder",
    "DescriptorParser", "DictIndex", "EvictionCallback", "ExtraInput", "Frequency", "HandoffResult", "HeapEntry",
    "Holding", "HoldingCodes", "IndexSnapshot", "Kernel", "KernelConfig", "KeyChain", "Layout", "Lease", "Lineage",
    "LinkCost",
    "LoadReport", "Location", "Match", "Matcher", "Materialized", "ModelIdentity", "Namespace", "NexusKVError",
    "NodeState", "PersistentTierStore", "Placement", "Plan", "PlanAction", "PlanSpan", "PluginError", "PluginManager",
    "Predicted", "PrefillCost", "Request", "RouteDecision", "RouteOption", "SchemaVersionError", "Slo",
    "StateDescriptor", "StateGroup", "StateKind", "StoredState", "TensorSpec", "TierStore", "TokenSpan",
    "TokenizerIdentity", "Transport", "Usage", "bind_request", "checksum", "configure_logging", "from_dict",
    "from_json", "json_schema", "get_logger", "hookimpl", "load_secret", "longest_restore_point", "parent_slot",
    "parse_bytes", "pick_victims", "refreshed_priority", "slot_of", "to_dict", "valid_restore_point", "verify_checksum",
    "__version__"
}  # fmt: skip

# What plugins, benches and examples needed from private modules until the kernel moved into rooms: the cost model
# (simulator, calibration), the plan builder (the always-reuse baseline), policies and their bundles, rollout.
ADDED = {
    "BundleError", "Candidate", "CostModel", "LivePolicies", "Policies", "PolicyBundle", "PolicyChannel",
    "PolicyError", "Rollout", "default_profile", "load_profile", "to_plan",
    "StateSeal",  # issue 29: the keyed MAC of stored state (benches measure it; a tier's tests seal with it)
    "store_name", "slot_named",  # issue 29: names in shared stores are keyed hashes (every naming tier uses them)
    "RESIDENT_TIER",  # issue 31: the engine's own cache as an index location (the KV-event subscriber feeds it)
}  # fmt: skip




def test_public_api_is_pinned():
    assert set(nexuskv.__all__) == PUBLIC | ADDED


def test_no_public_name_was_dropped():
    assert set(nexuskv.__all__) >= PUBLIC


def test_the_public_modules_are_these():
    assert {"nexuskv", "nexuskv.cel", "nexuskv.cel.conformance", "nexuskv.cli", "nexuskv.testing",
                              "nexuskv.testing.stress", "nexuskv.testing.netns"} == PUBLIC_MODULES  # fmt: skip


def test_every_public_module_imports_and_names_its_api():
    import importlib

    for name in sorted(PUBLIC_MODULES):
        mod = importlib.import_module(name)
        assert mod.__doc__, name
        for attr in getattr(mod, "__all__", ()):
            assert hasattr(mod, attr), f"{name}.{attr}"


def test_every_public_name_exists():
    for name in nexuskv.__all__:
        assert hasattr(nexuskv, name), name


def test_version_matches_distribution():
    from importlib.metadata import version

    assert nexuskv.__version__ == version("nexuskv")
