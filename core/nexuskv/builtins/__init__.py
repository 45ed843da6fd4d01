"""Builtin plugins, registered with the plugin manager like any other (never called by name)."""
