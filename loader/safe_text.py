"""Text from a server or the cache, made safe to print on a terminal.

A repo name, a file name, a variant's metadata or a server's error text is chosen by whoever
runs the endpoint (or wrote the cache). Printed raw, an ESC starts a terminal control sequence
(`ESC[2K` erases the line, `ESC]8;;` makes a link), a CR moves back to the start of the line, and
a bidi override makes the text read in another order than it is stored: a hostile server could
rewrite the line the user reads. `safe_text` escapes every character Python does not call
printable (C0 and C1 controls, DEL, bidi and other format characters, line and paragraph
separators, unassigned and private-use code points) as `\\xNN`, `\\uNNNN` or `\\UNNNNNNNN`,
so the text shows what it holds and moves nothing. JSON output needs none of this:
`json.dumps` escapes control and non-ASCII characters itself.
"""

from __future__ import annotations


def _escape(char: str) -> str:
    code = ord(char)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def safe_text(value: object) -> str:
    """`str(value)` with every non-printable character escaped: one line that moves no cursor."""
    text = value if isinstance(value, str) else str(value)
    if text.isprintable():  # the common case: nothing to do
        return text
    return "".join(c if c.isprintable() else _escape(c) for c in text)


def safe_lines(value: object) -> list[str]:
    """The lines of a multi-line message (split at newlines only), each made safe to print.
    A CR or any other line break inside a line is escaped, never taken as a new line."""
    text = value if isinstance(value, str) else str(value)
    return [safe_text(line) for line in text.split("\n")]
