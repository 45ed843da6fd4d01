"""NexusKV native fast path: chained block keys and a compact state index in C, as a plugin.

`NativeKeyer` gives the pure-Python `BlockKeyer`'s keys bit for bit; `NativeIndex` gives `DictIndex`'s answers
in about a quarter of the memory. The kernel picks both when this plugin is installed (`nexuskv plugins` shows
which keyer and matcher are active); `[keyer] name = "python"` or `[matcher] name = "dict"` picks the reference.
"""

from nexuskv_native.index import NativeIndex, NativeSnapshot
from nexuskv_native.keyer import NativeKeyer

__all__ = ["NativeIndex", "NativeKeyer", "NativeSnapshot"]
