"""State identity: keyed, chained block keys whose root mixes in every input that changes model state.

key_0 = BLAKE2b-128(key=deployment secret, person="nexuskv.root", msg=canonical identity)
key_i = BLAKE2b-128(key_(i-1) || uint32-LE token ids of block i || extra inputs of block i)

The root covers tenant scope, cache salt, model, tokenizer, layout and adapter identity, so two requests share
keys only when all of those are equal: isolation by construction. Every later key is prefixed by its parent, a
secret-derived 128-bit value; BLAKE2 has no length extension, so this prefix-keyed hash is a PRF of the parent
(and 30% faster in CPython than passing the parent as `key=`, which costs one more compression per block).
Only full blocks are keyed.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import struct
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import attrs

from nexuskv.contracts import ExtraInput, Layout, ModelIdentity, Namespace, Request, TokenizerIdentity, to_dict
from nexuskv.errors import ConfigError

__all__ = ["CHAIN_PERSON", "DIGEST_SIZE", "BlockKeyer", "KeyChain", "load_secret"]

DIGEST_SIZE = 16
SECRET_ENV = "NEXUSKV_SECRET"
SECRET_FILE_ENV = "NEXUSKV_SECRET_FILE"
_MIN_SECRET = 16
_ROOT_PERSON = b"nexuskv.root"
CHAIN_PERSON = b"nexuskv.block"
"""BLAKE2b personalisation of every chained block key (a native keyer must use the same)."""
_CHAIN = hashlib.blake2b(digest_size=DIGEST_SIZE, person=CHAIN_PERSON)
_ROOT_CACHE_SIZE = 4096


def default_secret_path() -> Path:
    """Where the generated secret is persisted: `$NEXUSKV_HOME` or `$XDG_STATE_HOME/nexuskv`, file `secret`."""
    home = os.environ.get("NEXUSKV_HOME")
    if home:
        return Path(home) / "secret"
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "nexuskv" / "secret"


def _parse_secret(text: str, origin: str) -> bytes:
    try:
        secret = bytes.fromhex(text.strip())
    except ValueError as exc:
        raise ConfigError(f"{origin}: the secret must be hex digits ({exc})") from None
    if len(secret) < _MIN_SECRET:
        raise ConfigError(f"{origin}: the secret must be at least {_MIN_SECRET} bytes, got {len(secret)}")
    return secret[:64]  # BLAKE2b keys are at most 64 bytes


def load_secret(value: str | None = None, path: str | os.PathLike[str] | None = None) -> bytes:
    """The per-deployment key secret.

    Order: an explicit hex `value` (from config), the `NEXUSKV_SECRET` environment variable (hex), then the
    file at `path`, `NEXUSKV_SECRET_FILE` or `default_secret_path()`; a missing file is created with 32 random
    bytes (mode 0600, written whole and then linked into place, so concurrent first starts agree on one
    secret and never read a half-written file).
    """
    if value:
        return _parse_secret(value, "config secret")
    env = os.environ.get(SECRET_ENV)
    if env:
        return _parse_secret(env, SECRET_ENV)
    p = Path(path or os.environ.get(SECRET_FILE_ENV) or default_secret_path())
    if not p.exists():
        _create_secret(p)
    try:
        text = p.read_text()
    except UnicodeDecodeError:
        raise ConfigError(f"{p}: the secret file is not text; it holds the secret as hex (at least 32 bytes: "
                          "`python3 -c 'import os; print(os.urandom(32).hex())' > FILE`)") from None
    return _parse_secret(text, str(p))


def _create_secret(p: Path) -> None:
    """Write a new random secret to `p` atomically: whole or not at all, mode 0600, in a 0700 directory.

    The secret is written and synced to a private temporary file, then hard-linked into place: a concurrent
    first start either wins the link or finds the winner's complete file (it never reads a half-written one).
    """
    if not p.parent.exists():
        p.parent.mkdir(parents=True, mode=0o700, exist_ok=True)
        os.chmod(p.parent, 0o700)  # mkdir's mode is masked by the umask
    fd, tmp = tempfile.mkstemp(prefix=".secret-", dir=p.parent)  # mkstemp creates it 0600
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(os.urandom(32).hex() + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        with contextlib.suppress(FileExistsError):  # another process won the race; its file is complete
            os.link(tmp, p)
    finally:
        os.unlink(tmp)


def _canonical(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


@functools.lru_cache(maxsize=256)
def _packer(n: int) -> struct.Struct:
    return struct.Struct(f"<{n}I")


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    """uint32 little-endian bytes of the token ids (struct packs a tuple about 2x faster than array)."""
    try:
        return _packer(len(token_ids)).pack(*token_ids)
    except struct.error as exc:
        raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from None


def keyed_layout(layout: Layout) -> Layout:
    """The layout as keys see it: MLA latent state is identical on every TP rank, so it is stored once (rank 0 of 1)."""
    if layout.kind == "latent" and (layout.tp_rank, layout.tp_size) != (0, 1):
        return attrs.evolve(layout, tp_rank=0, tp_size=1)
    return layout


class BlockKeyer:
    """Computes root and block keys for one deployment secret and page size (the pure-Python reference).

    A native keyer (`nexuskv_keyer` hook) subclasses it and overrides `_blocks`, the one hashing primitive;
    every other method, and so every key, stays the same.
    """

    __slots__ = ("_roots", "_secret", "page_size")

    name = "python"
    deadline_chunk = 16
    """Blocks hashed between two deadline checks (about 15 us of hashing here)."""

    def __init__(self, secret: bytes, page_size: int = 16) -> None:
        if len(secret) < _MIN_SECRET:
            raise ConfigError(f"the key secret must be at least {_MIN_SECRET} bytes, got {len(secret)}")
        if page_size < 1:
            raise ConfigError(f"page_size must be >= 1, got {page_size}")
        self._secret = bytes(secret[:64])
        self.page_size = page_size
        self._roots: dict[tuple[object, ...], bytes] = {}

    def root(
        self,
        namespace: Namespace,
        model: ModelIdentity,
        tokenizer: TokenizerIdentity,
        layout: Layout,
    ) -> bytes:
        """The chain root for one (namespace, model, tokenizer, layout, adapter) identity (memoised)."""
        cache_key = (namespace, model, tokenizer, layout)
        got = self._roots.get(cache_key)
        if got is not None:
            return got
        lay = to_dict(keyed_layout(layout))
        ident = {
            "v": 1,
            "namespace": to_dict(namespace),
            "model": to_dict(model),
            "tokenizer": to_dict(tokenizer),
            "layout": lay,
            "page_size": self.page_size,
        }
        root = hashlib.blake2b(_canonical(ident), key=self._secret, digest_size=DIGEST_SIZE, person=_ROOT_PERSON)
        if len(self._roots) >= _ROOT_CACHE_SIZE:
            self._roots.clear()
        got = self._roots[cache_key] = root.digest()
        return got

    def request_root(self, request: Request) -> bytes:
        """The chain root of a request's identity."""
        return self.root(request.namespace, request.model, request.tokenizer, request.layout)

    def keys(
        self, root: bytes, token_ids: Sequence[int], extra_inputs: Iterable[ExtraInput] = ()
    ) -> list[bytes]:
        """Block keys of every full block of `token_ids`, chained from `root` (partial last block not keyed)."""
        return self.extend(root, token_ids, extra_inputs)

    def extend(
        self,
        parent: bytes,
        token_ids: Sequence[int],
        extra_inputs: Iterable[ExtraInput] = (),
        offset: int = 0,
    ) -> list[bytes]:
        """Continue a chain from `parent` over full blocks of `token_ids`, which start at position `offset`."""
        return self._blocks(parent, token_ids, _extras_by_block(extra_inputs, self.page_size, offset))

    def _blocks(self, parent: bytes, token_ids: Sequence[int], extras: dict[int, bytes], start: int = 0,
                stop: int | None = None) -> list[bytes]:  # fmt: skip
        """Chained keys of the full blocks of `token_ids[start:stop]` (all its ids checked).

        `extras` maps block indexes, counted from `start`, to the bytes mixed into those blocks.
        """
        data = _token_bytes(token_ids[start:stop] if start or stop is not None else token_ids)
        step = self.page_size * 4
        return _chain(parent, data, 0, len(data) - len(data) % step, step, extras)

    def chunks(self, parent: bytes, token_ids: Sequence[int], extra_inputs: Iterable[ExtraInput] = (),
               blocks: int = 32) -> Iterator[list[bytes]]:  # fmt: skip
        """`extend(parent, token_ids, extra_inputs)` in pieces of `blocks` keys: a caller can stop between them.

        Each piece packs only its own tokens, so the first piece (and a caller's first deadline check) comes
        after a few microseconds whatever the request's length.
        """
        return self._chunks(parent, token_ids, _extras_by_block(extra_inputs, self.page_size, 0), blocks)

    def _chunks(self, parent: bytes, token_ids: Sequence[int], extras: dict[int, bytes],
                blocks: int) -> Iterator[list[bytes]]:  # fmt: skip
        page = self.page_size
        full = len(token_ids) - len(token_ids) % page
        for first in range(0, full, page * blocks):
            part = {b - first // page: x for b, x in extras.items()} if extras else extras
            got = self._blocks(parent, token_ids, part, first, min(full, first + page * blocks))
            parent = got[-1]
            yield got

    def keys_until(self, parent: bytes, token_ids: Sequence[int], extra_inputs: Iterable[ExtraInput] = (),
                   deadline: float | None = None) -> list[bytes]:  # fmt: skip
        """`keys(parent, token_ids, extra_inputs)`, or the first of them when `deadline` passes first.

        `deadline` is a `time.perf_counter()` value, checked before each chunk of `deadline_chunk` blocks (the
        first included); a caller that gets fewer than `len(token_ids) // page_size` keys ran out of time.
        """
        if deadline is None:
            return self.keys(parent, token_ids, extra_inputs)
        return self._blocks_until(parent, token_ids, _extras_by_block(extra_inputs, self.page_size, 0), deadline)

    def _blocks_until(self, parent: bytes, token_ids: Sequence[int], extras: dict[int, bytes],
                      deadline: float) -> list[bytes]:  # fmt: skip
        """`_blocks` over all of `token_ids` in chunks of `deadline_chunk`, stopping once `deadline` has passed.

        The deadline is checked before each chunk is hashed, the first one included.
        """
        out: list[bytes] = []
        pieces = self._chunks(parent, token_ids, extras, self.deadline_chunk)  # lazy: each hashed when asked for
        while time.perf_counter() <= deadline:
            got = next(pieces, None)
            if got is None:
                break
            out.extend(got)
        return out

    def request_keys(self, request: Request) -> list[bytes]:
        """Block keys of a request (root from its identity, extras mixed into their blocks)."""
        return self.keys(self.request_root(request), request.token_ids, request.extra_inputs)

    def chain(self, root: bytes) -> KeyChain:
        """An incremental chain starting at `root`, for sessions whose tokens arrive over time."""
        return KeyChain(self, root)


def _chain(parent: bytes, data: bytes, start: int, end: int, step: int, extras: dict[int, bytes]) -> list[bytes]:
    """Chained block keys over `data[start:end]` (blocks of `step` bytes; `extras` by block index from 0)."""
    new_hash = _CHAIN.copy  # copying a configured hasher beats constructing one per block
    out: list[bytes] = []
    append = out.append
    if not extras:
        for chunk in [data[off : off + step] for off in range(start, end, step)]:
            h = new_hash()
            h.update(parent)
            h.update(chunk)
            parent = h.digest()
            append(parent)
        return out
    for off in range(start, end, step):
        h = new_hash()
        h.update(parent + data[off : off + step] + extras.get(off // step, b""))
        parent = h.digest()
        append(parent)
    return out


def _extras_by_block(extra_inputs: Iterable[ExtraInput], page_size: int, offset: int) -> dict[int, bytes]:
    out: dict[int, bytes] = {}
    for x in sorted(extra_inputs, key=lambda e: (e.position, e.digest)):
        if x.position < offset:
            continue
        block = (x.position - offset) // page_size
        tag = b"\x00x" + x.position.to_bytes(8, "little") + x.digest.encode()
        out[block] = out.get(block, b"") + tag
    return out


class KeyChain:
    """Keys of a growing token sequence: append tokens as they arrive, read the keys of full blocks.

    A multi-turn session keeps one chain and extends it each turn, so the keys of the shared history are never
    hashed twice. Keys are the same as `BlockKeyer.keys` over the whole sequence.
    """

    __slots__ = ("_keyer", "_pending", "keys", "root", "tokens")

    def __init__(self, keyer: BlockKeyer, root: bytes) -> None:
        self._keyer = keyer
        self.root = root
        self.keys: list[bytes] = []
        self._pending: list[int] = []
        self.tokens = 0

    def extend(self, token_ids: Sequence[int], extra_inputs: Iterable[ExtraInput] = ()) -> list[bytes]:
        """Append tokens; return the keys of the blocks they completed.

        `extra_inputs` are placed by absolute position (as in `BlockKeyer.keys`); those inside blocks this chain
        has already keyed are ignored, so pass the request's extras every time.
        """
        self._pending.extend(token_ids)
        page = self._keyer.page_size
        full = len(self._pending) - len(self._pending) % page
        if not full:
            return []
        parent = self.keys[-1] if self.keys else self.root
        new = self._keyer.extend(parent, self._pending[:full], extra_inputs, offset=self.tokens)
        self.keys.extend(new)
        del self._pending[:full]
        self.tokens += full
        return new
