"""A CEL engine: expressions parsed, type-checked, cost-bounded and compiled to Python, with its public API here.

`compile_expr(source, env)` turns a CEL expression into a `Compiled` callable over native Python values; `Env`
declares the variables (their `CelType`s, attrs classes as messages through `message_type`) and the extra
functions (`FunctionDecl`). Errors are located: `CelSyntaxError`, `CelTypeError` and `CelCostError` at compile
time, `CelEvalError` at run time. The dialect, its standard library and extensions are in docs/cel.md; the
conformance runner against cel-spec's suite is `nexuskv.cel.conformance`.

The engine knows nothing of NexusKV's policies (`nexuskv.policy` uses it through this module only); it depends on
`nexuskv.units` alone, for `bytes_of("4GiB")`.

Inside: `syntax/` (grammar, parser, literals, macros), `checker/` (types, names, relations, cost), `codegen/`
(Python source, constant folding), `runtime/` (what generated code calls), `compiled.py` (the pipeline end to end).
"""

from nexuskv.cel.compiled import (
    CelCostError,
    CelError,
    CelEvalError,
    CelSyntaxError,
    CelTypeError,
    Compiled,
    compile_expr,
    fuse,
    helper_globals,
    inline,
    subexpressions,
)
from nexuskv.cel.runtime.conversions import duration as parse_duration
from nexuskv.cel.syntax.parser import parse, parse_tree
from nexuskv.cel.types import (
    BOOL,
    BYTES,
    DOUBLE,
    DURATION,
    DYN,
    INT,
    NULL,
    STRING,
    TIMESTAMP,
    UINT,
    CelType,
    Env,
    FunctionDecl,
    abstract_type,
    list_of,
    map_of,
    message_type,
    optional_of,
    plugin_functions,
    record_type,
    type_of,
    type_param,
)
from nexuskv.cel.values import OptionalValue, TypeValue, Uint

__all__ = [
    "BOOL",
    "BYTES",
    "DOUBLE",
    "DURATION",
    "DYN",
    "INT",
    "NULL",
    "STRING",
    "TIMESTAMP",
    "UINT",
    "CelCostError",
    "CelError",
    "CelEvalError",
    "CelSyntaxError",
    "CelType",
    "CelTypeError",
    "Compiled",
    "Env",
    "FunctionDecl",
    "OptionalValue",
    "TypeValue",
    "Uint",
    "abstract_type",
    "compile_expr",
    "fuse",
    "helper_globals",
    "inline",
    "list_of",
    "map_of",
    "message_type",
    "optional_of",
    "parse",
    "parse_duration",
    "parse_tree",
    "plugin_functions",
    "record_type",
    "subexpressions",
    "type_of",
    "type_param",
]
