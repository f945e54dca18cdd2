"""A configuration as TOML text that ``--config`` reads back (``tomllib`` reads; nothing in the
standard library writes TOML, and the few value types of seqpar's configs need no library)."""

from __future__ import annotations

import json


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def config_toml(sections: dict[str, dict]) -> str:
    """The configuration as a TOML file ``--config`` reads back (unset optional values as
    comments)."""
    lines = []
    for name, values in sections.items():
        lines.append(f"[{name}]")
        for key, value in values.items():
            lines.append(f"# {key} unset" if value is None else f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines).rstrip()
