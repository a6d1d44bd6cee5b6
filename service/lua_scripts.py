"""The Redis Lua scripts, kept as `.lua` files in service/lua/ and read once, at start.

A script names what it needs as `$NAME` placeholders (string.Template): constants known
only in Python (a key's prefix, a field's name) are filled in when the script is read, so
the text Redis runs is still one fixed script per process, registered once with
`redis.register_script`. A `$` that Lua itself needs (a pattern's end anchor) is
written `$$`.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from string import Template

LUA_FOLDER = Path(__file__).parent / "lua"


@cache
def _source(name: str) -> str:
    return (LUA_FOLDER / f"{name}.lua").read_text()


def lua(name: str, **constants: object) -> str:
    """The text of service/lua/`name`.lua with its `$NAME` placeholders filled in;
    a placeholder left without a value raises KeyError."""
    return Template(_source(name)).substitute({key: str(value) for key, value in constants.items()})
