from nexuskv import Transport
from nexuskv.builtins.dram import DramStore
from nexuskv.builtins.local import LocalTransport
from tests.contracts.test_contracts import next_descriptor


def test_local_transport_reads_in_process_without_copy():
    store = DramStore(100)
    store.put(b"k" * 17, b"payload", next_descriptor())
    t = LocalTransport()
    assert isinstance(t, Transport)
    got = t.fetch(store, b"k" * 17)
    assert isinstance(got.payload, memoryview) and bytes(got.payload) == b"payload"
    assert t.fetch(store, b"z" * 17) is None
    t.close()
