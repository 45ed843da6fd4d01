"""The example tier store of the plugin guide, installed as its own distribution, and the guide that shows it.

`examples/nexuskv-tier-example` is installed with pip into a directory of its own (never into .venv); a kernel
in a fresh process with that directory on PYTHONPATH finds it through its entry point, stores a request's state
in it from a TOML config, plans reuse from it and restores it checksum-verified, then a second process re-indexes
what the first left. The store itself is driven in-process from the installed copy: eviction, expiry, the
prefix property, many threads. docs/plugins.md must show the store verbatim and every `TierStore` method with
its exact signature.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import random
import re
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import attrs
import pytest

import nexuskv
from nexuskv import PersistentTierStore, TierStore, to_dict, verify_checksum
from nexuskv.planning.cost import default_profile
from nexuskv.testing import chain, prefix_problems

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "nexuskv-tier-example"
SOURCE = EXAMPLE / "nexuskv_tier_example" / "__init__.py"
DOC = (ROOT / "docs" / "plugins.md").read_text()
SECTION = DOC.partition("\n## Writing a tier store\n")[2].split("\n## ", 1)[0]  # "" until the guide has it
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example distribution, pip-installed (built by its own backend, hatchling) into a directory of its own."""
    target = tmp_path_factory.mktemp("example-site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
                    str(EXAMPLE)], check=True, timeout=600)  # fmt: skip
    assert (target / "nexuskv_tier_example" / "__init__.py").read_text() == SOURCE.read_text()
    return target


def _env(site: Path) -> dict[str, str]:
    """This environment with the installed example importable, and no plugin allow or block list."""
    env = {k: v for k, v in os.environ.items() if k not in ("NEXUSKV_PLUGINS", "NEXUSKV_DISABLE_PLUGINS")}
    return {**env, "PYTHONPATH": str(site)}


@pytest.fixture
def example(site: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The installed module, imported in this process."""
    monkeypatch.syspath_prepend(str(site))
    return importlib.import_module("nexuskv_tier_example")


# ------------------------------------------------------------------------------------------ as a distribution


def test_nexuskv_plugins_lists_the_installed_distribution(site: Path) -> None:
    out = subprocess.run([str(BIN / "nexuskv"), "plugins", "--json"], env=_env(site), capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    report = json.loads(out.stdout)
    mine = [p for p in report["plugins"] if p["name"] == "example"]
    assert mine == [{"name": "example", "source": "nexuskv-tier-example", "version": "0.1.0",
                     "hooks": ["nexuskv_register_tier_stores"]}]  # fmt: skip
    assert not [p for p in report["problems"] if "example" in json.dumps(p)]


KERNEL_SCRIPT = r"""
import json, random, sys
from pathlib import Path
from types import ModuleType
from typing import Any

import attrs
from nexuskv import Kernel, Layout, ModelIdentity, Request, StateGroup, TokenizerIdentity, slot_of

phase, config = sys.argv[1], Path(sys.argv[2])
kernel = Kernel.from_config(config)
rng = random.Random(7)
layout = Layout(groups=[StateGroup(kind="dense", layers=2, kv_heads=2, head_dim=64)], page_size=16)
prompt = [rng.randrange(32000) for _ in range(1000)]
req = Request(request_id="r1", tenant="chat", model=ModelIdentity(name="llama-3-8b", revision="abc"),
              tokenizer=TokenizerIdentity(name="llama-3"), layout=layout, token_ids=prompt)
pages = [rng.randbytes(8192) for _ in kernel.keys(req)]
out = {"tiers": list(kernel.tiers), "store": type(kernel.tiers["example"]).__module__}
if phase == "write":
    out["committed"] = len(pages)
    kernel.commit(req, pages)
    assert kernel.flush(60)
else:  # a byte of block 40's file flipped behind the store's back: served, refused by its checksum, quarantined
    victim = config.parent / "store" / f"{slot_of(kernel.keys(req)[40]).hex()}.kv"
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
follow_up = attrs.evolve(req, request_id="r2", token_ids=prompt + [1, 2, 3])
plan = kernel.plan(follow_up)
out["action"], out["reused"] = plan.action.value, plan.tokens_reused
out["span_tiers"] = sorted({s.tier for s in plan.spans})
got = kernel.materialize(plan, follow_up)
out["loaded_tokens"] = got.tokens
out["equal"] = [bytes(got.states[(b, 0)].payload) == pages[b] for b in range(got.blocks)]
if phase == "read":
    out["corrupt_file_left"] = victim.exists()
    out["replanned"] = kernel.plan(attrs.evolve(follow_up, request_id="r3")).tokens_reused
kernel.close()
print(json.dumps(out))
"""

POLICY = """\
name = "default"
failure = "deny"
min_gain_ms = 0.5
default_tier = "example"

[[place]]
name = "all-to-example"
tier = "example"
ttl = "1h"
"""

CONFIG = """\
node = "gpu-0"
page_size = 16
secret = "{secret}"
deadline_ms = 1000.0         # a noisy test machine must not turn the plan into a recompute
policies = "policies"
profile = "profile.json"

[tiers.example]
store = "example"            # the entry point's registered name
path = "store"               # relative to this file
capacity_bytes = "4MiB"
"""


def _run(site: Path, phase: str, config: Path) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-c", KERNEL_SCRIPT, phase, str(config)], env=_env(site),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    out: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return out


def test_a_kernel_reuses_state_from_the_example_tier_across_processes(site: Path, tmp_path: Path) -> None:
    (tmp_path / "policies").mkdir()
    (tmp_path / "policies" / "default.toml").write_text(POLICY)
    profile = attrs.evolve(default_profile(), tiers={"example": nexuskv.LinkCost(bandwidth_bytes_per_s=1.5e9,
                                                                                 latency_ms=0.1)})  # fmt: skip
    (tmp_path / "profile.json").write_text(json.dumps(to_dict(profile)))
    config = tmp_path / "kernel.toml"
    config.write_text(CONFIG.format(secret="ab" * 32))

    first = _run(site, "write", config)
    assert first["tiers"] == ["example"] and first["store"] == "nexuskv_tier_example"
    assert (first["action"], first["reused"], first["span_tiers"]) == ("materialize", 992, ["example"])
    assert first["loaded_tokens"] == 992 and first["equal"] == [True] * 62
    files = sorted((tmp_path / "store").iterdir())
    assert len(files) == first["committed"] == 62 and {f.suffix for f in files} == {".kv"}
    head = json.loads(files[0].read_bytes().split(b"\n", 1)[0])
    assert head["expires"] is not None  # the place rule's ttl reached the store

    second = _run(site, "read", config)  # a new process: the store re-reads its files, the kernel re-indexes them
    assert (second["action"], second["reused"], second["span_tiers"]) == ("materialize", 992, ["example"])
    assert second["loaded_tokens"] == 40 * 16 and second["equal"] == [True] * 40
    assert second["corrupt_file_left"] is False
    assert second["replanned"] == 40 * 16


# ------------------------------------------------------------------------------------------ the store itself


def test_the_store_keeps_prefixes_under_every_priority_scheme(example: ModuleType, tmp_path: Path) -> None:
    dirs = iter(range(100))
    assert prefix_problems(lambda cap: example.ExampleStore(str(tmp_path / str(next(dirs))), capacity_bytes=cap)) == []


def test_evictions_and_expiry_are_reported_and_files_follow(example: ModuleType, tmp_path: Path) -> None:
    store = example.ExampleStore(str(tmp_path / "s"), capacity_bytes=3000)
    assert isinstance(store, PersistentTierStore) and isinstance(store, TierStore)
    told: list[tuple[bytes, str, bytes | None]] = []
    store.set_eviction_callback(lambda slot, desc, payload: told.append((slot, desc.key, payload)))
    a, b, c, d = (chain(1, size=1000, seed=s)[0] for s in "abcd")
    assert store.put(a[0], a[1], a[2], priority=1.0) and store.put(b[0], memoryview(b[1]), b[2], priority=5.0)
    assert store.put(c[0], c[1], c[2], priority=0.5, ttl_s=0.0)  # expired from the start
    assert store.used_bytes() == 3000 and set(store.slots()) == {a[0], b[0], c[0]}
    assert store.get(c[0]) is None and told == [(c[0], c[2].key, None)]  # an expiry: no payload
    assert store.put(d[0], d[1], d[2], priority=2.0)
    assert not store.put(a[0], a[1] * 4, a[2], priority=99.0)  # larger than the store: refused, nothing changes
    assert store.put(c[0], c[1], c[2], priority=3.0)  # room made by evicting a (priority 1), handed over
    assert told[1:] == [(a[0], a[2].key, a[1])] and store.floor == 1.0
    assert not store.put(a[0], a[1], a[2], priority=0.1)  # everything held is worth more
    got = store.get(b[0])
    assert got is not None and bytes(got.payload) == b[1] and got.descriptor == b[2]
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == sorted(f"{s.hex()}.kv" for s in (b[0], c[0], d[0]))
    assert store.delete(d[0]) and not store.delete(d[0]) and len(told) == 2  # a delete is not an eviction
    store.close()
    again = example.ExampleStore(str(tmp_path / "s"), capacity_bytes=3000)
    assert sorted(again.descriptors()) == sorted([(b[0], b[2]), (c[0], c[2])])
    assert again.used_bytes() == 2000


def test_many_threads_leave_memory_and_files_in_agreement(example: ModuleType, tmp_path: Path) -> None:
    root = tmp_path / "s"
    store = example.ExampleStore(str(root), capacity_bytes=20 * 512)
    blocks = [blk for s in range(8) for blk in chain(12, size=512, seed=f"t{s}")]
    evicted: list[bytes] = []
    store.set_eviction_callback(lambda slot, desc, payload: evicted.append(slot))
    bad: list[str] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(300):
            slot, payload, desc = rng.choice(blocks)
            if rng.random() < 0.5:
                store.put(slot, payload, desc, priority=rng.random(), ttl_s=rng.choice([None, 3600.0]))
            elif (got := store.get(slot)) is not None and not verify_checksum(got.payload, got.descriptor.checksum):
                bad.append(slot.hex())
            elif rng.random() < 0.1:
                store.delete(slot)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert bad == [] and evicted
    held = set(store.slots())
    assert {bytes.fromhex(p.stem) for p in root.iterdir()} == held
    assert store.used_bytes() == 512 * len(held) <= store.capacity_bytes


# ------------------------------------------------------------------------------------------ the guide


def test_the_guide_shows_the_example_verbatim() -> None:
    assert f"```python\n{SOURCE.read_text()}```" in SECTION
    assert f"```toml\n{(EXAMPLE / 'pyproject.toml').read_text()}```" in SECTION


def _methods(proto: type) -> dict[str, Callable[..., Any]]:
    return {n: f for n, f in vars(proto).items()
            if inspect.isfunction(f) and f.__qualname__.startswith(f"{proto.__name__}.")}  # fmt: skip


def _signature(fn: Callable[..., Any]) -> str:
    """`def name(self, p: T = default, ...) -> R` with the annotations as written in `nexuskv.plugins.interfaces`."""
    sig = inspect.signature(fn)
    params = []
    for p in sig.parameters.values():
        text = p.name if p.annotation is p.empty else f"{p.name}: {p.annotation}"
        params.append(text if p.default is p.empty else f"{text} = {p.default!r}")
    return f"def {fn.__name__}({', '.join(params)}) -> {sig.return_annotation}"


METHODS = {**_methods(TierStore), **_methods(PersistentTierStore)}


def test_protocol_methods_are_found() -> None:
    assert set(METHODS) >= {"put", "get", "delete", "__contains__", "slots", "used_bytes", "set_eviction_callback",
                            "close", "descriptors"}  # fmt: skip


@pytest.mark.parametrize("name", sorted(METHODS))
def test_the_guide_documents_every_method_with_its_exact_signature(name: str) -> None:
    flat = re.sub(r"\(\s+", "(", re.sub(r"\s*\n\s*", " ", SECTION))  # a signature may wrap
    assert _signature(METHODS[name]) in flat, f"docs/plugins.md does not show {_signature(METHODS[name])}"
    assert f"#### `{name}`" in SECTION


def test_the_guide_documents_no_method_that_does_not_exist() -> None:
    assert set(re.findall(r"#### `(\w+)`", SECTION)) == set(METHODS)
    for attr in ("name: str", "capacity_bytes: int"):
        assert attr in SECTION
