"""NexusKV's policies: per-tenant TOML files whose rules compile over the CEL engine, bundles, sharing grants.

`loader.Policies` loads a directory (or a bundle) and answers `for_tenant`; `policyset.PolicySet` evaluates a
tenant's rules; `serving/` holds what serves now (hot reload, fleet rollout) and `authoring/` the tools for policy
authors (unit tests, coverage, explanations). The CEL engine is `nexuskv.cel`, used through its public API only.
"""
