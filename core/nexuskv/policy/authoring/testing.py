"""Policy unit tests (`nexuskv policy test`): TOML cases with partial inputs and expected verdicts, like `opa test`.

A case names a policy, a rule kind, inputs (partial contract dicts deep-merged over built-in samples) and the
expected verdict fields. Inputs are validated like any contract, so a typo in a test is an error, not a pass.
"""

from __future__ import annotations

import copy
import datetime as _dt
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
from attrs import define

from nexuskv.contracts import Predicted, Request, StateDescriptor, from_dict
from nexuskv.errors import ContractError
from nexuskv.policy.compiler import _locate
from nexuskv.policy.loader import Policies
from nexuskv.policy.model import Candidate, RouteTarget
from nexuskv.policy.policyset import PolicySet
from nexuskv.policy.verdict import Verdict

__all__ = ["CaseResult", "Observer", "build_activation", "run_tests", "sample_request", "sample_state"]

Observer = Callable[[PolicySet, str, dict[str, Any]], None]
"""Called with (policy set, kind, activation values) for every case that was evaluated (see `policy.coverage`)."""

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


def build_activation(inputs: Mapping[str, Any], kind: str | None = None) -> dict[str, Any]:
    """Native activation values from partial JSON-like inputs (`state`, `request`, `match`, `cost`, ...).

    With `kind`, what that kind's rules see is completed: the sample `state` for admit and place, zero `cost`
    and the candidate's `tier` for reuse; a reuse or share case must give its `match`.
    """
    act: dict[str, Any] = {}
    unknown = set(inputs) - {"state", "request", "match", "cost", "tier", "node", "now", "target"}
    if unknown:
        raise ContractError("policy test input", [(k, "unknown input (state, request, match, cost, tier, node, "
                                                      "now, target)") for k in sorted(unknown)])  # fmt: skip
    act["request"] = _contract("request", Request, sample_request(), inputs.get("request", {}))
    if "state" in inputs:
        act["state"] = _contract("state", StateDescriptor, sample_state(), inputs["state"])
    if "match" in inputs:
        act["match"] = _plain("match", Candidate, inputs["match"])
    if "cost" in inputs:
        act["cost"] = _plain("cost", Predicted, inputs["cost"])
    if "target" in inputs:
        act["target"] = _plain("target", RouteTarget, inputs["target"])
    for k in ("tier", "node"):
        if k in inputs:
            act[k] = str(inputs[k])
    if "now" in inputs:
        now = inputs["now"]
        act["now"] = now if isinstance(now, _dt.datetime) else _dt.datetime.fromisoformat(str(now))
    if kind in ("admit", "place") and "state" not in act:
        act["state"] = from_dict(StateDescriptor, sample_state())
    if kind == "route" and "target" not in act:
        raise ContractError("policy test input", [("target", "required for route cases (at least `node`)")])
    if kind == "route":
        act.setdefault("node", act["target"].node)
    if kind in ("reuse", "share") and "match" not in act:
        raise ContractError("policy test input", [("match", f"required for {kind} cases (at least `tokens`)")])
    if kind == "reuse":
        act.setdefault("cost", Predicted())
        act.setdefault("tier", act["match"].tier)
    return act


def _contract(name: str, cls: type[Any], base: dict[str, Any], over: Any) -> Any:
    """A contract object from a partial dict merged over a sample; problems name the input path (`state.nbyts`)."""
    if not isinstance(over, Mapping):
        raise ContractError("policy test input", [(name, f"expected a table, got {type(over).__name__}")])
    try:
        return from_dict(cls, _merge(base, over))
    except ContractError as exc:
        raise ContractError("policy test input", [(f"{name}.{p}", m) for p, m in exc.problems]) from None


_JSON_TYPES: dict[Any, tuple[type, ...]] = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,)}
_JSON_TYPES.update({int: (int,), float: (int, float), str: (str,), bool: (bool,)})


def _plain(name: str, cls: type[Any], data: Any) -> Any:
    """A `Candidate` / `Predicted` from a dict, with unknown fields and wrong value types named like a contract's."""
    if not isinstance(data, Mapping):
        raise ContractError("policy test input", [(name, f"expected a table, got {type(data).__name__}")])
    fields = {f.name: f for f in attrs.fields(cls)}
    problems = [(f"{name}.{k}", f"unknown field (one of {', '.join(fields)})") for k in data if k not in fields]
    values: dict[str, Any] = {}
    for k, v in data.items():
        f = fields.get(k)
        if f is None:
            continue
        want = _JSON_TYPES.get(f.type, ())
        if want and (not isinstance(v, want) or (isinstance(v, bool) and bool not in want)):
            problems.append((f"{name}.{k}", f"expected {want[-1].__name__}, got {type(v).__name__}"))
            continue
        values[k] = float(v) if float in want else v
    missing = [k for k, f in fields.items() if f.default is attrs.NOTHING and k not in data]
    problems += [(f"{name}.{k}", "required field is missing") for k in missing]
    if problems:
        raise ContractError("policy test input", sorted(problems))
    return cls(**values)


@define(frozen=True)
class CaseResult:
    """One policy test case's outcome."""

    file: str
    name: str
    passed: bool
    failures: tuple[str, ...] = ()
    verdict: Verdict | None = None


_EXPECTABLE = {"allowed", "max_tokens", "deciding", "fired", "messages", "warnings", "audits", "errors",
               "tier", "ttl_s", "priority", "weight"}  # fmt: skip


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


def run_tests(policies: Policies, paths: list[Path], observe: Observer | None = None) -> list[CaseResult]:
    """Run every `[[case]]` of the given TOML files against `policies`; `observe` sees each evaluated case."""
    results: list[CaseResult] = []
    for path in paths:
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            results.append(CaseResult(str(path), "<file>", False, (f"cannot read tests: {exc}",)))
            continue
        for i, case in enumerate(data.get("case", [])):
            name = str(case.get("name", f"case {i}"))
            results.append(_run_case(policies, str(path), name, case, observe))
        extra = set(data) - {"case"}
        if extra:
            results.append(CaseResult(str(path), "<file>", False, (f"unknown top-level keys {sorted(extra)}",)))
    return results


def _run_case(
    policies: Policies, file: str, name: str, case: Mapping[str, Any], observe: Observer | None = None
) -> CaseResult:
    unknown = set(case) - {"name", "policy", "kind", "input", "expect"}
    if unknown:
        return CaseResult(file, name, False, (f"unknown case keys {sorted(unknown)}",))
    bad_expect = set(case.get("expect", {})) - _EXPECTABLE
    if bad_expect:
        return CaseResult(file, name, False, (f"unknown expect keys {sorted(bad_expect)}",))
    policy = str(case.get("policy", "default"))
    if policy not in policies.sets:  # a typo must not silently test the default policy
        have = ", ".join(policies.tenants())
        return CaseResult(file, name, False, (f"unknown policy {policy!r} (have: {have})",))
    try:
        ps = policies.for_tenant(policy)
        act = build_activation(case.get("input", {}), str(case.get("kind", "")))
        verdict = ps.evaluate(str(case.get("kind", "")), act)
    except (ContractError, ValueError) as exc:
        return CaseResult(file, name, False, (str(exc),))
    if observe is not None:
        observe(ps, str(case.get("kind", "")), act)
    failures = _check(verdict, case.get("expect", {}))
    if failures:  # which rule decided (where), or what the default was: a failure says why, not only what
        why = _why(ps, str(case.get("kind", "")), verdict)
        failures = [f"{f}; {why}" for f in failures]
    return CaseResult(file, name, not failures, tuple(failures), verdict)


_DEFAULTS = {"admit": "allowed", "reuse": "allowed, no cap", "share": "denied (no share rule grants it)",
             "route": "node kept, unweighted"}  # fmt: skip


def _why(ps: PolicySet, kind: str, verdict: Verdict) -> str:
    """`decided by rule R (file:line)`, or `no rule matched: default ...` for a failed case's message."""
    if not verdict.deciding:
        default = f"tier {ps.default_tier!r}" if kind == "place" else _DEFAULTS.get(kind, "")
        head = f"no rule decided (fired: {', '.join(verdict.fired)})" if verdict.fired else "no rule matched"
        return f"{head}: default {default}"
    rules = {r.name: r for r in ps.rules.get(kind, ())}
    texts: dict[str, str | None] = {}
    named = []
    for rule_name in verdict.deciding:
        rule = rules.get(rule_name)
        if rule is None:
            named.append(rule_name)
            continue
        if rule.file not in texts:
            try:
                texts[rule.file] = Path(rule.file).read_text()
            except (OSError, UnicodeDecodeError):  # a bundle's file: no line then
                texts[rule.file] = None
        text = texts[rule.file]
        line = _locate(text, (kind, rule_name, None, None, 0))[0] if text is not None else None
        named.append(f"{rule_name} ({rule.file}{f':{line}' if line is not None else ''})")
    return f"decided by rule{'s' if len(named) > 1 else ''} {', '.join(named)}"
