"""Policy evaluation speed: a 7-clause rule and a full 10-rule tenant policy, compiled vs hand-written Python.

Run `.venv/bin/python bench/policy_eval.py`; the rule is also timed with cel-python's CompiledRunner and
InterpretedRunner. Part 2 evaluates the shipped `chat` tenant policy (10 rules: 3 admit, 3 reuse, 4 place,
including inherited ones) through `PolicySet.evaluate`, against hand-written functions that return the same
decisions. It ends with `RESULT` lines (and always exits 0).
"""

from __future__ import annotations

import statistics
import sys
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import celpy

import nexuskv as c
from nexuskv import Candidate, Policies
from nexuskv.cel import BOOL, Env, compile_expr, message_type

POLICIES = Path(__file__).resolve().parents[1] / "policies"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import QUICK, interleaved, quick  # noqa: E402

RESULTS = ("policy.rule_compiled_over_lambda", "policy.rule_celpy_over_compiled", "policy.tenant_compiled_over_lambda")
RULE = (
    'request.tenant == "acme" && state.nbytes <= bytes_of("64MiB") && state.model.dtype in ["float16", '
    '"bfloat16"] && !state.namespace.tenant.startsWith("tmp-") && state.span.end - state.span.start >= 16 && '
    'state.placement.tier != "disk" && size(state.tensors) < 64'
)
# cel-python has no bytes_of(); the same rule with the constant folded in.
RULE_CELPY = RULE.replace('bytes_of("64MiB")', "67108864")


def hand_written(a: Any) -> bool:
    """The rule as a plain Python function (the 3x target's baseline)."""
    return (
        a["request"].tenant == "acme"
        and a["state"].nbytes <= 67108864
        and a["state"].model.dtype in ("float16", "bfloat16")
        and not a["state"].namespace.tenant.startswith("tmp-")
        and a["state"].span.end - a["state"].span.start >= 16
        and a["state"].placement.tier != "disk"
        and len(a["state"].tensors) < 64
    )


def activation() -> dict[str, object]:
    """A realistic state descriptor and request for which every clause holds (the worst case: all run)."""
    layout = c.Layout(groups=[c.StateGroup(kind="dense", layers=32, kv_heads=8, head_dim=128)])
    model = c.ModelIdentity(name="llama-3-8b", revision="1", dtype="bfloat16")
    tokenizer = c.TokenizerIdentity(name="llama-3")
    state = c.StateDescriptor(
        key="0123456789abcdef" * 2,
        namespace=c.Namespace("acme", scope="team-a"),
        model=model,
        tokenizer=tokenizer,
        layout=layout,
        span=c.TokenSpan(0, 256),
        nbytes=32 << 20,
        checksum="blake2b-128:00ff",
        placement=c.Placement("dram", "node-1"),
        tensors=[c.TensorSpec(name=f"layer{i}.k", dtype="bfloat16", shape=(16, 8, 128)) for i in range(8)],
    )
    request = c.Request(
        request_id="req-1",
        tenant="acme",
        model=model,
        tokenizer=tokenizer,
        layout=layout,
        token_ids=list(range(512)),
    )
    return {"state": state, "request": request}


def per_call_ns(fn: Callable[[], object], min_time: float = 0.2) -> float:
    """Median over 5 runs of the time of one call, in nanoseconds."""
    timer = timeit.Timer(fn)
    if QUICK:  # 2 runs of 3 calls
        return statistics.median(timer.repeat(repeat=2, number=3)) / 3 * 1e9
    number, _ = timer.autorange()
    number = max(number, int(number * min_time / 0.2))
    runs = timer.repeat(repeat=5, number=number)
    return statistics.median(runs) / number * 1e9


def main() -> int:
    """Run the benchmark and print the ratios."""
    act = activation()
    env = Env({"state": message_type(c.StateDescriptor), "request": message_type(c.Request)})
    compiled = compile_expr(RULE, env, expect=BOOL)
    assert compiled(act) is True and hand_written(act) is True

    cel_act = {k: celpy.json_to_cel(c.to_dict(v)) for k, v in act.items()}
    runners = {}
    for name, runner in (
        ("CompiledRunner", celpy.CompiledRunner),
        ("InterpretedRunner", celpy.InterpretedRunner),
    ):
        cenv = celpy.Environment(runner_class=runner)
        prog = cenv.program(cenv.compile(RULE_CELPY))
        assert bool(prog.evaluate(cel_act)) is True
        runners[name] = prog

    t_compiled = per_call_ns(lambda: compiled(act))
    t_lambda = per_call_ns(lambda: hand_written(act))
    t_exact = per_call_ns(lambda: compiled.evaluate_exact(act))
    t_celpy = per_call_ns(lambda: runners["CompiledRunner"].evaluate(cel_act), min_time=0.05)
    t_interp = per_call_ns(lambda: runners["InterpretedRunner"].evaluate(cel_act), min_time=0.05)

    print(f"rule: {RULE}")
    print(f"static cost bound: {compiled.cost}")
    print(f"compiled (fast path)      {t_compiled:10.0f} ns/eval")
    print(f"compiled (exact path)     {t_exact:10.0f} ns/eval")
    print(f"hand-written lambda       {t_lambda:10.0f} ns/eval")
    print(f"celpy CompiledRunner      {t_celpy:10.0f} ns/eval")
    print(f"celpy InterpretedRunner   {t_interp:10.0f} ns/eval")
    print(f"compiled / lambda               {t_compiled / t_lambda:8.2f}x")
    print(f"celpy CompiledRunner / compiled {t_celpy / t_compiled:8.1f}x")
    print(f"celpy InterpretedRunner / compiled {t_interp / t_compiled:8.1f}x")
    t_tenant, t_tenant_lambda = bench_tenant()
    print(f"RESULT policy.rule_compiled_over_lambda {t_compiled / t_lambda:.2f} <= 3")
    print(f"RESULT policy.rule_celpy_over_compiled {t_celpy / t_compiled:.1f} >= 50")
    print(f"RESULT policy.tenant_compiled_over_lambda {t_tenant / t_tenant_lambda:.2f} <= 3")
    return 0


# ------------------------------------------------------------------------------------ a full tenant policy


def hand_admit(a: dict[str, Any]) -> tuple[bool, list[str], list[str]]:
    """policies/tenants/chat.toml + default.toml admit rules, by hand."""
    s = a["state"]
    deciding: list[str] = []
    messages: list[str] = []
    if s.namespace.scope.startswith("tmp-"):
        deciding.append("no-tmp-sessions")
        messages.append("temporary session")
    if s.nbytes > 268435456:
        deciding.append("bounded-payload")
        messages.append(f"payload of {s.nbytes} bytes exceeds 256MiB")
    if not (s.checksum.startswith("xxh3-128:") or s.checksum.startswith("blake2b-128:")):
        deciding.append("checksummed")
        messages.append("payload checksum must be xxh3-128 or blake2b-128")
    return not deciding, deciding, messages


def hand_reuse(a: dict[str, Any]) -> tuple[bool, int | None, list[str], list[str]]:
    """The reuse rules, by hand."""
    m, cost, req = a["match"], a["cost"], a["request"]
    cap: int | None = None
    deciding: list[str] = []
    warnings: list[str] = []
    if a["node"].startswith("edge-") and m.tokens > 8192:
        deciding.append("cap-untrusted-node")
        cap = 8192
    if cost.gain_ms < 2.0:
        warnings.append(f"watch-slow-reuse: reuse from {m.tier} gains only {cost.gain_ms} ms")
    if m.tokens < req.layout.page_size:
        deciding.append("worth-a-page")
        cap = 0
    return cap != 0, cap, deciding, warnings


def hand_place(a: dict[str, Any]) -> tuple[str, float, float, str]:
    """The place rules, by hand: first match wins."""
    s = a["state"]
    if s.namespace.scope == "system":
        return "dram", 86400.0, 1000.0, "system-prompt-pinned"
    if s.span.end >= 4096:
        return "dram", 7200.0, s.span.end / 512.0, "long-sessions"
    if s.nbytes >= 67108864:
        return "disk", 86400.0, 0.0, "large-to-disk"
    return "dram", 3600.0, s.span.end / 1024.0, "hot-in-dram"


def bench_tenant() -> tuple[float, float]:
    """Evaluate all 10 rules of the chat tenant (admit + reuse + place) both ways; ns per full evaluation."""
    ps = Policies.load(POLICIES).for_tenant("chat")
    assert sum(len(ps.rules[k]) for k in ("admit", "reuse", "place")) == 10
    base = activation()
    state = attrs.evolve(base["state"], span=c.TokenSpan(4080, 4096))  # type: ignore[misc]
    act = {**base, "state": state, "node": "edge-1", "match": Candidate(tokens=9000, tier="dram", owner="acme"),
           "cost": c.Predicted(gain_ms=1.25)}  # fmt: skip
    admit, reuse, place = ps.evaluate("admit", act), ps.evaluate("reuse", act), ps.evaluate("place", act)
    assert (admit.allowed, list(admit.deciding), list(admit.messages)) == hand_admit(act)
    assert (reuse.allowed, reuse.max_tokens, list(reuse.deciding), list(reuse.warnings)) == hand_reuse(act)
    p = place.placement
    assert p is not None and (p.tier, p.ttl_s, p.priority, place.deciding[0]) == hand_place(act)

    def ours() -> None:
        ps.evaluate("admit", act)
        ps.evaluate("reuse", act)
        ps.evaluate("place", act)

    def theirs() -> None:
        hand_admit(act)
        hand_reuse(act)
        hand_place(act)

    t = interleaved({"ours": ours, "theirs": theirs}, rounds=quick(400, 2), inner=quick(50, 2))  # drift hits both
    t_ours, t_theirs = t["ours"] * 1e9, t["theirs"] * 1e9
    print("\nfull tenant policy `chat` (10 rules, admit + reuse + place, every rule evaluated)")
    print(f"PolicySet.evaluate x3       {t_ours:10.0f} ns")
    print(f"hand-written functions x3   {t_theirs:10.0f} ns")
    print(f"compiled / hand-written           {t_ours / t_theirs:8.2f}x")
    return t_ours, t_theirs


if __name__ == "__main__":
    sys.exit(main())
