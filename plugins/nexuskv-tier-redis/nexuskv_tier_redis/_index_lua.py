"""The cluster index's server-side scripts: every write is fenced by the writer's identity, in one atomic step.

A node's identity in the index is `ident` = "<epoch>:<token>": its fencing epoch (from the control plane) and a
random token of this registration. A deployment splits every node's holding and event stream into `S` shards by
block key (`shard_of`; S = 1 by default). Keys, for node N under prefix P:

- `P idx:alive:N` = ident, expiring with the node's lease (renewed from its heartbeat);
- `P idx:fence:N` = the highest epoch ever registered for N (never expires: a stale writer stays refused);
- `P idx:nodes`   = set of every node that ever registered;
- `P idx:shards`  = the deployment's shard count S, set by the first registration and kept while any node's
  lease lives (every renewal extends it to at least that lease): a node configured with another count is
  refused (its keys would land in shards nobody follows) until every node of the old count is gone;
- per shard s (the names without `#s` when S = 1, as before shards existed):
  - `P idx:held:N#s`   = hash: field key(16 bytes) + tier name -> group mask; what N holds now in shard s;
  - `P idx:seq:N#s`    = the number of N's last event in shard s;
  - `P idx:events:N#s` = stream of N's events in shard s, entry id `0-<seq>`, fields `seq`, `ident`, then one
    pair per operation: `<n>:S|R:<mask>:<tier>` -> the concatenated 16-byte keys (S: stored, R: removed).

`REGISTER` accepts only an epoch above the fence, so a node that was fenced out (its lease expired and it
rejoined, or another process took its name) can never write again with the old epoch: `PUBLISH`, `RENEW` and
`RESET` (the live registration starting over, same epoch, new token) compare the stored ident with the writer's
and refuse with `STALE` when they differ, server side. Every shard's `PUBLISH` checks the one `alive` key, so
a fenced writer is refused in every shard at once. The scripts touch keys of several shards, so they run on one
Redis (or one Redis Cluster hash slot), not across slots.
"""

from __future__ import annotations

__all__ = ["MAX_SHARDS", "PUBLISH", "REGISTER", "RENEW", "RESET", "node_keys", "shard_keys", "shard_of"]

MAX_SHARDS = 1024


def shard_of(key: bytes, shards: int) -> int:
    """The shard of a block key: its first 8 bytes mod `shards` (keys are keyed MACs, so shards are uniform)."""
    return int.from_bytes(key[:8], "big") % shards if shards > 1 else 0


def node_keys(prefix: str, node: str) -> list[str]:
    """[alive, fence, nodes, shards] keys of `node`: one per node, whatever the shard count."""
    return [f"{prefix}idx:alive:{node}", f"{prefix}idx:fence:{node}", f"{prefix}idx:nodes", f"{prefix}idx:shards"]


def shard_keys(prefix: str, node: str, shard: int = 0, shards: int = 1) -> list[str]:
    """[held, seq, events] keys of `node`'s shard `shard` (of `shards`)."""
    tag = f"#{shard}" if shards > 1 else ""
    return [f"{prefix}idx:{part}:{node}{tag}" for part in ("held", "seq", "events")]


def all_keys(prefix: str, node: str, shards: int) -> list[str]:
    """`node_keys` then every shard's `shard_keys`: the KEYS of REGISTER, RESET and RENEW."""
    out = node_keys(prefix, node)
    for s in range(shards):
        out += shard_keys(prefix, node, s, shards)
    return out


# KEYS: all_keys. ARGV: node, epoch, token, ttl_ms, shards. A new registration starts empty holdings and streams.
REGISTER = """
local epoch = tonumber(ARGV[2])
local fence = tonumber(redis.call('GET', KEYS[2]) or '0')
if epoch <= fence then
  return redis.error_reply('STALE epoch ' .. ARGV[2] .. ' is not above the fence ' .. fence)
end
local shards = redis.call('GET', KEYS[4])
if shards and shards ~= ARGV[5] then
  return redis.error_reply('SHARDS this deployment has ' .. shards .. ' shards, this node ' .. ARGV[5])
end
if not shards or redis.call('PTTL', KEYS[4]) < tonumber(ARGV[4]) then
  redis.call('SET', KEYS[4], ARGV[5], 'PX', ARGV[4])
end
redis.call('SET', KEYS[2], ARGV[2])
local ident = ARGV[2] .. ':' .. ARGV[3]
redis.call('SET', KEYS[1], ident, 'PX', ARGV[4])
for i = 5, #KEYS, 3 do
  redis.call('DEL', KEYS[i], KEYS[i + 2])
  redis.call('SET', KEYS[i + 1], '0', 'PX', ARGV[4])
end
redis.call('SADD', KEYS[3], ARGV[1])
return ident
"""

# KEYS: all_keys. ARGV: ident, new token, ttl_ms. The live registration starts over under the same epoch (a new
# token, empty holdings, new streams): after a write whose outcome is unknown (a timeout), everything is published
# again.
RESET = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return redis.error_reply('STALE ident ' .. ARGV[1] .. ' is not the live registration')
end
local ident = string.match(ARGV[1], '^(%d+):') .. ':' .. ARGV[2]
redis.call('SET', KEYS[1], ident, 'PX', ARGV[3])
for i = 5, #KEYS, 3 do
  redis.call('DEL', KEYS[i], KEYS[i + 2])
  redis.call('SET', KEYS[i + 1], '0', 'PX', ARGV[3])
end
return ident
"""

# KEYS: all_keys. ARGV: ident, ttl_ms, shards. Extends the node's keys while its ident is the live one, and the
# deployment's shard count to at least this lease.
RENEW = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return redis.error_reply('STALE ident ' .. ARGV[1] .. ' is not the live registration')
end
local shards = redis.call('GET', KEYS[4])
if shards and shards ~= ARGV[3] then
  return redis.error_reply('SHARDS this deployment has ' .. shards .. ' shards, this node ' .. ARGV[3])
end
if not shards or redis.call('PTTL', KEYS[4]) < tonumber(ARGV[2]) then
  redis.call('SET', KEYS[4], ARGV[3], 'PX', ARGV[2])
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
for i = 5, #KEYS do redis.call('PEXPIRE', KEYS[i], ARGV[2]) end
return 1
"""

# KEYS: alive, then one shard's held, seq, events. ARGV: ident, ttl_ms, maxlen, key length, then per operation:
# kind (S or R), tier, mask, concatenated keys.
PUBLISH = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return redis.error_reply('STALE ident ' .. ARGV[1] .. ' is not the live registration')
end
local klen = tonumber(ARGV[4])
local seq = redis.call('INCR', KEYS[3])
local entry = {'seq', tostring(seq), 'ident', ARGV[1]}
for i = 5, #ARGV, 4 do
  local kind, tier, mask, blob = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2]), ARGV[i + 3]
  for j = 1, #blob, klen do
    local field = string.sub(blob, j, j + klen - 1) .. tier
    local cur = tonumber(redis.call('HGET', KEYS[2], field) or '0')
    local new
    if kind == 'S' then new = bit.bor(cur, mask) else new = bit.band(cur, bit.bnot(mask)) end
    if new == 0 then redis.call('HDEL', KEYS[2], field) else redis.call('HSET', KEYS[2], field, new) end
  end
  entry[#entry + 1] = tostring((i - 1) / 4) .. ':' .. kind .. ':' .. ARGV[i + 2] .. ':' .. tier
  entry[#entry + 1] = blob
end
redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[3], '0-' .. seq, unpack(entry))
for i = 2, 4 do redis.call('PEXPIRE', KEYS[i], ARGV[2]) end
return seq
"""
