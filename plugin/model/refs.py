"""Model references: what `moeplug resolve MODEL` (and later install/serve/plan) accept.

    demo                          the built-in synthetic model
    ./model.gguf, /abs/path.gguf  a local file (any shard of a split model)
    user/repo[:QUANT]             a Hugging Face GGUF repo, llama.cpp's -hf syntax: the quant is
                                  matched case-insensitively against the file names (Q4_K_M default)
    user/repo/path/file.gguf      one file of a Hugging Face repo
    ollama:NAME[:TAG]             the GGUF blob in Ollama's store, used in place (never copied)
    RECIPE                        a known model from recipes/*.yaml (see `moeplug recipes`)

Resolution here is local only: the shared Hugging Face cache (the one llama.cpp's -hf and
huggingface_hub use) and Ollama's store. Downloading is `moeplug install`'s job.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from moeplug.core.errors import MoeplugError
from moeplug.model.inspect import shard_names, shard_paths
from moeplug.core.paths import bundled_dir

DEFAULT_QUANT = "Q4_K_M"
OLLAMA_MODEL_MEDIA_TYPE = "application/vnd.ollama.image.model"
_HF_REPO = r"[A-Za-z0-9][\w.-]*/[\w.-]+"
_HF_QUANT_RE = re.compile(rf"^(?P<repo>{_HF_REPO})(?::(?P<quant>[\w.-]+))?$")
_HF_FILE_RE = re.compile(rf"^(?P<repo>{_HF_REPO})/(?P<file>.+\.gguf)$", re.IGNORECASE)


@dataclass(frozen=True)
class Recipe:
    name: str
    repo: str
    quant: str
    arch: str
    notes: str = ""
    aliases: tuple[str, ...] = ()
    checked: bool = True  # False: the repo name was not confirmed against the Hub


@dataclass(frozen=True)
class ModelRef:
    kind: str  # "demo", "local", "hf", "ollama"
    text: str
    path: Path | None = None
    repo: str | None = None
    quant: str | None = None
    filename: str | None = None
    ollama_name: str | None = None
    ollama_tag: str | None = None
    recipe: Recipe | None = None


@dataclass
class ResolvedModel:
    ref: ModelRef
    path: Path  # what llama-server takes with -m (the first shard of a split model)
    files: list[Path] = field(default_factory=list)
    source: str = ""  # "local", "hf-cache", "ollama", "demo"
    revision: str | None = None  # the Hugging Face commit the files come from

    def to_json(self) -> dict[str, object]:
        r = self.ref
        return {"ref": r.text, "kind": r.kind, "path": str(self.path), "files": [str(f) for f in self.files],
                "source": self.source, "revision": self.revision, "repo": r.repo, "quant": r.quant,
                "recipe": r.recipe.name if r.recipe else None}


# ---- recipes ----------------------------------------------------------------------------------


def recipes_dir() -> Path:
    return bundled_dir("recipes", "_recipes", "qwen3-30b-a3b.yaml")


def load_recipes(folder: Path | None = None) -> dict[str, Recipe]:
    """Every recipe by lower-case name and alias."""
    out: dict[str, Recipe] = {}
    for path in sorted((folder or recipes_dir()).glob("*.yaml")):
        try:
            doc = yaml.safe_load(path.read_text(encoding="utf-8"))
            recipe = Recipe(name=str(doc["name"]), repo=str(doc["repo"]), quant=str(doc.get("quant", DEFAULT_QUANT)),
                            arch=str(doc["arch"]), notes=str(doc.get("notes", "")).strip(),
                            aliases=tuple(str(a) for a in doc.get("aliases", [])),
                            checked=bool(doc.get("checked", True)))
        except (OSError, yaml.YAMLError, KeyError, TypeError) as exc:
            raise MoeplugError(f"{path}: malformed recipe ({exc})") from exc
        if not _HF_QUANT_RE.match(recipe.repo):
            raise MoeplugError(f"{path}: repo {recipe.repo!r} is not user/repo")
        for key in (recipe.name, *recipe.aliases):
            out[key.lower()] = recipe
    return out


# ---- parsing ----------------------------------------------------------------------------------


def _looks_local(text: str) -> bool:
    return (text.startswith(("/", "./", "../", "~")) or Path(text).expanduser().exists()
            or (text.lower().endswith(".gguf") and "/" not in text))


def parse_ref(text: str) -> ModelRef:
    text = text.strip()
    if not text:
        raise MoeplugError("empty model reference")
    if text == "demo":
        return ModelRef(kind="demo", text=text)
    if text.startswith("ollama:"):
        name, tag = text[len("ollama:"):], "latest"
        head, _, tail = name.rpartition(":")
        if head and tail and "/" not in tail:  # NAME:TAG (a colon before a '/' is a host:port)
            name, tag = head, tail
        if not name:
            raise MoeplugError(f"{text}: expected ollama:NAME[:TAG]")
        return ModelRef(kind="ollama", text=text, ollama_name=name, ollama_tag=tag)
    if _looks_local(text):
        return ModelRef(kind="local", text=text, path=Path(text).expanduser())
    recipe = load_recipes().get(text.lower())
    if recipe:
        return ModelRef(kind="hf", text=text, repo=recipe.repo, quant=recipe.quant, recipe=recipe)
    m = _HF_FILE_RE.match(text)
    if m:
        return ModelRef(kind="hf", text=text, repo=m["repo"], filename=m["file"])
    m = _HF_QUANT_RE.match(text)
    if m:
        return ModelRef(kind="hf", text=text, repo=m["repo"], quant=m["quant"] or DEFAULT_QUANT)
    raise MoeplugError(f"unknown model reference '{text}': expected a .gguf path, user/repo[:QUANT], "
                       f"user/repo/file.gguf, ollama:NAME[:TAG], demo, or a recipe ('moeplug recipes' lists them)")


# ---- local resolution -------------------------------------------------------------------------


def hf_cache_dir() -> Path:
    """The shared Hugging Face hub cache, found the way llama.cpp's -hf finds it."""
    env = os.environ
    for var in ("LLAMA_CACHE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(var):
            return Path(env[var])
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]) / "hub"
    if env.get("XDG_CACHE_HOME"):
        return Path(env["XDG_CACHE_HOME"]) / "huggingface" / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def ollama_models_dir() -> Path:
    if os.environ.get("OLLAMA_MODELS"):
        return Path(os.environ["OLLAMA_MODELS"])
    for candidate in (Path.home() / ".ollama" / "models", Path("/usr/share/ollama/.ollama/models")):
        if candidate.is_dir():
            return candidate
    return Path.home() / ".ollama" / "models"


def _resolve_ollama(ref: ModelRef) -> ResolvedModel:
    root = ollama_models_dir()
    assert ref.ollama_name is not None
    parts = ref.ollama_name.split("/")
    if len(parts) == 1:
        parts = ["registry.ollama.ai", "library", parts[0]]
    elif len(parts) == 2:
        parts = ["registry.ollama.ai", *parts]
    manifest = root / "manifests" / Path(*parts) / str(ref.ollama_tag)
    if not manifest.is_file():
        raise MoeplugError(f"{ref.text}: no Ollama manifest at {manifest} (is the model pulled? OLLAMA_MODELS={root})")
    try:
        layers = json.loads(manifest.read_text())["layers"]
        digest = next(layer["digest"] for layer in layers if layer.get("mediaType") == OLLAMA_MODEL_MEDIA_TYPE)
    except (ValueError, KeyError, StopIteration, TypeError) as exc:
        raise MoeplugError(f"{manifest}: no model layer in this Ollama manifest") from exc
    blob = root / "blobs" / digest.replace(":", "-")
    if not blob.is_file():
        raise MoeplugError(f"{ref.text}: the manifest names {digest}, but {blob} is missing")
    return ResolvedModel(ref=ref, path=blob, files=[blob], source="ollama")


def _quant_matches(path: str, quant: str) -> bool:
    return re.search(rf"(^|[-_./]){re.escape(quant)}([-_./]|$)", path, re.IGNORECASE) is not None


def shard_set(name: str, present: set[str], where: str) -> list[str]:
    """[name], or every shard of the split model `name` belongs to (all of them must be there)."""
    folder, _, base = name.rpartition("/")
    names = shard_names(base)
    if names is None:
        return [name]
    shards = [f"{folder}/{n}" if folder else n for n in names]
    missing = [f for f in shards if f not in present]
    if missing:
        raise MoeplugError(f"{where}: split model is incomplete: missing {', '.join(missing)}")
    return shards


def pick_quant_files(files: list[str], quant: str, where: str) -> list[str]:
    """The single file, or the complete set of shards, that carries the quant."""
    matches = sorted(f for f in files if f.lower().endswith(".gguf") and _quant_matches(f, quant)
                     and "mmproj" not in f.lower())
    if not matches:
        raise MoeplugError(f"{where}: no {quant} GGUF (files: {', '.join(sorted(files)) or 'none'})")
    models = sorted({shard_set(f, set(files), where)[0] for f in matches})
    if len(models) > 1:
        raise MoeplugError(f"{where}: {quant} is ambiguous ({', '.join(models)}); name the file: user/repo/FILE.gguf")
    return shard_set(models[0], set(files), where)


def hf_repo_dir(repo: str) -> Path:
    """A repository's folder in the shared Hugging Face cache (blobs, snapshots, refs)."""
    return hf_cache_dir() / f"models--{repo.replace('/', '--')}"


def resolve_hf_cached(ref: ModelRef) -> ResolvedModel:
    """The files a reference names in the snapshot the cache's refs/main points at."""
    assert ref.repo is not None
    cache = hf_cache_dir()
    repo_dir = hf_repo_dir(ref.repo)
    ref_file = repo_dir / "refs" / "main"
    if not ref_file.is_file():
        raise MoeplugError(f"{ref.repo} is not in the Hugging Face cache ({cache}); it has to be downloaded first")
    revision = ref_file.read_text().strip()
    snapshot = repo_dir / "snapshots" / revision
    files = [str(p.relative_to(snapshot)) for p in snapshot.rglob("*") if p.is_file()] if snapshot.is_dir() else []
    where = f"{ref.repo}@{revision[:12]} in the Hugging Face cache"
    if ref.filename:
        if ref.filename not in files:
            raise MoeplugError(f"{where}: no file {ref.filename}")
        chosen = shard_set(ref.filename, set(files), where)
    else:
        chosen = pick_quant_files(files, str(ref.quant), where)
    paths = [snapshot / f for f in chosen]
    return ResolvedModel(ref=ref, path=paths[0], files=paths, source="hf-cache", revision=revision)


def resolve_ref(text: str) -> ResolvedModel:
    """Where the model a reference names is on this machine; a clear error if it is not here."""
    ref = parse_ref(text)
    if ref.kind == "demo":
        from moeplug.model.demo import demo_model_path

        path = demo_model_path()
        if not path.exists():
            raise MoeplugError("the demo model is not generated yet: run 'moeplug install demo'")
        return ResolvedModel(ref=ref, path=path, files=[path], source="demo")
    if ref.kind == "local":
        assert ref.path is not None
        if not ref.path.is_file():
            raise MoeplugError(f"{ref.path}: no such file")
        files = shard_paths(ref.path.resolve())
        return ResolvedModel(ref=ref, path=files[0], files=files, source="local")
    if ref.kind == "ollama":
        return _resolve_ollama(ref)
    return resolve_hf_cached(ref)
