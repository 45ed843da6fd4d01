"""nexuskv-sim: a discrete-event cluster simulator (simpy) for judging KV-cache routing and loading strategies.

The ground truth shares nothing with NexusKV's cost model: its own hardware profile, its own timing. See the
package README for the model, its assumptions and the baselines.
"""

from nexuskv_sim.api import BaseStrategy, ClusterView, Decision, Fetch, NodeLoad, Prefetch, SimRequest, Strategy
from nexuskv_sim.metrics import SimResult, summary
from nexuskv_sim.pd import PDResult, PDWorld, Pools, pd_summary, simulate_pd
from nexuskv_sim.profile import Profile, default_profile, load_profile
from nexuskv_sim.routers_sched import STRATEGIES, make_strategy
from nexuskv_sim.simulate import plot_ttft, simulate
from nexuskv_sim.tiers import BlockMeta, BlockTier, LRUTier, block_keys
from nexuskv_sim.trace import TraceRecord, generate, generate_mixed, read_trace, write_trace

__all__ = [
    "STRATEGIES",
    "BaseStrategy",
    "BlockMeta",
    "BlockTier",
    "ClusterView",
    "Decision",
    "Fetch",
    "LRUTier",
    "NodeLoad",
    "PDResult",
    "PDWorld",
    "Pools",
    "Prefetch",
    "Profile",
    "SimRequest",
    "SimResult",
    "Strategy",
    "TraceRecord",
    "block_keys",
    "default_profile",
    "generate",
    "generate_mixed",
    "load_profile",
    "make_strategy",
    "pd_summary",
    "plot_ttft",
    "read_trace",
    "simulate",
    "simulate_pd",
    "summary",
    "write_trace",
]
