"""A reader for the part of nats-server's config format that ops/nats/*.conf use: maps
(``key { ... }``, ``key = { ... }``, ``key: value``), lists, quoted strings and bare words
(variables such as ``$ADMIN`` stay text). Enough to compare auth.conf's roles with the Helm
values'; nats-server itself checks the files (tests/test_deploy_files.py)."""

from __future__ import annotations

import re
from typing import Any

_WORD = re.compile(r'[^\s{}\[\]=:,#"]+')


def _tokens(text: str) -> list[Any]:
    out: list[Any] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c == "#":  # a comment, to the end of the line
            end = text.find("\n", i)
            i = len(text) if end < 0 else end
        elif c.isspace() or c == ",":
            i += 1
        elif c in "{}[]=:":
            out.append(c)
            i += 1
        elif c == '"':
            end = text.index('"', i + 1)
            out.append(("text", text[i + 1 : end]))
            i = end + 1
        else:
            word = _WORD.match(text, i)
            assert word is not None, text[i : i + 40]
            out.append(("text", word.group()))
            i = word.end()
    return out


def parse(text: str) -> dict[str, Any]:
    tokens = _tokens(text)
    pos = 0

    def value() -> Any:
        nonlocal pos
        token = tokens[pos]
        pos += 1
        if token == "{":
            return mapping("}")
        if token == "[":
            items = []
            while tokens[pos] != "]":
                items.append(value())
            pos += 1
            return items
        return token[1]

    def mapping(end: str | None) -> dict[str, Any]:
        nonlocal pos
        out: dict[str, Any] = {}
        while pos < len(tokens) and tokens[pos] != end:
            key = tokens[pos][1]
            pos += 1
            if tokens[pos] in ("=", ":"):
                pos += 1
            out[key] = value()
        pos += 1
        return out

    return mapping(None)
