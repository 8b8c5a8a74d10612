"""moeplug.serving.traffic on a real llama-server log: the H200 server of `native/bench/results/2026-12-04-long-prompt-plans/call4-reprofile/`,
after `moeplug reprofile` restarted it (the launch's 8184-token context probe, then eight requests of
4000 prompt tokens generating 64 each). Read whole, from past the probe, and as a log growing under a
reader, cut anywhere; a relaunch empties the log and the reader starts again."""

from __future__ import annotations

from pathlib import Path

import pytest

from moeplug.serving.traffic import LogTraffic, parse_requests, probe_end, read_traffic

LOG = (Path(__file__).resolve().parent.parent / "native" / "bench" / "results" / "2026-12-04-long-prompt-plans"
       / "call4-reprofile" / "server-gpt-oss-shape.log")


def test_a_real_log_past_its_probe() -> None:
    text = LOG.read_text(encoding="latin-1")
    every = parse_requests(text)
    assert [r.prompt_tokens for r in every] == [8184] + [4000] * 8  # the probe first
    start = probe_end(LOG, timeout=0)
    t = read_traffic(LOG, start)
    assert t is not None and t.requests == 8 and t.prompt_tokens == 32000 and t.generated_tokens == 512
    assert t.prompt_median == t.prompt_max == 4000 and t.planned_prompt_tokens == 4000
    assert t.prefill_weight == 62.5
    # the responses' own timings gave 6688-7153 t/s per request and 43.2-46.8 for decode
    assert 6600 < t.prompt_tokens_per_s < 7200 and 43 < t.generated_tokens_per_s < 47
    assert "8 requests, 32000 prompt tokens computed" in t.summary()


def test_a_growing_log_read_incrementally(tmp_path: Path) -> None:
    data = LOG.read_bytes()
    log = tmp_path / "server.log"
    log.write_bytes(b"")
    reader = LogTraffic(log)
    seen = []
    for cut in range(0, len(data) + 997, 997):  # cuts inside lines and between a block's two lines
        with open(log, "ab") as f:
            f.write(data[len(log.read_bytes()):cut])
        t = reader.read()
        assert t is not None
        seen.append(t.requests)
    assert seen == sorted(seen) and seen[-1] == 9  # never a request twice, never one lost
    assert reader.read().prompt_tokens == 8184 + 32000
    log.write_bytes(data[:2000])  # a relaunch: a new, shorter log
    assert reader.read().requests == 0
    log.unlink()
    assert reader.read() is None and read_traffic(log) is None


@pytest.mark.parametrize("text", ["", "no timing here\n"])
def test_a_log_without_requests(tmp_path: Path, text: str) -> None:
    log = tmp_path / "server.log"
    log.write_text(text)
    t = read_traffic(log)
    assert t is not None and t.requests == 0 and t.prefill_weight == 0.0 and t.planned_prompt_tokens is None
    assert probe_end(log, timeout=0) == len(text)
