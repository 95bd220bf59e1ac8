"""Any string made safe for where an export puts it: a shell line, a comment, a Modelfile value.

A profile is data someone else wrote, and its strings (a model's file name, a CPU model, a profile's
own file name) end up in text that people ``eval``, ``source`` or hand to ``ollama create``. A model
file named ``x.gguf\\ntouch pwned`` once turned the comment line of the env export into a second
command. Every export goes through ``safe(text, where)``:

- ``"shell"``: one word of a shell line, safe to ``eval``. POSIX single quotes (``shlex.quote``) for
  printable text; text with control characters is spelled with bash/zsh/ksh ``$'...'`` escapes, so
  no byte of it reaches the terminal or the shell raw (a POSIX ``sh`` reads such a word as a plain,
  harmless string).
- ``"comment"``: the text of a ``#`` comment line (shell, env file, Modelfile): control characters
  (a newline would end the comment and start a command) are shown as escapes such as ``\\n``.
- ``"modelfile"``: a value on a Modelfile line (``FROM PATH``). ollama's parser has no escapes: a
  value ends at the line's end and can only be wrapped in ``"`` or ``\"\"\"``. So a value must be
  plain: letters, digits, spaces and ``. _ - + / , : @ % ~ =``. Anything else (a quote, ``$(...)``,
  a backtick, ``;``, a newline) could start another Modelfile instruction, or run a command when the
  file is sourced by mistake, and is refused with ``UnsafeValueError`` saying which character.
"""

from __future__ import annotations

import re
import shlex

from ..errors import ProfileError
from ..limits import shown

WHERE = ("shell", "comment", "modelfile")

_CONTROL = re.compile(r"[\x00-\x1f\x7f\x80-\x9f\u2028\u2029]")
_MODELFILE_PLAIN = re.compile(r"[\w .\-+/,:@%~=]*")


class UnsafeValueError(ProfileError):
    """A string that cannot be written safely where an export needs it (a Modelfile value)."""


def safe(text: str, where: str) -> str:
    """``text`` as it can be written ``where`` (one of ``WHERE``); see the module docstring."""
    if where == "shell":
        return _shell_word(text)
    if where == "comment":
        return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)
    if where == "modelfile":
        plain = _MODELFILE_PLAIN.fullmatch(text)
        if plain is None or not text.strip():
            # (each shown once, by repr: escaping first and then repr printed a newline as '\\n')
            bad = next((c for c in text if not _MODELFILE_PLAIN.fullmatch(c)), "")
            raise UnsafeValueError(
                f"{shown(text, 120)} cannot be written in a Modelfile: ollama's Modelfile has no way to "
                f"quote {bad!r}" + (" (a blank value)" if not text.strip() else "")
            )
        return text.strip()
    raise ValueError(f"where: expected one of {', '.join(WHERE)}, got {where!r}")


def shell_line(words: list[str]) -> str:
    """Words joined into one shell line, each made safe (``safe(word, "shell")``)."""
    return " ".join(_shell_word(w) for w in words)


def _shell_word(text: str) -> str:
    if not _CONTROL.search(text):
        return shlex.quote(text)
    out = []
    for ch in text:
        if ch == "\\" or ch == "'":
            out.append("\\" + ch)
        elif _CONTROL.fullmatch(ch):
            out.append(f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return "$'" + "".join(out) + "'"


__all__ = ["WHERE", "UnsafeValueError", "safe", "shell_line"]
