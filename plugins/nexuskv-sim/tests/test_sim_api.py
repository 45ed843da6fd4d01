from _sim_fakes import request

from nexuskv_sim.api import BaseStrategy, Decision, Fetch, SimRequest, Strategy


def test_request_block_arithmetic():
    r = SimRequest(0, 0.0, "m", "t", 1100, 5, [4, 5, 6])
    assert r.blocks == 3 and r.hash_ids == (4, 5, 6)
    assert [r.tokens_of(n) for n in range(4)] == [0, 512, 1024, 1100]


def test_base_strategy_satisfies_the_protocol_with_noop_observers():
    class Mine(BaseStrategy):
        name = "mine"

        def decide(self, req, view):
            return Decision("n0", [Fetch("n0", "hbm", 0, 1)])

    s = Mine()
    assert isinstance(s, Strategy)
    d = s.decide(request(0, [1]), None)
    assert d.fetches == (Fetch("n0", "hbm", 0, 1),) and isinstance(d.fetches, tuple)
    assert s.observe_transfer("nic", 1, 1.0) is None and s.observe_done(request(0, [1]), "n0", 1.0) is None
