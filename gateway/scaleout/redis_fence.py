"""Fencing (``--broker``): every write to a listed stream's Redis key carries its owner's epoch, and Redis
refuses the write of a stale owner (one function each: compare, then write; no interleaving is possible).

Each ownership of a stream has an epoch in ``tokenfan:{<id>}:e``: 1 for the gateway that created it, one more
for each gateway that adopted it (:func:`take`, which succeeds for exactly one adopter of a given epoch). A
gateway cut off from Redis while another adopts its stream finds, once it can write again, that its epoch
is gone: :func:`append` answers :data:`FENCED` and writes nothing, so its late events never land beside the
adopter's (the Redlock critique: a lock without a fencing token checked by the store is not safe).

Every append also names where it continues the log (``after``: the events the log must hold before it), and
Redis refuses an append to a log that holds another count (:data:`ELSEWHERE`, with the count): a store that
lost its last records (a replica promoted while behind, a restart) is never appended to across the hole, and
never past what it already holds twice; the owner first writes back what the store lacks
(:meth:`gateway.scaleout.broker.Broker` repairs it from its log).

Redis runs each script atomically; its KEYS are one stream's, in one hash slot (a Redis Cluster runs it). A Redis that restarts without persistence loses the epochs with the
streams: then the owner writes its stream anew (``create``), which sets the epoch it holds only if the key
holds none; :func:`Fence.take` never takes a missing epoch, so no adopter claims a stream whose ownership
record is gone (docs/failures.md: the rule that keeps two owners apart).
"""

from __future__ import annotations

from typing import Any

from gateway.scaleout import broker_codec as codec
from gateway.scaleout.redis_support import KNOWN_TTL_S

OK, GONE, FENCED, NO_EPOCH, ELSEWHERE = 1, 0, -1, -2, -3
SCAN = 16  # entries a script reads back from the end of a log for its last event (headers skipped)

# The events a log holds: its last event's seq + 1, reading back over headers (an adopter's follows the events
# it adopted) and records that are not ours; -1 once it holds an end. (The same rule in Python: :func:`gateway.scaleout.broker_codec.held`.)
_HELD = """
local function held(key)
  for _, count in ipairs({1, SCAN}) do
    local entries = redis.call('XREVRANGE', key, '+', '-', 'COUNT', count)
    for _, entry in ipairs(entries) do
      local f = entry[2]
      for j = 1, #f, 2 do
        if f[j] == 'seq' and tonumber(f[j + 1]) then return tonumber(f[j + 1]) + 1 end
        if f[j] == 'end' then return -1 end
      end
    end
    if #entries < count then return 0 end
  end
  return 0
end
""".replace("SCAN", str(SCAN))

# KEYS: stream, epoch, known. ARGV: epoch, expire seconds (0: none), create (1: the key may be made anew,
# and a missing epoch set), after (the events the log must hold before these records; '': not checked), then
# each record: its field count n, then n field/value pairs.
# Returns {status, current epoch, events held}: OK; GONE (the stream key is missing and create is 0; nothing
# written); FENCED (another epoch owns it; nothing written); NO_EPOCH (the epoch is missing and create is 0);
# ELSEWHERE (the log holds another count of events than ``after``, or its end: nothing written).
APPEND = _HELD + """
local cur = redis.call('GET', KEYS[2])
local create = ARGV[3] == '1'
if cur then
  if cur ~= ARGV[1] then return {-1, cur, 0} end
elseif not create then
  return {-2, '', 0}
end
if ARGV[4] ~= '' then
  local have = held(KEYS[1])
  if have ~= tonumber(ARGV[4]) then return {-3, cur or '', have} end
end
if not cur then
  redis.call('SET', KEYS[2], ARGV[1], 'EX', KNOWN_TTL)
end
local i = 5
while i <= #ARGV do
  local n = tonumber(ARGV[i])
  local args = {}
  for j = 1, 2 * n do args[j] = ARGV[i + j] end
  i = i + 2 * n + 1
  local id
  if create then
    id = redis.call('XADD', KEYS[1], '*', unpack(args))
  else
    id = redis.call('XADD', KEYS[1], 'NOMKSTREAM', '*', unpack(args))
  end
  if not id then return {0, cur or '', 0} end
end
local ttl = tonumber(ARGV[2])
if ttl > 0 then
  redis.call('EXPIRE', KEYS[1], ttl)
  redis.call('EXPIRE', KEYS[2], ttl)
  redis.call('SET', KEYS[3], '1', 'EX', KNOWN_TTL)
elseif create then
  redis.call('EXPIRE', KEYS[1], KNOWN_TTL)
  redis.call('SET', KEYS[3], '1', 'EX', KNOWN_TTL)
end
return {1, ARGV[1], 0}
""".replace("KNOWN_TTL", str(KNOWN_TTL_S))

# KEYS: epoch. ARGV: the epoch taken over. Returns the next epoch (this caller's), or false if the stream has
# another epoch already (another gateway took it over first) or none.
TAKE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return false end
return redis.call('INCR', KEYS[1])
"""

# KEYS: epoch, key. ARGV: epoch, value, px. Sets key only while epoch is the caller's (a transcript).
SET_IF = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
return 1
"""


epoch_key = codec.epoch_key

class Fence:
    """The three scripts, registered once on one client (redis-py loads them again after a Redis restart)."""

    def __init__(self, redis: Any) -> None:
        self._append = redis.register_script(APPEND)
        self._take = redis.register_script(TAKE)
        self._set_if = redis.register_script(SET_IF)

    def append(self, pipe: Any, stream_id: str, epoch: int, records: list[codec.Fields], *, expire_s: int = 0,
               create: bool = False, after: int | None = None) -> None:
        """Queue on ``pipe`` the fenced append of ``records``, continuing a log of ``after`` events (None: not
        checked); its reply is ``[status, current epoch, events held]`` (:func:`status`)."""
        args: list[Any] = [epoch, expire_s, 1 if create else 0, "" if after is None else after]
        for fields in records:
            args.append(len(fields))
            for k, v in fields.items():
                args += (k, v)
        # queued like any pipelined command, by its SHA: not registered on the pipeline, which would ask Redis
        # SCRIPT EXISTS before every execute (a round trip per flush); :meth:`load` after NOSCRIPT. Through
        # execute_command: redis-py's cluster pipeline refuses pipe.evalsha, though it routes EVALSHA by its keys
        pipe.execute_command("EVALSHA", self._append.sha, 3, codec.stream_key(stream_id), epoch_key(stream_id),
                             codec.known_key(stream_id), *args)

    async def load(self, redis: Any) -> None:
        """Load the scripts into Redis (at start, and after a NOSCRIPT: a restarted Redis has none)."""
        for script in (self._append, self._take, self._set_if):
            script.sha = await redis.script_load(script.script)

    async def take(self, redis: Any, stream_id: str, epoch: int) -> int | None:
        """Take the stream over from the owner of ``epoch``: the new epoch, or None if another did first."""
        got = await self._take(keys=[epoch_key(stream_id)], args=[epoch], client=redis)
        return None if got is None else int(got)

    async def set_if(self, redis: Any, stream_id: str, epoch: int, key: str, value: bytes, px: int) -> bool:
        """SET ``key`` (PX ``px``) only while ``epoch`` owns the stream."""
        return bool(await self._set_if(keys=[epoch_key(stream_id), key], args=[epoch, value, px], client=redis))


def status(reply: Any) -> tuple[int, int]:
    """(status, current epoch; 0 if none) of an :data:`APPEND` reply."""
    st, cur = reply[0], reply[1]
    return int(st), int(cur) if cur else 0


def held(reply: Any) -> int:
    """The events the log held, by an :data:`APPEND` reply of :data:`ELSEWHERE` (-1: it holds its end)."""
    return int(reply[2])
