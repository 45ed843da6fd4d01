"""Nanosecond timestamps and durations on top of Python's microsecond `datetime` and `timedelta`.

CEL's timestamps and durations count nanoseconds. A value whose nanoseconds are a whole number of
microseconds is a plain `datetime` (aware, UTC) or `timedelta`, as policies and plugins pass them; a finer
one is a `NanoTimestamp` / `NanoDuration`: the value floored to the microsecond plus `ns` (1..999) more
nanoseconds, which compare, hash, print, pickle and copy by their full value and keep their nanoseconds
through `+` and `-` with other timestamps and durations, except a plain `datetime + NanoDuration`, which
Python's datetime computes (other operations, such as `replace` or `astimezone`, act on the microsecond
part and give `ns == 0`). `ts_ns` / `dur_ns` give any value as integer nanoseconds (since the epoch / in
total), `make_ts` / `make_dur` build the right class back.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

__all__ = ["EPOCH", "NanoDuration", "NanoTimestamp", "dur_ns", "frac_digits", "make_dur", "make_ts", "ts_ns"]

EPOCH = _dt.datetime(1970, 1, 1, tzinfo=_dt.UTC)


def _td_us(d: _dt.timedelta) -> int:
    return (d.days * 86400 + d.seconds) * 1_000_000 + d.microseconds


def ts_ns(t: _dt.datetime) -> int:
    """A timestamp as nanoseconds since the Unix epoch."""
    return _td_us(_dt.datetime.__sub__(t, EPOCH)) * 1000 + getattr(t, "ns", 0)  # the plain (microsecond) part


def dur_ns(d: _dt.timedelta) -> int:
    """A duration in nanoseconds."""
    return _td_us(d) * 1000 + getattr(d, "ns", 0)


class _Nanos:
    """Comparison and hashing by the full nanosecond value (mixed into the two classes below)."""

    __slots__ = ()

    def _key(self) -> int:
        raise NotImplementedError

    @staticmethod
    def _other(other: Any) -> int | None:
        if isinstance(other, _dt.datetime):
            return ts_ns(other) if other.tzinfo is not None else None
        if isinstance(other, _dt.timedelta):
            return dur_ns(other)
        return None

    def _cmp(self, other: Any, op: Any) -> Any:
        o = self._other(other)
        if o is None or isinstance(other, _dt.datetime) != isinstance(self, _dt.datetime):
            return NotImplemented
        return op(self._key(), o)

    def __eq__(self, other: object) -> bool:
        """Equal when the nanosecond values are."""
        r = self._cmp(other, int.__eq__)
        return False if r is NotImplemented else r

    def __ne__(self, other: object) -> bool:
        """Not equal."""
        return not self.__eq__(other)

    def __lt__(self, other: Any) -> Any:
        """Earlier / shorter."""
        return self._cmp(other, int.__lt__)

    def __le__(self, other: Any) -> Any:
        """Not later."""
        return self._cmp(other, int.__le__)

    def __gt__(self, other: Any) -> Any:
        """Later / longer."""
        return self._cmp(other, int.__gt__)

    def __ge__(self, other: Any) -> Any:
        """Not earlier."""
        return self._cmp(other, int.__ge__)

    def __hash__(self) -> int:
        """The plain value's hash when ns is 0 (then the two are equal), else the hash of the nanoseconds."""
        if not getattr(self, "ns", 0):
            return _dt.datetime.__hash__(self) if isinstance(self, _dt.datetime) else _dt.timedelta.__hash__(self)
        return hash(self._key())


class NanoTimestamp(_Nanos, _dt.datetime):
    """A UTC timestamp with nanoseconds: the datetime floored to the microsecond, plus `ns` nanoseconds."""

    ns = 0

    def _key(self) -> int:
        return ts_ns(self)

    def __repr__(self) -> str:
        """The datetime's repr with the extra nanoseconds."""
        return f"{_dt.datetime.__repr__(self)[:-1]}, ns={self.ns})"

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickle and copy by the full value."""
        return make_ts, (ts_ns(self),)

    def __add__(self, other: Any) -> Any:
        """Timestamp + duration, to the nanosecond."""
        if isinstance(other, _dt.timedelta):
            return make_ts(ts_ns(self) + dur_ns(other))
        return NotImplemented

    __radd__ = __add__

    def __sub__(self, other: Any) -> Any:
        """Timestamp - timestamp (a duration) or - duration (a timestamp), to the nanosecond."""
        if isinstance(other, _dt.datetime):
            return make_dur(ts_ns(self) - ts_ns(other))
        if isinstance(other, _dt.timedelta):
            return make_ts(ts_ns(self) - dur_ns(other))
        return NotImplemented

    def __rsub__(self, other: Any) -> Any:
        """Plain timestamp - this one."""
        if isinstance(other, _dt.datetime):
            return make_dur(ts_ns(other) - ts_ns(self))
        return NotImplemented


class NanoDuration(_Nanos, _dt.timedelta):
    """A duration with nanoseconds: the timedelta floored to the microsecond, plus `ns` nanoseconds."""

    ns = 0

    def _key(self) -> int:
        return dur_ns(self)

    def __repr__(self) -> str:
        """The timedelta's repr with the extra nanoseconds."""
        return f"{_dt.timedelta.__repr__(self)[:-1]}, ns={self.ns})"

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickle and copy by the full value."""
        return make_dur, (dur_ns(self),)

    def __add__(self, other: Any) -> Any:
        """Duration + duration (or + timestamp), to the nanosecond."""
        if isinstance(other, _dt.datetime):
            return make_ts(ts_ns(other) + dur_ns(self))
        if isinstance(other, _dt.timedelta):
            return make_dur(dur_ns(self) + dur_ns(other))
        return NotImplemented

    __radd__ = __add__

    def __sub__(self, other: Any) -> Any:
        """Duration - duration, to the nanosecond."""
        if isinstance(other, _dt.timedelta):
            return make_dur(dur_ns(self) - dur_ns(other))
        return NotImplemented

    def __rsub__(self, other: Any) -> Any:
        """Timestamp or plain duration - this one."""
        if isinstance(other, _dt.datetime):
            return make_ts(ts_ns(other) - dur_ns(self))
        if isinstance(other, _dt.timedelta):
            return make_dur(dur_ns(other) - dur_ns(self))
        return NotImplemented

    def __neg__(self) -> _dt.timedelta:
        """-duration, to the nanosecond."""
        return make_dur(-dur_ns(self))


def make_ts(ns: int) -> _dt.datetime:
    """The timestamp `ns` nanoseconds after the epoch (OverflowError outside Python's years 1 to 9999)."""
    us, rest = divmod(ns, 1000)
    base = EPOCH + _dt.timedelta(microseconds=us)
    if not rest:
        return base
    t = NanoTimestamp(base.year, base.month, base.day, base.hour, base.minute, base.second, base.microsecond,
                      tzinfo=_dt.UTC)  # fmt: skip
    t.ns = rest
    return t


def make_dur(ns: int) -> _dt.timedelta:
    """The duration of `ns` nanoseconds."""
    us, rest = divmod(ns, 1000)
    if not rest:
        return _dt.timedelta(microseconds=us)
    d = NanoDuration(microseconds=us)
    d.ns = rest
    return d


def frac_digits(ns: int) -> str:
    """The fraction of a second in `ns` (0..999999999) with the fewest digits: "" , "5", "000001"..."""
    return f"{ns:09d}".rstrip("0")

