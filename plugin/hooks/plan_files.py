"""Each installed model's plan as a file the engine reads itself (native/SLOTS-FORMAT.md, version 2):
`P.slots` beside the model's profile `P.gguf`, holding the profile, the slots per layer and every
setting of the engine the plan's flags give, or `placement = stock` where the install's check found
stock's placement faster here.

Every road reads the same file: Ollama's runners find it beside the profile their fingerprint picks
(`--moe-cache-profile DIR --moe-cache-slots auto`), and the router's presets and llama-swap's entries
name it with one flag per model (`--moe-cache-plan FILE`, `served_args`). `moeplug serve` passes the
plan's flags themselves, which the file restates.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Sequence

from moeplug.core.fsutil import write_text_atomic
from moeplug.core.paths import data_dir
from moeplug.hooks.installed import Installed, flag_pairs

HEADER = "# written by moeplug"
PLAN_FLAG = "--moe-cache-plan"
# the engine's settings a plan file holds: the flag --moe-cache-KEY of each
SETTINGS = ("max-batch", "margin", "policy", "half-life", "uploads", "stream", "offload-min-batch", "copy-ahead", "device")
# the flags the file stands for, beside the settings'
_RESTATED = ("--moe-cache-profile", "--moe-cache-slots", *(f"--moe-cache-{key}" for key in SETTINGS))


def profiles_dir() -> Path:
    return data_dir() / "profiles"


def plan_path(profile: Path) -> Path:
    """The plan file beside a profile: P.gguf -> P.slots (the engine's common_moeplug_slots_path)."""
    return profile.with_suffix(".slots") if profile.suffix == ".gguf" else profile.with_name(profile.name + ".slots")


def plan_text(m: Installed) -> str | None:
    """The plan file of an installed model: its slots in the profile's layer order and every setting
    of the engine its flags give (SETTINGS); `placement = stock` where the install's check found
    stock's placement faster here (the engine then runs without the cache). None where the plan
    holds no slot or was planned from another profile (the engine's auto rule applies)."""
    from moeplug.profile.format import model_fingerprint, read_profile

    plan, stock = m.plan, m.placement == "stock"
    slots = list(plan.slots_per_layer)
    if not m.profile or not (any(slots) or stock):
        return None
    tensors = read_profile(m.profile).tensors
    blocks = sorted(int(t.split(".")[1]) for t in tensors)
    if len(blocks) != len(slots) and not stock:
        return None  # a plan of another profile: the engine's auto rule applies
    by_block = dict(zip(blocks, slots))
    counts = [by_block.get(int(t.split(".")[1]), 0) for t in tensors]
    spec = str(counts[0]) if len(set(counts)) == 1 else ",".join(map(str, counts))
    fp = model_fingerprint(m.path)
    budget = f"{plan.vram_budget_bytes / 2**30:.2f}GiB" if plan.vram_budget_bytes else "none"
    digest = hashlib.sha256(json.dumps(plan.to_json(), sort_keys=True).encode()).hexdigest()[:16]
    if stock:
        settings = ["placement = stock"]
    else:
        flags = dict(flag_pairs(plan.server_args))
        settings = ["placement = moeplug", f"slots = {spec}",
                    *(f"{key} = {flags['--moe-cache-' + key]}" for key in SETTINGS if flags.get("--moe-cache-" + key))]
    return "\n".join([f"{HEADER} from the installed plan of {m.name}; edits are replaced", "version = 2",
                      f"model.meta_hash = {fp.meta_hash}", f"model.size = {fp.size}",
                      f"profile = {Path(m.profile).name}", *settings,
                      f"plan = {m.name} ctx={plan.ctx} budget={budget} sha256:{digest}", ""])


def plan_file(m: Installed) -> tuple[Path, str] | None:
    """The model's plan file and its text, where it has one: a profile on disk and a plan_text."""
    if not m.profile or not Path(m.profile).exists():
        return None
    text = plan_text(m)
    return None if text is None else (plan_path(Path(m.profile)), text)


def served_args(m: Installed) -> list[str]:
    """A proxy's arguments for a model served with its plan: the plan's flags with the ones its plan
    file restates (profile, slots, settings) given as that one file, `--moe-cache-plan FILE`; the
    flags themselves where the model has no plan file (plan_file None)."""
    args = list(m.plan.server_args)
    found = plan_file(m)
    if found is None:
        return args
    out: list[str] = []
    for flag, value in flag_pairs(args):
        if flag not in _RESTATED:
            out += [flag] if value is None else [flag, value]
    return [*out, PLAN_FLAG, str(found[0])]


def write_plan_files(models: Sequence[Installed]) -> bool:
    """A plan file beside every installed model's profile; moeplug's files of profiles no model uses
    any more are removed. Returns whether a file changed."""
    changed, wanted = False, set()
    for m in models:
        found = plan_file(m)
        if found is None:
            continue
        path, text = found
        wanted.add(path)
        if not path.exists() or path.read_text() != text:
            write_text_atomic(path, text)
            changed = True
    folder = profiles_dir()
    for stale in sorted(folder.glob("*.slots")) if folder.exists() else []:
        if stale not in wanted and stale.read_text(errors="replace").startswith(HEADER):
            stale.unlink()
            changed = True
    return changed
