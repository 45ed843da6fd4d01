"""How plugins plug in: the hooks, the interfaces plugins implement, and the manager that loads them.

`hookspecs.py` declares the pluggy hooks, `interfaces.py` the protocols of tier stores, transports and control
planes, `manager.py` the `PluginManager` (builtins and entry points, allow and block lists, isolation).
"""
