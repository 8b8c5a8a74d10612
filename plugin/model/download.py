"""Downloads from Hugging Face into the shared cache, so llama.cpp's -hf and other tools reuse them.

Files are pinned to the commit the Hub names when the download starts; split GGUFs come complete;
huggingface_hub resumes an interrupted download where it stopped; free disk space is checked
before the first byte; every downloaded file is checked against the SHA-256 the Hub lists for it
(a file that does not match is deleted and named). With HF_HUB_OFFLINE=1 only the cache is used.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from moeplug.core.errors import MoeplugError
from moeplug.core.fsutil import sha256_file, write_text_atomic
from moeplug.core.output import human_bytes
from moeplug.core.progress import Note, ProgressFn, silent
from moeplug.model.refs import (ModelRef, ResolvedModel, hf_cache_dir, hf_repo_dir, pick_quant_files, resolve_hf_cached,
                          shard_set)

DISK_HEADROOM = 1.02  # a little room for the cache's own files


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def fetch_hf(ref: ModelRef, progress: ProgressFn = silent) -> ResolvedModel:
    """The model's files from the cache, downloading what is missing unless offline."""
    try:
        return resolve_hf_cached(ref)
    except MoeplugError as cached_error:
        if offline():
            raise MoeplugError(f"HF_HUB_OFFLINE is set and {cached_error}") from None
    return _download(ref, progress)


def check_disk(repo: str, need: int, folder: Path) -> None:
    """Refuse before the first byte when the files cannot fit."""
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if need * DISK_HEADROOM > free:
        raise MoeplugError(f"{repo}: {human_bytes(need)} to download but {human_bytes(free)} free in {folder}")


def check_hash(path: Path, sha256: str | None, what: str, progress: ProgressFn = silent) -> None:
    """The file's SHA-256 is the one the Hub lists (None: the Hub lists none, as for small non-LFS
    files); otherwise the file is deleted (its cache blob too) and named, so the next run fetches
    it again."""
    if sha256 is None:
        progress(Note(f"{what}: the Hub lists no SHA-256 for it; not checked"))
        return
    progress(Note(f"checking {what} (SHA-256)"))
    got = sha256_file(path)
    if got != sha256.lower():
        blob = path.resolve()
        path.unlink(missing_ok=True)
        blob.unlink(missing_ok=True)
        raise MoeplugError(f"{what}: SHA-256 {got[:16]}... is not the Hub's {sha256[:16]}...; the file was "
                           f"deleted: run again to download it again")


def _download(ref: ModelRef, progress: ProgressFn) -> ResolvedModel:
    assert ref.repo is not None
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError

    try:
        info = HfApi().model_info(ref.repo, files_metadata=True)
    except HfHubHTTPError as exc:
        raise MoeplugError(f"{ref.repo}: the Hugging Face Hub refused: {str(exc).splitlines()[0]}") from None
    except OSError as exc:
        raise MoeplugError(f"{ref.repo}: cannot reach the Hugging Face Hub ({exc})") from None
    sizes = {s.rfilename: s.size or 0 for s in info.siblings or []}
    hashes = {s.rfilename: s.lfs.sha256 for s in info.siblings or [] if getattr(s, "lfs", None)}
    where = f"{ref.repo}@{(info.sha or '')[:12]} on the Hub"
    files = shard_set(ref.filename, set(sizes), where) if ref.filename else \
        pick_quant_files(list(sizes), str(ref.quant), where)
    need = sum(sizes[f] for f in files)
    cache = hf_cache_dir()
    check_disk(ref.repo, need, cache)
    progress(Note(f"downloading {len(files)} file(s), {human_bytes(need)}, from {where} into {cache}"))
    paths = []
    for f in files:
        try:
            paths.append(Path(hf_hub_download(ref.repo, f, revision=info.sha, cache_dir=cache)))
        except (HfHubHTTPError, OSError) as exc:
            raise MoeplugError(f"{ref.repo}/{f}: download failed ({exc}); run again to resume") from None
        check_hash(paths[-1], hashes.get(f), f"{ref.repo}/{f}", progress)
    if info.sha:
        # the files were fetched at the commit main named: the cache's refs/main says so, as a download of
        # "main" leaves it, so that this cache (offline, or llama.cpp's -hf) finds them by the reference
        write_text_atomic(hf_repo_dir(ref.repo) / "refs" / "main", info.sha)
    return ResolvedModel(ref=ref, path=paths[0], files=paths, source="hf-download", revision=info.sha)
