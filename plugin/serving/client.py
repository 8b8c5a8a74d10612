"""The one HTTP client of llama-server: every request moeplug sends a server goes through here.

Each function names the endpoint it asks (llama.cpp b11434's tools/server, and the patch series'
`/moe-cache/profile`) and says what it gives back where the server does not answer: None for the
questions moeplug can do without (health, /metrics, /slots), a one-line MoeplugError for the ones it
cannot (a completion, the recorded routing). REQUEST_ERRORS are what a request may raise besides.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import requests

from moeplug.core.errors import MoeplugError

REQUEST_ERRORS = (requests.RequestException,)  # no answer: refused, reset, timed out


def health(url: str, timeout: float = 2) -> dict[str, Any] | None:
    """/health with its HTTP status, or None when nothing answers."""
    try:
        r = requests.get(f"{url}/health", timeout=timeout)
    except requests.RequestException:
        return None
    try:
        return {"http_status": r.status_code, **r.json()}
    except ValueError:
        return {"http_status": r.status_code}


def complete(url: str, prompt: str | Sequence[int | str], n_predict: int = 16, seed: int = 42, timeout: float = 300,
             **params: Any) -> dict[str, Any]:
    """A greedy /completion (no prompt cache unless params say cache_prompt=True); the reply includes
    the generated token ids and llama-server's `timings`. A prompt is text, token ids, or both mixed
    (llama-server tokenizes each text piece)."""
    body = {"prompt": prompt if isinstance(prompt, str) else list(prompt), "n_predict": n_predict,
            "temperature": 0.0, "seed": seed, "cache_prompt": False, "return_tokens": True, **params}
    r = requests.post(f"{url}/completion", json=body, timeout=timeout)
    if r.status_code != 200:
        raise MoeplugError(f"llama-server /completion answered {r.status_code}: {r.text[:200]}")
    return dict(r.json())


def tokenize(url: str, text: str, timeout: float = 60) -> list[int]:
    """/tokenize: the server's tokens for a text."""
    r = requests.post(f"{url}/tokenize", json={"content": text}, timeout=timeout)
    r.raise_for_status()
    return [int(t) for t in r.json()["tokens"]]


def props(url: str, timeout: float = 10) -> dict[str, Any]:
    """/props: the server's settings (its context per slot among them)."""
    return dict(requests.get(f"{url}/props", timeout=timeout).json())


def metrics_page(url: str, timeout: float = 3) -> str | None:
    """/metrics as text, or None where nothing answers or the server runs without --metrics."""
    try:
        r = requests.get(f"{url}/metrics", timeout=timeout)
    except requests.RequestException:
        return None
    return r.text if r.status_code == 200 else None


def slots(url: str, timeout: float = 5, timeouts: bool = False) -> list[dict[str, Any]] | None:
    """/slots: each slot's state, or None where nothing answers or the answer is not a list (--no-slots).
    timeouts: raise TimeoutError where the server took the request but did not answer in time (the
    server's work loop answers /slots: one that waits, or is busy with a long batch)."""
    try:
        r = requests.get(f"{url}/slots", timeout=timeout)
        doc = r.json() if r.status_code == 200 else None
    except requests.ReadTimeout:
        if timeouts:
            raise TimeoutError(f"{url}/slots: no answer in {timeout:g} s") from None
        return None
    except (requests.RequestException, ValueError):
        return None
    return doc if isinstance(doc, list) else None


def moe_profile(url: str, reset: bool = False, timeout: float = 60) -> bytes:
    """/moe-cache/profile: the routing a server run with --moe-cache-record counted, as a profile file's
    bytes (reset: and zero the counts); a one-line error where it does not answer."""
    try:
        r = requests.get(f"{url}/moe-cache/profile", params={"reset": 1} if reset else None, timeout=timeout)
    except requests.RequestException as exc:
        raise MoeplugError(f"{url} did not answer /moe-cache/profile: {exc}") from None
    if r.status_code != 200:
        raise MoeplugError(f"{url} answered /moe-cache/profile with HTTP {r.status_code}: {r.text[:200]}")
    return r.content
