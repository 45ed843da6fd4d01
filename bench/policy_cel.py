"""Micro-benchmark of the policy CEL compiler: a 7-clause rule, compiled vs hand-written Python vs cel-python.

Run `python bench/policy_cel.py`; it ends with `RESULT` lines (and always exits 0).
"""

from __future__ import annotations

import statistics
import sys
import timeit
from collections.abc import Callable
from typing import Any

import celpy

from nexuskv import contracts as c
from nexuskv.policy import BOOL, Env, compile_expr, message_type

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
    print(f"RESULT policy.rule_compiled_over_lambda {t_compiled / t_lambda:.2f} <= 3")
    print(f"RESULT policy.rule_celpy_over_compiled {t_celpy / t_compiled:.1f} >= 50")
    return 0


if __name__ == "__main__":
    sys.exit(main())
