"""`moeplug profile MODEL`: run llama-moe-profile over prompt sets, merge, store.

Each prompt set (bundled in profiles/, or a file of the user's) is one run of the tool and one
source of the merged profile. The result is stored under the user data dir, keyed by the model's
fingerprint, so every later step finds the profile of the model it is given.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from moeplug.core.errors import MoeplugError
from moeplug.core.paths import bundled_dir, data_dir, logs_dir
from moeplug.profile.format import (
    ModelFingerprint,
    Profile,
    merge_profiles,
    model_fingerprint,
    read_profile,
    write_profile,
)
from moeplug.core.progress import Note, ProgressFn, Step, silent
from moeplug.core.runlog import run_logged

DEFAULT_PROMPT_SETS = ("codeish", "chatty")
# a bundled set no default profile is made from: what benchmarks time a plan on (moeplug.operations.bench)
HELDOUT_PROMPT_SET = "heldout"
_PROGRESS_RE = re.compile(r"prompt (\d+)/(\d+)")


def bundled_prompts_dir() -> Path:
    return bundled_dir("profiles", "_prompts", "codeish.txt")


def resolve_prompt_set(name: str) -> tuple[str, Path]:
    """(label, file) for a bundled set name or a path to a prompts file."""
    path = Path(name)
    if path.suffix == ".txt" and path.exists():
        return path.stem, path
    bundled = bundled_prompts_dir() / f"{name}.txt"
    if bundled.exists():
        return name, bundled
    known = sorted(p.stem for p in bundled_prompts_dir().glob("*.txt"))
    raise MoeplugError(f"unknown prompt set '{name}' (bundled: {', '.join(known)}; or a path to a .txt file)")


def read_prompts(path: Path) -> list[str]:
    """The prompts of a prompts file: separated by lines of '---', blank ones skipped."""
    text = path.read_text(encoding="utf-8")
    return [chunk.strip() for chunk in re.split(r"^---$", text, flags=re.M) if chunk.strip()]


def count_prompts(path: Path) -> int:
    return len(read_prompts(path))


def default_profile_path(fingerprint: ModelFingerprint) -> Path:
    """Where a model's profile is stored: under the user data dir, by model fingerprint."""
    return data_dir() / "profiles" / f"{fingerprint.key}.gguf"


@dataclass
class ProfileRun:
    tool: Path
    model: Path
    n_predict: int = 512
    ctx: int = 4096
    threads: int | None = None
    seed: int = 42
    temp: float = 0.0
    ignore_eos: bool = False
    extra_args: tuple[str, ...] = ()

    def command(self, prompts: Path, label: str, out: Path) -> list[str]:
        cmd = [str(self.tool), "-m", str(self.model), "--prompts", str(prompts), "--label", label,
               "--out", str(out), "-n", str(self.n_predict), "-c", str(self.ctx), "-s", str(self.seed),
               "--temp", str(self.temp)]
        if self.threads:
            cmd += ["-t", str(self.threads)]
        if self.ignore_eos:
            cmd.append("--ignore-eos")
        return cmd + list(self.extra_args)

    def run_set(self, label: str, prompts: Path, out: Path, on_prompt: Callable[[int], None] | None = None) -> Profile:
        def on_line(line: str) -> None:
            m = _PROGRESS_RE.search(line)
            if m and on_prompt:
                on_prompt(int(m[1]))

        run_logged(self.command(prompts, label, out), logs_dir() / f"profile-{label}.log",
                   f"llama-moe-profile on '{label}'", on_line=on_line)
        return read_profile(out)


def run_profile(run: ProfileRun, prompt_sets: list[str], out: Path | None = None,
                progress: ProgressFn = silent) -> tuple[Path, Profile]:
    """Profile the model with each prompt set, merge, check it is this model's, write atomically."""
    sets = [resolve_prompt_set(s) for s in prompt_sets]
    fingerprint = model_fingerprint(run.model)
    total = sum(count_prompts(p) for _, p in sets)
    done_before = 0
    profiles = []
    with tempfile.TemporaryDirectory(prefix="moeplug-profile-") as tmp:
        for label, prompts in sets:
            n = count_prompts(prompts)
            progress(Note(f"profiling '{label}': {n} prompts x {run.n_predict} tokens"))

            def on_prompt(i: int, base: int = done_before) -> None:
                progress(Step("profiling", base + i, total, "prompt", every=1))

            profiles.append(run.run_set(label, prompts, Path(tmp) / f"{label}.gguf", on_prompt))
            done_before += n
    merged = merge_profiles(profiles)
    merged.check_model(fingerprint)
    dest = out or default_profile_path(fingerprint)
    write_profile(merged, dest)
    return dest, merged
