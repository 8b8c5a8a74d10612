"""The expert cache's counters from llama-server's /metrics (served with --metrics).

llama-server counts, for batches that ran the cache, the experts the router picked
(`llamacpp:moe_cache_selections_total`), how many a slot served (`..._hits_total`), how many the
CPU computed and the bytes it read for them, and the first two per layer; with the dynamic policy
(`--moe-cache-policy dynamic`) also the experts uploaded into slots after start-up (`..._swaps_total`,
per layer too) and their bytes; and selections and hits per device that holds slots
(`..._device_hits_total{device="CUDA1"}`: two GPUs). This is the measured hit rate, beside the
plan's predicted one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from moeplug.serving.server import HOST, url_of

_SAMPLE_RE = re.compile(r'^llamacpp:moe_cache_(\w+?)(?:\{layer="(\d+)"\}|\{device="([^"]*)"\})? (\d+)$')


@dataclass
class CacheCounters:
    selections: int = 0
    hits: int = 0
    cpu_experts: int = 0
    cpu_bytes: int = 0
    swaps: int = 0
    upload_bytes: int = 0
    layers: dict[int, dict[str, int]] = field(default_factory=dict)  # block -> {"selections", "hits", "swaps"}
    devices: dict[str, dict[str, int]] = field(default_factory=dict)  # "CUDA0" -> {"selections", "hits"}

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.selections if self.selections else None

    def to_json(self) -> dict[str, Any]:
        return {"selections": self.selections, "hits": self.hits, "cpu_experts": self.cpu_experts,
                "cpu_bytes": self.cpu_bytes, "swaps": self.swaps, "upload_bytes": self.upload_bytes,
                "hit_rate": self.hit_rate,
                "layers": {str(k): v for k, v in sorted(self.layers.items())},
                "devices": dict(sorted(self.devices.items()))}

    def since(self, before: dict[str, Any] | None) -> CacheCounters:
        """The counts added after `before` (an earlier reading's to_json(); None: all of them)."""
        if not before:
            return self
        layers = {block: {k: v - int(before.get("layers", {}).get(str(block), {}).get(k, 0)) for k, v in counts.items()}
                  for block, counts in self.layers.items()}
        devices = {d: {k: v - int(before.get("devices", {}).get(d, {}).get(k, 0)) for k, v in counts.items()}
                   for d, counts in self.devices.items()}
        return CacheCounters(*(getattr(self, k) - int(before.get(k) or 0) for k in
                               ("selections", "hits", "cpu_experts", "cpu_bytes", "swaps", "upload_bytes")),
                             layers=layers, devices=devices)


def parse_cache_counters(text: str) -> CacheCounters | None:
    """The moe_cache samples of a Prometheus text page, or None when it has none."""
    c = CacheCounters()
    found = False
    for line in text.splitlines():
        m = _SAMPLE_RE.match(line.strip())
        if not m:
            continue
        found = True
        name, layer, device, value = m[1], m[2], m[3], int(m[4])
        if device is not None:
            key = name.removeprefix("device_").removesuffix("_total")
            c.devices.setdefault(device, {"selections": 0, "hits": 0})[key] = value
        elif layer is not None:
            key = name.removeprefix("layer_").removesuffix("_total")
            c.layers.setdefault(int(layer), {"selections": 0, "hits": 0, "swaps": 0})[key] = value
        elif name in ("selections_total", "hits_total", "cpu_experts_total", "cpu_bytes_total", "swaps_total",
                      "upload_bytes_total"):
            setattr(c, name.removesuffix("_total"), value)
    return c if found else None


def fetch_metrics_page(port: int, timeout: float = 3, host: str = HOST) -> str | None:
    """llama-server's /metrics text, or None when nothing answers or it runs without --metrics."""
    from moeplug.serving.client import metrics_page

    return metrics_page(url_of(host, port), timeout)


def fetch_cache_counters(port: int, timeout: float = 3) -> CacheCounters | None:
    """None when nothing answers, the server runs without --metrics, or it has no cache."""
    page = fetch_metrics_page(port, timeout)
    return parse_cache_counters(page) if page is not None else None
