"""Where the host's time goes, from the reports of `GGML_SCHED_TIMELINE=N` (patch 0030) in server logs.

    python native/bench/serve_bench.py ... --env GGML_SCHED_TIMELINE=64 --keep-logs logs/
    python native/bench/timeline.py logs/*.log

A report covers N graphs with the same number of splits; a server computes graphs of a few shapes
(decoded tokens, prompt batches, the context probe), each its own split count. Per log and split
count this prints the graphs reported, the host's microseconds per graph (the mean, and the median
report's: at N=1 every graph is a report, and a few delayed graphs move the mean), waiting and queuing
inputs, queuing or computing nodes, the synchronize calls, and the time by backend: a CPU split's
compute is the CPU computing (the misses, the layers in RAM), a GPU split's compute is its launch,
and a large `inputs` on the split after a CPU split is the host waiting for the GPU. Then the splits
that took the most host time, with their first node. `--json` writes the same per log.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

HEAD = re.compile(r"ggml_backend_sched_timeline_report: (\d+) graphs of (\d+) splits, host us per graph: "
                  r"([\d.]+) in splits \(inputs ([\d.]+), compute ([\d.]+)\); synchronize ([\d.]+) us per call "
                  r"\((\d+) calls\)")
SPLIT = re.compile(r"ggml_backend_sched_timeline_report: split +(\d+) (\S+) +(\d+) nodes +(\d+) inputs: "
                   r"inputs +([\d.]+) us, compute +([\d.]+) us \[(.*)\]")


@dataclass
class Split:
    backend: str
    nodes: int
    inputs: int
    first: str
    t_inputs: float = 0.0  # us, summed over graphs
    t_compute: float = 0.0


@dataclass
class Shape:
    """Every report of one split count in one log, summed over its graphs."""

    n_splits: int
    graphs: int = 0
    t_inputs: float = 0.0  # us, summed over graphs
    t_compute: float = 0.0
    t_sync: float = 0.0  # us, summed over calls
    n_sync: int = 0
    splits: list[Split] = field(default_factory=list)
    reports: list[float] = field(default_factory=list)  # each report's host us per graph (one graph each at N=1)

    def per_graph(self, us: float) -> float:
        return us / self.graphs if self.graphs else 0.0


def backend_kind(name: str) -> str:
    """CPU, or the device's name without an RPC server's address."""
    return name.split("[", 1)[0]


def parse(text: str) -> dict[int, Shape]:
    """The reports of one log, by split count."""
    shapes: dict[int, Shape] = {}
    current: Shape | None = None
    graphs = 0
    for line in text.splitlines():
        if m := HEAD.search(line):
            graphs, n_splits = int(m[1]), int(m[2])
            current = shapes.setdefault(n_splits, Shape(n_splits))
            current.graphs += graphs
            current.t_inputs += float(m[4]) * graphs
            current.t_compute += float(m[5]) * graphs
            current.t_sync += float(m[6]) * int(m[7])
            current.n_sync += int(m[7])
            current.reports.append(float(m[3]))
        elif (m := SPLIT.search(line)) and current is not None:
            i = int(m[1])
            while len(current.splits) <= i:
                current.splits.append(Split(m[2], int(m[3]), int(m[4]), m[7]))
            s = current.splits[i]
            s.t_inputs += float(m[5]) * graphs
            s.t_compute += float(m[6]) * graphs
    return shapes


def by_backend(shape: Shape) -> dict[str, tuple[float, float, int]]:
    """Backend -> (inputs, compute) us per graph, and how many splits."""
    out: dict[str, tuple[float, float, int]] = {}
    for s in shape.splits:
        i, c, n = out.get(backend_kind(s.backend), (0.0, 0.0, 0))
        out[backend_kind(s.backend)] = (i + shape.per_graph(s.t_inputs), c + shape.per_graph(s.t_compute), n + 1)
    return out


def report(path: Path, shapes: dict[int, Shape], top: int) -> None:
    print(f"\n## {path.name}")
    if not shapes:
        print("no timeline reports (was GGML_SCHED_TIMELINE set? a report needs N graphs of one split count in a "
              "row, and a server whose requests decode fewer tokens than N never makes one: N=1 reports every graph)")
        return
    print("| splits | graphs | host us per graph (median report) | inputs | compute | sync us per call (calls) "
          "| by backend: inputs / compute us (splits) |")
    print("|---:|---:|---:|---:|---:|---:|---|")
    for n, sh in sorted(shapes.items(), key=lambda kv: -kv[1].graphs):
        backends = "; ".join(f"{b} {i:.0f} / {c:.0f} ({k})" for b, (i, c, k) in sorted(by_backend(sh).items()))
        print(f"| {n} | {sh.graphs} | {sh.per_graph(sh.t_inputs + sh.t_compute):.0f} ({statistics.median(sh.reports):.0f}) "
              f"| {sh.per_graph(sh.t_inputs):.0f} "
              f"| {sh.per_graph(sh.t_compute):.0f} | {sh.t_sync / max(sh.n_sync, 1):.0f} ({sh.n_sync}) | {backends} |")
    busiest = max(shapes.values(), key=lambda sh: sh.graphs)
    ranked = sorted(enumerate(busiest.splits), key=lambda kv: -(kv[1].t_inputs + kv[1].t_compute))[:top]
    print(f"\nbusiest splits of the {busiest.n_splits}-split graphs (us per graph):")
    for i, s in ranked:
        print(f"  split {i:3d} {backend_kind(s.backend):<8} {s.nodes:4d} nodes: inputs {busiest.per_graph(s.t_inputs):8.1f}, "
              f"compute {busiest.per_graph(s.t_compute):8.1f} [{s.first}]")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("logs", nargs="+", type=Path, help="server logs (serve_bench.py --keep-logs)")
    ap.add_argument("--top", type=int, default=8, help="splits listed per log")
    ap.add_argument("--json", type=Path, help="also write the sums per log and split count here")
    a = ap.parse_args(argv)
    doc = {}
    for path in a.logs:
        try:
            shapes = parse(path.read_text(errors="replace"))
        except OSError as exc:
            print(f"timeline.py: {path}: {exc.strerror}", file=sys.stderr)
            return 1
        report(path, shapes, a.top)
        doc[str(path)] = {n: asdict(sh) for n, sh in shapes.items()}
    if a.json:
        a.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
