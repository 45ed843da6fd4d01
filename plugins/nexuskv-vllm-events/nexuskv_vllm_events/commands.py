"""`nexuskv kv-events`: print an engine's KV event stream as JSON lines, with gaps and restarts marked.

An operator's check before pointing a router at a stream: is it reachable, in vLLM's format, gap-free?
"""

from __future__ import annotations

import json
import time

import click

__all__ = ["kv_events_command"]


def _describe(event: object) -> dict[str, object]:
    from nexuskv_vllm_events.wire import AllBlocksCleared, BlockStored

    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    out: dict[str, object] = {"type": type(event).__name__, "blocks": len(event.block_hashes),  # type: ignore[attr-defined]
                              "medium": event.medium, "group": event.group_idx}  # type: ignore[attr-defined]
    if isinstance(event, BlockStored):
        out["root"] = event.parent_block_hash is None
        out["lora"] = event.lora_name
    return out


@click.command("kv-events")
@click.option("--endpoint", required=True, help="The engine's PUB address (vLLM's kv_events_config endpoint).")
@click.option("--topic", default="", show_default=True)
@click.option("--bind", is_flag=True, help="Bind the address (for a publisher that connects).")
@click.option("--allow-remote", is_flag=True, help="Allow a non-loopback TCP address (the stream is unauthenticated).")
@click.option("--count", default=0, show_default=True, help="Stop after this many batches (0: no limit).")
@click.option("--seconds", default=0.0, show_default=True, help="Stop after this long (0: no limit).")
def kv_events_command(endpoint: str, topic: str, bind: bool, allow_remote: bool, count: int, seconds: float) -> None:
    """Print each batch of a vLLM engine's KV event stream: sequence, position (next/gap/restart), events."""
    import zmq

    from nexuskv_vllm_events.ordering import Ordering
    from nexuskv_vllm_events.subscriber import check_endpoint
    from nexuskv_vllm_events.wire import WireError, decode, seq_of

    check_endpoint(endpoint, allow_remote=allow_remote)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.MAXMSGSIZE, 8 << 20)
    sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
    (sub.bind if bind else sub.connect)(endpoint)
    order, seen = Ordering(), 0
    end = time.monotonic() + seconds if seconds else None
    try:
        while (not count or seen < count) and (end is None or time.monotonic() < end):
            if not sub.poll(100):
                continue
            frames = sub.recv_multipart()
            line: dict[str, object] = {}
            try:
                if len(frames) != 3 or frames[0] != topic.encode():
                    raise WireError(f"{len(frames)} frames on topic {frames[0][:64]!r}")
                seq = seq_of(frames[1])
                line = {"seq": seq, "position": str(order.classify(seq, frames[2]))}
                order.applied(seq, frames[2])
                line["events"] = [_describe(e) for e in decode(frames[2]).events]
            except WireError as exc:
                line["error"] = str(exc)
            click.echo(json.dumps(line))
            seen += 1
    finally:
        sub.close(0)
