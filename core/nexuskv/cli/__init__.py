"""The `nexuskv` command line: `cli` (the click group), `main` (its entry point), `with_plugin_commands`.

`with_plugin_commands()` is the group with every installed plugin's commands added (plugins add them through the
`nexuskv_register_commands` hook). `commands.py` holds the group and the kernel's own commands; `rollout.py`
(`policy publish / rollout-status / rollback`), `impact.py` (`policy diff`), `status.py` (`nexuskv status`) and
`demo.py` (`nexuskv demo`) the rest.
"""

from nexuskv.cli.commands import cli, main, with_plugin_commands

__all__ = ["cli", "main", "with_plugin_commands"]
