"""llama-swap: moeplug's installed models as `models:` entries, either a fragment of their own in
a `-config-dir` folder (DIR/moeplug.yaml) or a marked block inside a single config file.

Every entry runs moeplug's patched llama-server with the installed plan's flags on `${PORT}`.
What is written is checked first: valid against llama-swap's JSON schema (its
config-schema.json: `--schema`, $MOEPLUG_LLAMA_SWAP_SCHEMA, or the project's shared copy; else
a check of the keys moeplug writes) and no model id or alias that another file in the folder
already defines (llama-swap refuses the whole folder then). The fragment is written under a
name that does not end in .yaml and renamed into place, so llama-swap's -watch-config never
reads half a file.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path
from typing import Any

import yaml

from moeplug.core.errors import MoeplugError
from moeplug.core.fsutil import atomic_path
from moeplug.hooks.command import ModelCommand
from moeplug.hooks.installed import flag_pairs
from moeplug.hooks.files import read_text_exact, replace_keeping

FRAGMENT_NAME = "moeplug.yaml"
SCHEMA_ENV = "MOEPLUG_LLAMA_SWAP_SCHEMA"
DEFAULT_TTL = 300  # seconds idle before llama-swap unloads a model
HEADER = ("# written by 'moeplug hook llama-swap' from moeplug's installed plans; regenerated on every install,\n"
          "# re-plan and profile change; edits here are replaced ('moeplug hook remove' takes it away)\n")
BEGIN = "# >>> moeplug (written by 'moeplug hook llama-swap --file'; edits here are replaced)"
END = "# <<< moeplug"

# What moeplug writes, for when llama-swap's own schema is not at hand.
OWN_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["models"],
    "properties": {"models": {"type": "object", "additionalProperties": {
        "type": "object",
        "required": ["cmd"],
        "properties": {
            "cmd": {"type": "string", "minLength": 1},
            "proxy": {"type": "string"},
            "checkEndpoint": {"type": "string", "pattern": "^/.*$|^none$"},
            "ttl": {"type": "integer", "minimum": -1},
            "env": {"type": "array", "items": {"type": "string", "pattern": "^[A-Z_][A-Z0-9_]*=.*$"}},
            "aliases": {"type": "array", "items": {"type": "string", "minLength": 1}},
            "name": {"type": "string"},
            "description": {"type": "string"},
        },
    }}},
}


def entry(cmd: ModelCommand, ttl: int = DEFAULT_TTL) -> dict[str, Any]:
    """One model's entry: the patched llama-server with the installed plan's flags."""
    argv = cmd.argv("${PORT}")
    lines = [_quote(argv[0])] + [" ".join(_quote(a) for a in (flag, *([value] if value is not None else [])))
                                 for flag, value in flag_pairs(argv[1:])]
    doc: dict[str, Any] = {
        "cmd": "\n".join(lines) + "\n",
        "proxy": "http://127.0.0.1:${PORT}",
        "checkEndpoint": "/health",
        "ttl": ttl,
        "env": [f"{k}={v}" for k, v in cmd.env],
        "aliases": _aliases(cmd),
        "description": f"moeplug: {cmd.ref}, expert slots from the installed plan",
    }
    return {k: v for k, v in doc.items() if v != []}


def _quote(token: str) -> str:
    return token if token == "${PORT}" else shlex.quote(token)


def _aliases(cmd: ModelCommand) -> list[str]:
    """The reference it was installed from, when that is a name people type (not a file path)."""
    ref = cmd.ref
    if ref == cmd.name or ref.endswith(".gguf") or ref.startswith(("/", ".", "~")):
        return []
    return [ref]


def fragment(commands: list[ModelCommand], ttl: int = DEFAULT_TTL) -> dict[str, Any]:
    return {"models": {c.name: entry(c, ttl) for c in commands}}


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(str, _str)


def render(doc: dict[str, Any]) -> str:
    return HEADER + yaml.dump(doc, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=1000)


# ---------------------------------------------------------------------------------------------
# checks


def schema_path(explicit: Path | None = None) -> Path | None:
    """llama-swap's config-schema.json: given, from $MOEPLUG_LLAMA_SWAP_SCHEMA, or the copy a
    checkout of moeplug finds in ../shared/data/llama-swap/ (tests, CI)."""
    if explicit is not None:
        if not explicit.is_file():
            raise MoeplugError(f"{explicit}: no llama-swap schema there")
        return explicit
    if os.environ.get(SCHEMA_ENV):
        return schema_path(Path(os.environ[SCHEMA_ENV]))
    shared = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "llama-swap" / "config-schema.json"
    return shared if shared.is_file() else None


def validate(doc: Any, schema: Path | None = None, where: str = "the llama-swap fragment") -> None:
    """Raise a one-line error naming the first place `doc` breaks llama-swap's schema."""
    import json

    import jsonschema

    path = schema_path(schema)
    spec = json.loads(path.read_text()) if path else OWN_SCHEMA
    error = jsonschema.exceptions.best_match(jsonschema.Draft7Validator(spec).iter_errors(doc))
    if error is not None:
        at = "/".join(str(p) for p in error.absolute_path) or "(top)"
        raise MoeplugError(f"{where} is not valid for llama-swap at {at}: {error.message}"
                           + (f" (schema {path})" if path else ""))


def model_ids(doc: Any) -> dict[str, str]:
    """Every model id and alias a config defines -> the id it belongs to."""
    models = doc.get("models") if isinstance(doc, dict) else None
    out: dict[str, str] = {}
    for mid, spec in (models or {}).items() if isinstance(models, dict) else []:
        out[str(mid)] = str(mid)
        for alias in (spec or {}).get("aliases") or [] if isinstance(spec, dict) else []:
            out[str(alias)] = str(mid)
    return out


def _load_yaml(path: Path, text: str | None = None) -> Any:
    try:
        return yaml.safe_load(path.read_text() if text is None else text)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise MoeplugError(f"{path}: not readable YAML ({first}); nothing was written") from None


def check_clashes(ours: dict[str, Any], others: dict[Path, Any]) -> None:
    mine = model_ids(ours)
    for path, doc in others.items():
        for name, owner in model_ids(doc).items():
            if name in mine:
                alias = f" (alias '{name}')" if name != owner else ""
                raise MoeplugError(f"{path} already defines the model '{owner}'{alias}, which moeplug's fragment "
                                   f"defines too; llama-swap would refuse the folder: rename or remove one of them; "
                                   f"nothing was written")


# ---------------------------------------------------------------------------------------------
# -config-dir DIR: DIR/moeplug.yaml


def write_fragment(folder: Path, commands: list[ModelCommand], ttl: int = DEFAULT_TTL,
                   schema: Path | None = None) -> bool:
    """Write DIR/moeplug.yaml; True when it changed. Refuses a clash with another *.yaml in DIR."""
    if not folder.is_dir():
        raise MoeplugError(f"{folder}: no such folder (llama-swap's -config-dir)")
    dest = folder / FRAGMENT_NAME
    doc = fragment(commands, ttl)
    others = {p: _load_yaml(p) for p in sorted(folder.glob("*.yaml")) if p.name != FRAGMENT_NAME}
    check_clashes(doc, others)
    text = render(doc)
    if dest.exists() and dest.read_text(errors="replace") == text:
        return False
    with atomic_path(dest) as tmp:  # .moeplug.yaml.XXXX.tmp: not a *.yaml llama-swap would read
        tmp.write_text(text)
        os.chmod(tmp, 0o644)
        validate(_load_yaml(tmp), schema, str(dest))
    return True


# ---------------------------------------------------------------------------------------------
# -config FILE: moeplug's entries between two marker comments inside `models:`

_MODELS_KEY = re.compile(r"^models:[ \t]*(?:#.*)?$")


def without_block(text: str, where: str) -> str:
    lines = text.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.strip() == BEGIN]
    ends = [i for i, line in enumerate(lines) if line.strip() == END]
    if not starts and not ends:
        return text
    if len(starts) != 1 or len(ends) != 1 or ends[0] < starts[0]:
        raise MoeplugError(f"{where}: moeplug's marker lines ('{BEGIN}' ... '{END}') are broken; "
                           f"the file is left as it was")
    return "".join(lines[: starts[0]] + lines[ends[0] + 1:])


def merge_file(text: str, commands: list[ModelCommand], where: str, ttl: int = DEFAULT_TTL,
               schema: Path | None = None) -> str:
    """The config with moeplug's block brought up to date, the user's text unchanged."""
    rest = without_block(text, where)
    user = _load_yaml(Path(where), rest) if rest.strip() else {}
    if not isinstance(user, dict):
        raise MoeplugError(f"{where}: not a llama-swap config (the top level is not a mapping); left as it was")
    ours = fragment(commands, ttl)
    check_clashes(ours, {Path(where): user})
    if not commands:
        return rest
    lines = rest.splitlines(keepends=True)
    at = next((i for i, line in enumerate(lines) if _MODELS_KEY.match(line)), None)
    if at is None and "models" in user:
        raise MoeplugError(f"{where}: 'models:' is not a block mapping moeplug can add to (flow style?); "
                           f"left as it was")
    indent = "  "
    if at is not None:
        nxt = next((ln for ln in lines[at + 1:] if ln.strip() and not ln.lstrip().startswith("#")), "")
        if nxt[:1] in (" ", "\t"):
            indent = nxt[: len(nxt) - len(nxt.lstrip())]
    body = yaml.dump(ours["models"], Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=1000)
    block = [indent + BEGIN + "\n", *(indent + ln if ln.strip() else ln for ln in body.splitlines(keepends=True)),
             indent + END + "\n"]
    if at is None:
        head = rest + ("" if not rest or rest.endswith("\n") else "\n")
        merged = head + "models:\n" + "".join(block)
    else:
        merged = "".join(lines[: at + 1] + block + lines[at + 1:])
    doc = _load_yaml(Path(where), merged)
    validate(doc, schema, where)
    if set(model_ids(doc)) != set(model_ids(user)) | set(model_ids(ours)):
        raise MoeplugError(f"{where}: moeplug's entries would not land in 'models:' as intended; left as it was")
    return merged


def write_file(path: Path, commands: list[ModelCommand], ttl: int = DEFAULT_TTL, schema: Path | None = None) -> bool:
    old = read_text_exact(path)
    new = merge_file(old, commands, str(path), ttl, schema)
    if new == old and path.exists():
        return False
    replace_keeping(path, old, new)
    return True
