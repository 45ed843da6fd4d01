"""Policy unit tests (`nexuskv policy test`): TOML cases with partial inputs and expected verdicts, like `opa test`.

A case names a policy, a rule kind, inputs (partial contract dicts deep-merged over built-in samples) and the
expected verdict fields. Inputs are validated like any contract, so a typo in a test is an error, not a pass.
"""

from __future__ import annotations

import copy
import datetime as _dt
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from attrs import define

from nexuskv.contracts import Predicted, Request, StateDescriptor, from_dict
from nexuskv.errors import ContractError
from nexuskv.policy.loader import Policies
from nexuskv.policy.model import Candidate
from nexuskv.policy.verdict import Verdict

__all__ = ["CaseResult", "build_activation", "run_tests", "sample_request", "sample_state"]

_LAYOUT = {"groups": [{"kind": "dense", "layers": 4, "kv_heads": 2, "head_dim": 64}], "page_size": 16}
_MODEL = {"name": "tiny-llama", "revision": "1", "dtype": "float16"}
_TOKENIZER = {"name": "tiny-bpe"}


def sample_request() -> dict[str, Any]:
    """A complete request dict that test inputs are merged over."""
    return {"request_id": "test", "tenant": "default", "model": copy.deepcopy(_MODEL),
            "tokenizer": dict(_TOKENIZER), "layout": copy.deepcopy(_LAYOUT), "token_ids": list(range(64))}  # fmt: skip


def sample_state() -> dict[str, Any]:
    """A complete state descriptor dict that test inputs are merged over."""
    return {"key": "0" * 32, "namespace": {"tenant": "default"}, "model": copy.deepcopy(_MODEL),
            "tokenizer": dict(_TOKENIZER), "layout": copy.deepcopy(_LAYOUT), "span": {"start": 0, "end": 16},
            "nbytes": 32768, "checksum": "blake2b-128:" + "0" * 32,
            "placement": {"tier": "dram", "node": "node-a", "epoch": 1}}  # fmt: skip


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
    return out


def build_activation(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """Native activation values from partial JSON-like inputs (`state`, `request`, `match`, `cost`, ...)."""
    act: dict[str, Any] = {}
    unknown = set(inputs) - {"state", "request", "match", "cost", "tier", "node", "now"}
    if unknown:
        raise ContractError("policy test input", [(k, "unknown input (state, request, match, cost, tier, node, "
                                                      "now)") for k in sorted(unknown)])  # fmt: skip
    act["request"] = from_dict(Request, _merge(sample_request(), inputs.get("request", {})))
    if "state" in inputs:
        act["state"] = from_dict(StateDescriptor, _merge(sample_state(), inputs["state"]))
    if "match" in inputs:
        try:
            act["match"] = Candidate(**inputs["match"])
        except TypeError as exc:
            raise ContractError("policy test input", [("match", str(exc))]) from None
    if "cost" in inputs:
        try:
            act["cost"] = Predicted(**inputs["cost"])
        except TypeError as exc:
            raise ContractError("policy test input", [("cost", str(exc))]) from None
    for k in ("tier", "node"):
        if k in inputs:
            act[k] = str(inputs[k])
    if "now" in inputs:
        now = inputs["now"]
        act["now"] = now if isinstance(now, _dt.datetime) else _dt.datetime.fromisoformat(str(now))
    return act


@define(frozen=True)
class CaseResult:
    """One policy test case's outcome."""

    file: str
    name: str
    passed: bool
    failures: tuple[str, ...] = ()
    verdict: Verdict | None = None


_EXPECTABLE = {"allowed", "max_tokens", "deciding", "fired", "messages", "warnings", "audits", "errors",
               "tier", "ttl_s", "priority"}  # fmt: skip


def _check(verdict: Verdict, expect: Mapping[str, Any]) -> list[str]:
    out = []
    for key, want in expect.items():
        if key in ("tier", "ttl_s", "priority"):
            got: Any = getattr(verdict.placement, key) if verdict.placement is not None else None
        elif key in ("warnings", "audits", "errors", "messages") and isinstance(want, int):
            got = len(getattr(verdict, key))
        elif key in ("warnings", "audits", "errors"):
            got = [w.split(":", 1)[0] for w in getattr(verdict, key)]  # compare rule names
            want = list(want)
        elif key in ("deciding", "fired", "messages"):
            got, want = list(getattr(verdict, key)), list(want)
        else:
            got = getattr(verdict, key)
        if got != want:
            out.append(f"{key}: expected {want!r}, got {got!r}")
    return out


def run_tests(policies: Policies, paths: list[Path]) -> list[CaseResult]:
    """Run every `[[case]]` of the given TOML files against `policies`."""
    results: list[CaseResult] = []
    for path in paths:
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            results.append(CaseResult(str(path), "<file>", False, (f"cannot read tests: {exc}",)))
            continue
        for i, case in enumerate(data.get("case", [])):
            name = str(case.get("name", f"case {i}"))
            results.append(_run_case(policies, str(path), name, case))
        extra = set(data) - {"case"}
        if extra:
            results.append(CaseResult(str(path), "<file>", False, (f"unknown top-level keys {sorted(extra)}",)))
    return results


def _run_case(policies: Policies, file: str, name: str, case: Mapping[str, Any]) -> CaseResult:
    unknown = set(case) - {"name", "policy", "kind", "input", "expect"}
    if unknown:
        return CaseResult(file, name, False, (f"unknown case keys {sorted(unknown)}",))
    bad_expect = set(case.get("expect", {})) - _EXPECTABLE
    if bad_expect:
        return CaseResult(file, name, False, (f"unknown expect keys {sorted(bad_expect)}",))
    try:
        ps = policies.for_tenant(str(case.get("policy", "default")))
        act = build_activation(case.get("input", {}))
        verdict = ps.evaluate(str(case.get("kind", "")), act)
    except (ContractError, ValueError) as exc:
        return CaseResult(file, name, False, (str(exc),))
    failures = _check(verdict, case.get("expect", {}))
    return CaseResult(file, name, not failures, tuple(failures), verdict)
