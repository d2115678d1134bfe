"""Text YAML cannot parse, reported at its line and column with the field it is in.

* the field path comes from YAML's own event stream, read up to the error: the keys open at
  that point (``pipeline.schedule``), or the section whose next key could not be read;
* a value that starts with ``*`` (an unquoted cron such as ``*/5 * * * *``, a glob ``*.txt``)
  is an alias to YAML: the error says so and gives the quoted form;
* a tab in the indentation is named as such, at the tab;
* a control character is reported at its line and column, computed from the reader's offset.
"""

from __future__ import annotations

import re

import yaml

from trainforge.pipeline.errors import SpecIssue, dotted


#: Events do not depend on the resolvers: libyaml's parser when available, as the loader uses.
_EventLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
#: What YAML's reader refuses: anything outside its printable set (YAML 1.1, 5.1), and lone
#: surrogates (text decoded with errors="surrogateescape").
_UNREADABLE = re.compile("[^\t\n\r\x20-\x7e\x85\xa0-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def path_at(text: str) -> str:
    """The dotted field path open where parsing ``text`` stops: at its first error, or at its
    end (for the text before a character YAML refuses). Empty at the top level."""
    # one frame per open collection: a mapping's [True, key, whether its value was read],
    # a sequence's [False, index of its current item]
    # a character YAML refuses would stop the reader before the first event: blank it out
    # (same length, so every position stays where it was)
    text = _UNREADABLE.sub(" ", text)
    stack: list[list] = []
    last: tuple | None = None  # (mapping, scalar) when the last event was a scalar value
    try:
        for event in yaml.parse(text, Loader=_EventLoader):
            if isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                if event.start_mark.index >= len(text):
                    # the text ends here: keep the sections open at its end, and the key whose
                    # value it ends in (an empty value, or one that runs up to the end)
                    if last is not None and (last[1].value == "" and not last[1].style
                                             or last[1].end_mark.index >= len(text.rstrip(" "))):
                        last[0][2] = False
                    break
                stack.pop()
                last = None
                continue
            if not isinstance(event, yaml.NodeEvent):
                continue
            last = None
            if stack and stack[-1][0]:
                top = stack[-1]
                if top[2] is not False:  # a key (the first, or the one after a value)
                    top[1], top[2] = getattr(event, "value", None), False
                else:
                    top[2] = True
                    if isinstance(event, yaml.ScalarEvent):
                        last = (top, event)
            elif stack:
                stack[-1][1] += 1
            if isinstance(event, yaml.MappingStartEvent):
                stack.append([True, None, None])
            elif isinstance(event, yaml.SequenceStartEvent):
                stack.append([False, -1])
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        if last is not None and mark is not None and mark.index <= last[1].end_mark.index + 1:
            last[0][2] = False  # the error is at the end of that value: it is the value's
    parts: list = []
    for depth, frame in enumerate(stack):
        inner = depth < len(stack) - 1
        if frame[0] and frame[1] is not None and (inner or frame[2] is False):
            parts.append(str(frame[1]))
        elif not frame[0] and frame[1] >= 0 and inner:
            parts.append(frame[1])
    return dotted(parts)


def _indenting_tab(text: str, line: int) -> tuple[int, int] | None:
    """Line and column (1-based) of a tab in the indentation of line ``line``, where YAML
    reported a syntax error (YAML forbids tabs there; libyaml calls one "a character that
    cannot start any token"), or None when the line has none."""
    lines = text.splitlines()
    if 1 <= line <= len(lines):
        current = lines[line - 1]
        indent = current[: len(current) - len(current.lstrip(" \t"))]
        if "\t" in indent:
            return line, indent.index("\t") + 1
    return None


def _alias_hint(text: str, line: int, column: int) -> str | None:
    """The message for a value at (1-based) ``line``/``column`` that starts with ``*``."""
    lines = text.splitlines()
    if not 1 <= line <= len(lines):
        return None
    current = lines[line - 1]
    value = current[column - 1:]
    if not value.startswith("*"):
        return None
    if " #" in value:
        value = value[: value.index(" #")]
    value = value.strip()
    if value.endswith((",", "]", "}")) and current[:column - 1].rstrip().endswith(("[", "{", ",")):
        value = value.split(",")[0].rstrip("]} ")  # an item of a flow collection
    quoted = f"'{value}'" if "'" not in value else '"' + value.replace('"', '\\"') + '"'
    key = current[:column - 1].strip()
    return (f"YAML reads a value that starts with '*' as an alias (*name) (got {value}; "
            f"expected text in quotes: {key + ' ' if key.endswith(':') else ''}{quoted})")


def syntax_issue(text: str, file: str, err: yaml.MarkedYAMLError) -> SpecIssue:
    """The one issue of a YAML syntax error, at the position YAML gives, with its field path."""
    mark = err.problem_mark or err.context_mark
    line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
    tab = _indenting_tab(text, line)
    if tab is not None:  # the section of the line with the tab, read up to that line
        path = path_at("".join(text.splitlines(keepends=True)[:tab[0] - 1]))
    else:
        path = path_at(text)
    alias_mark = None
    if err.context == "while scanning an alias" and err.context_mark is not None:
        alias_mark = err.context_mark
    elif "undefined alias" in (err.problem or "") and err.problem_mark is not None:
        alias_mark = err.problem_mark
    if tab is not None:
        line, col = tab
        message = (f"a tab is used for indentation; YAML indents with spaces, not tabs "
                   f"(got a tab at column {col}; expected spaces)")
    elif alias_mark is not None and (hint := _alias_hint(
            text, alias_mark.line + 1, alias_mark.column + 1)) is not None:
        line, col = alias_mark.line + 1, alias_mark.column + 1
        path = path_at(text[:alias_mark.index])  # the field the value belongs to
        message = hint
    else:
        message = f"YAML syntax error: {err.problem}"
        if "expected key" in (err.problem or "") or "<block end>" in (err.problem or ""):
            message += " (check the indentation of this line against the lines above)"
    return SpecIssue(file, line, col, path, message)


def unreadable_character(text: str, file: str, err: yaml.reader.ReaderError) -> SpecIssue:
    """The issue of a character YAML refuses (NUL, ESC, other control characters): at its line
    and column, computed from the offset the reader reports."""
    position = max(0, min(int(err.position), len(text)))
    line = text.count("\n", 0, position) + 1
    column = position - (text.rfind("\n", 0, position) + 1) + 1
    char = err.character if isinstance(err.character, str) else chr(err.character)
    return SpecIssue(file, line, column, path_at(text[:position]),
                     f"YAML does not allow the control character {char!r} (got it at offset "
                     f"{position}; expected printable text): remove it, or save the file as "
                     f"UTF-8 if it is UTF-16")
