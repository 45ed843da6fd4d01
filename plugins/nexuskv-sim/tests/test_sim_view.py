from _sim_fakes import request, tiny_profile

from nexuskv_sim.api import BaseStrategy, Decision
from nexuskv_sim.world import World


class Probe(BaseStrategy):
    name = "probe"

    def __init__(self):
        self.seen = []

    def decide(self, req, view):
        load = view.loads()["n0"]
        self.seen.append((req.rid, view.now, view.prefix_blocks("n0", "hbm", req), view.holdings("n0", req),
                          load.waiting_requests, load.at_ms))
        return Decision("n0")


def run(delay):
    reqs = [request(0, [1, 2]), request(1, [1, 2], at=30.0), request(2, [1, 2], at=100.0)]
    probe = Probe()
    World(reqs, probe, node_model={"n0": "m"}, node_host={"n0": "h0"}, profile=tiny_profile(),
          report_delay_ms=delay).run()
    return {rid: rest for rid, *rest in probe.seen}


def test_holdings_and_loads_show_after_the_report_delay():
    # request 0 prefills 0 -> 11.24 ms; request 1 arrives at 30 ms, request 2 at 100 ms
    delayed = run(50.0)
    assert delayed[1][1] == 0 and delayed[1][2] == (0, 0, 0)  # 30 - 50 < 0: nothing known yet
    assert delayed[2][1] == 2 and delayed[2][2] == (2, 2, 2)  # 100 - 50 = 50 > 11.24
    assert delayed[1][3] == 0 and delayed[1][4] == -1.0  # no report yet: dated before time 0
    exact = run(0.0)
    assert exact[1][1] == 2 and exact[1][2] == (2, 2, 2)


def test_loads_report_waiting_requests_as_of_the_cutoff():
    reqs = [request(0, [1] * 1, tokens=512), request(1, [5, 6, 7, 8], tokens=2048, at=1.0),
            request(2, [9], at=2.0)]
    probe = Probe()
    World(reqs, probe, node_model={"n0": "m"}, node_host={"n0": "h0"}, profile=tiny_profile(),
          report_delay_ms=0.0).run()
    waiting = {rid: w for rid, _, _, _, w, _ in probe.seen}
    assert waiting == {0: 0, 1: 1, 2: 2}
