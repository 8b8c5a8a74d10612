"""llama-server's router mode (`llama-server --models-preset FILE.ini`): one INI section per
installed model, with the installed plan's flags as keys (the flag without its dashes).

moeplug owns only the blocks it wrote, each between two comment lines naming moeplug
(`; >>> moeplug NAME` ... `; <<< moeplug NAME`); every other byte of the file (the user's own
sections, `[*]`, comments, line endings) is kept as it was. The file is checked against the
grammar llama-server parses (common/preset.cpp) before anything is changed, replaced
atomically, and the first version moeplug changes is kept as FILE.moeplug-backup.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from moeplug.core.errors import MoeplugError
from moeplug.hooks.command import ModelCommand
from moeplug.hooks.installed import flag_pairs
from moeplug.hooks.files import read_text_exact, replace_keeping

BEGIN = "; >>> moeplug "
END = "; <<< moeplug "

# The line grammar of llama-server's preset parser: a header or key starts at column 0; a value
# runs up to a ';' or '#' (which start a comment) or the end of the line.
_HEADER = re.compile(r"\[[ \t]*([^\]]+)\][ \t]*(?:[;#].*)?")
_KEY = re.compile(r"([A-Za-z_][A-Za-z0-9_.-]*)[ \t]*=[ \t]*[^;#]*?[ \t]*(?:[;#].*)?")
_COMMENT_OR_BLANK = re.compile(r"[ \t]*(?:[;#].*)?")


def section(cmd: ModelCommand) -> str:
    """The INI block of one model (begin marker, section, keys, end marker)."""
    lines = [f"{BEGIN}{cmd.name} (written by 'moeplug hook llama-server' from the installed plan; "
             f"edits here are replaced)"]
    if cmd.profile_sha256:
        lines.append(f"; profile {cmd.profile} sha256:{cmd.profile_sha256[:16]}")
    for key, value in cmd.env:
        lines.append(f"; needs {key}={value} in the router's environment (children inherit it)")
    remote = dict(flag_pairs(cmd.server_args)).get("--rpc")
    if remote:
        lines.append(f"; runs on the remote devices of {remote}: an rpc-server serves one client at a time, so "
                     f"one such model loaded at a time (--models-max 1)")
    lines.append(f"[{cmd.name}]")
    for key, value in [("model", str(cmd.model)), *_keys(cmd)]:
        if re.search(r"[;#\r\n]", value) or value != value.strip():
            raise MoeplugError(f"{cmd.name}: the value '{value}' of '{key}' cannot be written to an INI preset "
                               f"(';', '#', a line break or edge spaces)")
        lines.append(f"{key} = {value}")
    lines += ["load-on-startup = false", f"{END}{cmd.name}", ""]
    return "\n".join(lines)


def _keys(cmd: ModelCommand) -> list[tuple[str, str]]:
    return [(flag.lstrip("-"), "true" if value is None else value) for flag, value in flag_pairs(cmd.server_args)]


def render(commands: list[ModelCommand]) -> str:
    """The sections of every model, as `--print` shows them."""
    return "\n".join(section(c) for c in commands)


def router_command(commands: list[ModelCommand], preset: Path, models_max: int = 1, port: int = 8080) -> str:
    """How to start the router: with moeplug's patched llama-server (its children run the same binary)."""
    if not commands:
        return ""
    binary = commands[-1].binary
    env = dict(kv for c in commands for kv in c.env)
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))
    cmd = shlex.join([str(binary), "--models-preset", str(preset), "--models-max", str(models_max),
                      "--host", "127.0.0.1", "--port", str(port)])
    return f"{prefix} {cmd}" if prefix else cmd


# ---------------------------------------------------------------------------------------------
# the file: user text and moeplug's blocks


def split_preset(text: str, where: str) -> list[tuple[str | None, str]]:
    """The file as parts: (None, user text) and (model name, moeplug's block). Refuses a file that
    is not an INI preset llama-server would read, naming the first bad line."""
    parts: list[tuple[str | None, str]] = []
    current: str | None = None
    buf: list[str] = []
    for n, line in enumerate(text.splitlines(keepends=True), 1):
        body = line.rstrip("\r\n")
        if not (_HEADER.fullmatch(body) or _KEY.fullmatch(body) or _COMMENT_OR_BLANK.fullmatch(body)):
            raise MoeplugError(f"{where}:{n}: not an INI preset line ({body[:60]!r}); the file is left as it was")
        if current is None and body.startswith(BEGIN):
            if buf:
                parts.append((None, "".join(buf)))
            current, buf = body[len(BEGIN):].split(" ", 1)[0], [line]
        elif current is not None and body.startswith(END):
            if body[len(END):].strip() != current:
                raise MoeplugError(f"{where}:{n}: moeplug's block for '{current}' ends with {body!r}; "
                                   f"the file is left as it was")
            parts.append((current, "".join([*buf, line])))
            current, buf = None, []
        else:
            buf.append(line)
    if current is not None:
        raise MoeplugError(f"{where}: moeplug's block for '{current}' has no end line ('{END}{current}'); "
                           f"the file is left as it was")
    if buf:
        parts.append((None, "".join(buf)))
    return parts


def user_sections(parts: list[tuple[str | None, str]]) -> set[str]:
    out = set()
    for owner, text in parts:
        if owner is None:
            for line in text.splitlines():
                m = _HEADER.fullmatch(line)
                if m:
                    out.add(m[1].strip())
    return out


def merge(text: str, commands: list[ModelCommand], where: str) -> str:
    """The file with moeplug's blocks for these models: updated in place, added at the end, and
    removed for models no longer installed; the user's text unchanged."""
    parts = split_preset(text, where)
    clash = sorted(user_sections(parts) & {c.name for c in commands})
    if clash:
        raise MoeplugError(f"{where}: a section [{clash[0]}] that moeplug did not write is already there; rename "
                           f"it (or remove it) and run the hook again; the file is left as it was")
    blocks = {c.name: section(c) for c in commands}
    out: list[str] = []
    for owner, part in parts:
        if owner is None:
            out.append(part)
        elif owner in blocks:
            out.append(blocks.pop(owner))
    body = "".join(out)
    if blocks:
        if body and not body.endswith(("\n", "\r")):
            body += "\n"  # the one byte moeplug adds to the user's text: a last line's end
        body += "".join(blocks.values())  # no blank lines between: removing the blocks gives the file back
    return body


def write_preset(path: Path, commands: list[ModelCommand]) -> bool:
    """Bring moeplug's blocks in `path` up to date; True when the file changed."""
    old = read_text_exact(path)
    new = merge(old, commands, str(path))
    if new == old and path.exists():
        return False
    replace_keeping(path, old, new)
    return True
