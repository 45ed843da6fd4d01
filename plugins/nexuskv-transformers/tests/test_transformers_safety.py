"""The semantic safety suite: restored state + suffix prefill equals a full prefill, and unsafe reuse is refused.

Equality is checked at every continuation position (argmax equal, max abs difference <= 1e-5 in fp32). Each unsafe
case is shown twice: the kernel refuses it, and forcing the restore anyway gives different logits, so the refusal
is what protects the answer.
"""

from __future__ import annotations

import pytest
import torch

from conftest import SECRET, connector, model, tokens
from nexuskv import Kernel, KernelConfig, PlanAction, slot_of

KINDS = ["dense", "latent", "windowed", "recurrent", "hybrid"]
TOL = 1e-5
PAGE = 16


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert (got - want).abs().max().item() <= TOL


def assert_differs(got: torch.Tensor, want: torch.Tensor) -> float:
    diff = (got - want).abs().max().item()
    assert diff > 1e-3, f"forced restore gave the same logits (max diff {diff:g}): the case is not unsafe"
    return diff


def warm(kernel, ref, ids, tenant="t", **kw):
    c = connector(kernel, ref, checkpoint_every=kw.pop("checkpoint_every", 1), **kw)
    c.run(c.request(ids, tenant=tenant))
    assert kernel.flush(10)
    return c


def forced_cache(producer_kernel, producer, request, blocks):
    """Restore `blocks` blocks of `request` (as the producer stored them) without any identity or checksum check."""
    from nexuskv_transformers.state import StateCodec

    keys = producer_kernel.keys(request)
    codec = StateCodec(producer)
    states = {}
    for gi, (g, _) in enumerate(producer.groups):
        for b in ([blocks - 1] if g.kind.checkpointed else range(blocks)):
            got = producer_kernel.tiers["dram"].get(slot_of(keys[b], gi))
            states[(b, gi)] = (got.payload, got.descriptor)
    return codec.restore(states, blocks)


# ------------------------------------------------------------------------------------------ equal to a full prefill


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cut", [1, 2, 3, 6])
def test_restore_then_suffix_equals_full_prefill(kernel, kind, cut):
    ref = model(kind)
    base = tokens(100)
    c = warm(kernel, ref, base)
    ids = base[: cut * PAGE] + tokens(20, seed=7)  # shares exactly `cut` blocks with what was committed
    out = c.run(c.request(ids, tenant="t"), all_logits=True)
    assert out.plan.action == PlanAction.MATERIALIZE and out.tokens_reused == cut * PAGE, out.plan.reasons
    full = c.engine.prefill(ids, all_logits=True)
    assert_same(out.logits, full.logits[cut * PAGE :])


@pytest.mark.parametrize("kind", KINDS)
def test_whole_prompt_again_leaves_one_token_to_compute(kernel, kind):
    ref = model(kind)
    ids = tokens(96)  # exactly 6 blocks: the plan may restore 5, then the last block's 16 tokens are computed
    c = warm(kernel, ref, ids)
    out = c.run(c.request(ids, tenant="t"), all_logits=True)
    assert out.tokens_reused == 80
    assert_same(out.logits, c.engine.prefill(ids, all_logits=True).logits[80:])
    odd = [*ids, 5]  # 97 tokens: 96 restored, one computed
    c2 = warm(kernel, ref, odd)
    out = c2.run(c2.request(odd, tenant="t"), all_logits=True)
    assert out.tokens_reused == 96 and out.logits.shape[0] == 1
    assert_same(out.logits, c2.engine.prefill(odd, all_logits=True).logits[96:])


# ------------------------------------------------------------------------------------------ refused, and unsafe


def _refused(kernel, consumer, ids):
    c = connector(kernel, consumer)
    out = c.run(c.request(ids, tenant="t"), all_logits=True)
    assert out.tokens_reused == 0 and out.plan.action != PlanAction.MATERIALIZE, out.plan.reasons
    return c, out


@pytest.mark.parametrize(("label", "other"), [
    ("other weights (seed 1)", dict(seed=1)),
    ("another adapter", dict(adapter="support-lora")),
])  # fmt: skip
@pytest.mark.parametrize("kind", ["dense", "latent", "recurrent"])
def test_other_weights_or_adapter_are_refused_and_would_differ(kernel, kind, label, other):
    producer, consumer = model(kind), model(kind, **other)
    assert producer.identity != consumer.identity
    ids = tokens(100)
    warm(kernel, producer, ids)
    c, out = _refused(kernel, consumer, ids)
    assert_same(out.logits, c.engine.prefill(ids, all_logits=True).logits)  # recomputed: correct
    forced = forced_cache(kernel, producer, connector(kernel, producer).request(ids, tenant="t"), 4)
    got = c.engine.prefill(ids, cache=forced, start=64, all_logits=True)
    assert_differs(got.logits, c.engine.prefill(ids, all_logits=True).logits[64:])


def test_another_dtype_is_refused_and_would_differ(kernel):
    producer, consumer = model("dense"), model("dense", dtype=torch.bfloat16)
    ids = tokens(100)
    warm(kernel, producer, ids)
    c, _ = _refused(kernel, consumer, ids)
    forced = forced_cache(kernel, producer, connector(kernel, producer).request(ids, tenant="t"), 4)
    for layer in forced.layers:
        layer.keys, layer.values = layer.keys.to(torch.bfloat16), layer.values.to(torch.bfloat16)
    got = c.engine.prefill(ids, cache=forced, start=64, all_logits=True)
    assert_differs(got.logits, c.engine.prefill(ids, all_logits=True).logits[64:])


def test_another_tenant_is_refused(kernel):
    """Tenant isolation protects confidentiality, not the answer: a forced restore of another tenant's state for the
    same tokens on the same model gives the same logits. What the refusal prevents is one tenant learning (by
    timing) what another has sent; so the check here is that the kernel never plans it, for any prefix.
    """
    ref = model("dense")
    ids = tokens(100)
    warm(kernel, ref, ids, tenant="acme")
    c = connector(kernel, ref, commit=False)
    for n in (17, 64, 100):
        req = c.request(ids[:n], tenant="globex")
        assert kernel.match(req).tokens() == 0
        out = c.run(req)
        assert out.tokens_reused == 0 and out.plan.action != PlanAction.MATERIALIZE
    same = c.run(c.request(ids, tenant="acme"))
    assert same.tokens_reused == 96  # while the owner reuses it


@pytest.mark.parametrize("kind", ["windowed", "recurrent", "hybrid"])
def test_checkpointed_state_only_restores_at_checkpoints(kernel, kind):
    ref = model(kind)
    base = tokens(100)
    warm(kernel, ref, base, checkpoint_every=4)  # checkpoints at 64 and 96 only
    ids = base[:80] + tokens(20, seed=9)  # 5 blocks shared: no checkpoint at 80
    c = connector(kernel, ref)
    req = c.request(ids, tenant="t")
    out = c.run(req, all_logits=True)
    assert out.tokens_reused == 64, out.plan.reasons  # the nearest earlier checkpoint, never 80
    full = c.engine.prefill(ids, all_logits=True).logits
    assert_same(out.logits, full[64:])
    forced = forced_cache(kernel, ref, req, 4)  # the state at 64 ...
    got = c.engine.prefill(ids, cache=forced, start=80, all_logits=True)  # ... used as if it were the state at 80
    assert_differs(got.logits, full[80:])


@pytest.mark.parametrize("kind", KINDS)
def test_corrupt_payload_is_quarantined_and_would_differ(kernel, kind):
    ref = model(kind)
    ids = tokens(100)
    c = warm(kernel, ref, ids)
    req = c.request(ids, tenant="t")
    keys = kernel.keys(req)
    group = len(ref.groups) - 1
    blk = 5 if ref.groups[group][0].kind.checkpointed else 2
    slot = slot_of(keys[blk], group)
    store = kernel.tiers["dram"]
    data, desc, prio, seq = store._items[slot]  # fault injection: one bit, the sign of the largest value of the
    flipped = bytearray(data)  # last tensor (a recurrent layer's conv state drops its oldest column next token)
    last = desc.tensors[-1]
    n = int(torch.tensor(last.shape).prod())
    values = torch.frombuffer(flipped, dtype=torch.float32)[-n:]
    flipped[(len(flipped) // 4 - n + int(values.abs().argmax())) * 4 + 3] ^= 0x80
    store._items[slot] = (bytes(flipped), desc, prio, seq)
    forced = forced_cache(kernel, ref, req, blk + 1)  # decoded without the checksum
    full = c.engine.prefill(ids, all_logits=True).logits
    got = c.engine.prefill(ids, cache=forced, start=(blk + 1) * PAGE, all_logits=True)
    assert_differs(got.logits, full[(blk + 1) * PAGE :])
    out = c.run(req, all_logits=True)  # the kernel verifies, quarantines, and the connector recomputes
    assert out.tokens_reused < (blk + 1) * PAGE
    assert_same(out.logits, full[out.tokens_reused :])
    assert kernel.flush(10)  # the recompute committed the block again: the good bytes, never the flipped ones
    assert bytes(kernel.load(keys[blk], group).payload) == data


def test_foreign_tensors_are_refused_before_mounting(kernel):
    """A payload whose tensor specs are not this model's (here: a latent model's pages under a dense model's keys)
    is refused by the connector even when its checksum is right."""
    from nexuskv_transformers.state import StateMismatch

    dense, latent = model("dense"), model("latent")
    ids = tokens(64)
    warm(kernel, latent, ids)
    c = connector(kernel, latent)
    req = c.request(ids, tenant="t")
    keys = kernel.keys(req)
    states = {(b, 0): (kernel.load(keys[b]).payload, kernel.load(keys[b]).descriptor) for b in range(2)}
    with pytest.raises(StateMismatch, match="not this model"):
        connector(kernel, dense).codec.restore(states, 2)


def test_a_second_kernel_with_another_secret_shares_nothing():
    ref = model("dense")
    ids = tokens(100)
    with Kernel(KernelConfig(node="n1"), secret=SECRET) as a, Kernel(KernelConfig(node="n1"), secret=bytes(32)) as b:
        warm(a, ref, ids)
        assert a.keys(connector(a, ref).request(ids, tenant="t")) != b.keys(connector(b, ref).request(ids, tenant="t"))
