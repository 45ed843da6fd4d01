"""The cluster index's server-side scripts: every write is fenced by the writer's identity, in one atomic step.

A node's identity in the index is `ident` = "<epoch>:<token>": its fencing epoch (from the control plane) and a
random token of this registration. Keys, for node N under prefix P:

- `P idx:alive:N` = ident, expiring with the node's lease (renewed from its heartbeat);
- `P idx:fence:N` = the highest epoch ever registered for N (never expires: a stale writer stays refused);
- `P idx:held:N`  = hash: field key(16 bytes) + tier name -> group mask; what N holds now;
- `P idx:seq:N`   = the number of N's last event;
- `P idx:events:N` = stream of N's events, entry id `0-<seq>`, fields `seq`, `ident`, then one pair per
  operation: `<n>:S|R:<mask>:<tier>` -> the concatenated 16-byte keys (S: stored, R: removed; n numbers them);
- `P idx:nodes`    = set of every node that ever registered.

`REGISTER` accepts only an epoch above the fence, so a node that was fenced out (its lease expired and it
rejoined, or another process took its name) can never write again with the old epoch: `PUBLISH`, `RENEW` and
`RESET` (the live registration starting over, same epoch, new token) compare the stored ident with the writer's
and refuse with `STALE` when they differ, server side.
"""

from __future__ import annotations

__all__ = ["PUBLISH", "REGISTER", "RENEW", "RESET", "keys_of"]


def keys_of(prefix: str, node: str) -> list[str]:
    """[alive, fence, held, seq, events, nodes] keys of `node`."""
    return [f"{prefix}idx:{part}:{node}" for part in ("alive", "fence", "held", "seq", "events")] + [
        f"{prefix}idx:nodes"
    ]


# ARGV: node, epoch, token, ttl_ms. A new registration starts an empty holding and a new stream.
REGISTER = """
local epoch = tonumber(ARGV[2])
local fence = tonumber(redis.call('GET', KEYS[2]) or '0')
if epoch <= fence then
  return redis.error_reply('STALE epoch ' .. ARGV[2] .. ' is not above the fence ' .. fence)
end
redis.call('SET', KEYS[2], ARGV[2])
local ident = ARGV[2] .. ':' .. ARGV[3]
redis.call('SET', KEYS[1], ident, 'PX', ARGV[4])
redis.call('DEL', KEYS[3], KEYS[5])
redis.call('SET', KEYS[4], '0', 'PX', ARGV[4])
redis.call('SADD', KEYS[6], ARGV[1])
return ident
"""

# ARGV: ident, new token, ttl_ms. The live registration starts over under the same epoch (a new token, an empty
# holding, a new stream): after a write whose outcome is unknown (a timeout), everything is published again.
RESET = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return redis.error_reply('STALE ident ' .. ARGV[1] .. ' is not the live registration')
end
local ident = string.match(ARGV[1], '^(%d+):') .. ':' .. ARGV[2]
redis.call('SET', KEYS[1], ident, 'PX', ARGV[3])
redis.call('DEL', KEYS[3], KEYS[5])
redis.call('SET', KEYS[4], '0', 'PX', ARGV[3])
return ident
"""

# ARGV: ident, ttl_ms. Extends the node's keys while its ident is the live one.
RENEW = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return redis.error_reply('STALE ident ' .. ARGV[1] .. ' is not the live registration')
end
for i = 1, 5 do
  if i ~= 2 then redis.call('PEXPIRE', KEYS[i], ARGV[2]) end
end
return 1
"""

# ARGV: ident, ttl_ms, maxlen, key length, then per operation: kind (S or R), tier, mask, concatenated keys.
PUBLISH = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return redis.error_reply('STALE ident ' .. ARGV[1] .. ' is not the live registration')
end
local klen = tonumber(ARGV[4])
local seq = redis.call('INCR', KEYS[4])
local entry = {'seq', tostring(seq), 'ident', ARGV[1]}
for i = 5, #ARGV, 4 do
  local kind, tier, mask, blob = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2]), ARGV[i + 3]
  for j = 1, #blob, klen do
    local field = string.sub(blob, j, j + klen - 1) .. tier
    local cur = tonumber(redis.call('HGET', KEYS[3], field) or '0')
    local new
    if kind == 'S' then new = bit.bor(cur, mask) else new = bit.band(cur, bit.bnot(mask)) end
    if new == 0 then redis.call('HDEL', KEYS[3], field) else redis.call('HSET', KEYS[3], field, new) end
  end
  entry[#entry + 1] = tostring((i - 1) / 4) .. ':' .. kind .. ':' .. ARGV[i + 2] .. ':' .. tier
  entry[#entry + 1] = blob
end
redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[3], '0-' .. seq, unpack(entry))
for i = 3, 5 do redis.call('PEXPIRE', KEYS[i], ARGV[2]) end
return seq
"""
