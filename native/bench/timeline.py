"""Where the host's time goes, from the reports of `GGML_SCHED_TIMELINE=N` (patch 0024) in server logs.

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

`--prompts` (at N=1) reads the requests in the log instead and sets each prompt batch beside what
ran before it: per prompt length, the batches right after an answer (a request that decoded two
tokens or more) against those after a request of one token, with llama-server's own prompt time,
the host's time in the batch's splits and the rest (building and allocating the graph, setting its
inputs, reading its outputs), then the splits whose host time differs most between the two.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from moeplug.serving.traffic import EVAL_TIMING_RE, PROMPT_TIMING_RE

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


TASK = re.compile(r"\| task (\d+) \| processing task")
NEW_PROMPT = re.compile(r"\| task (\d+) \| new prompt, .*task\.n_tokens = (\d+)")
UBATCH = re.compile(r"llama_context: n_ubatch += (\d+)")


@dataclass
class Graph:
    """One timeline report at N=1: a graph, the host's time in each of its splits."""

    host: float  # us in splits
    sync: float  # us in synchronize calls
    splits: list[tuple[str, int, float, float, str]] = field(default_factory=list)  # backend, nodes, inputs, compute, first


@dataclass
class Task:
    """One request of the log: its prompt's length and time, what it generated, its graphs in order."""

    task: int
    prompt_tokens: int = 0
    prompt_ms: float | None = None
    generated: int | None = None
    graphs: list[Graph] = field(default_factory=list)


def parse_tasks(text: str) -> tuple[list[Task], int]:
    """The requests of one log in order, and the context's n_ubatch (512 where the log does not say)."""
    tasks: list[Task] = []
    by_id: dict[int, Task] = {}
    n_ubatch = 512
    current: Task | None = None
    graph: Graph | None = None
    for line in text.splitlines():
        if m := UBATCH.search(line):
            n_ubatch = int(m[1])
        elif m := TASK.search(line):
            current = Task(int(m[1]))
            tasks.append(current)
            by_id[current.task] = current
            graph = None
        elif m := NEW_PROMPT.search(line):
            if int(m[1]) in by_id:
                by_id[int(m[1])].prompt_tokens = int(m[2])
        elif m := PROMPT_TIMING_RE.search(line):
            if int(m[2]) in by_id:
                by_id[int(m[2])].prompt_ms = float(m[3])
        elif m := EVAL_TIMING_RE.search(line):
            if int(m[2]) in by_id:
                by_id[int(m[2])].generated = int(m[4])
        elif m := HEAD.search(line):
            graph = None
            if current is not None and int(m[1]) == 1:
                graph = Graph(float(m[3]), float(m[6]) * int(m[7]))
                current.graphs.append(graph)
        elif (m := SPLIT.search(line)) and graph is not None:
            graph.splits.append((backend_kind(m[2]), int(m[3]), float(m[5]), float(m[6]), m[7]))
    return tasks, n_ubatch


@dataclass
class PromptBatch:
    tokens: int
    after: str  # "answer" or "one token"
    prompt_ms: float
    graphs: list[Graph]

    @property
    def host_ms(self) -> float:
        return sum(g.host for g in self.graphs) / 1000

    @property
    def sync_ms(self) -> float:
        return sum(g.sync for g in self.graphs) / 1000


def prompt_batches(tasks: list[Task], n_ubatch: int) -> list[PromptBatch]:
    """Each request's prompt graphs (the first ceil(tokens / n_ubatch) of its graphs), labelled by the request
    before it; the first request of a log, and requests whose log lacks their timings or graphs, are left out."""
    out = []
    for prev, t in zip(tasks, tasks[1:]):
        if t.prompt_ms is None or prev.generated is None or t.prompt_tokens <= 0:
            continue
        k = -(-t.prompt_tokens // n_ubatch)
        if len(t.graphs) < k:
            continue
        out.append(PromptBatch(t.prompt_tokens, "answer" if prev.generated >= 2 else "one token", t.prompt_ms,
                               t.graphs[:k]))
    return out


def report_prompts(path: Path, batches: list[PromptBatch], top: int) -> None:
    print(f"\n## {path.name}: prompt batches by the request before them")
    if not batches:
        print("no prompt batches with their graphs (GGML_SCHED_TIMELINE=1, a server log with its requests' timings)")
        return
    med = statistics.median
    print("| prompt tokens | after | requests | prompt ms (median) | in splits ms | synchronize ms | the rest ms "
          "| prompt ms over 15 ms past the fastest |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    lengths = sorted({b.tokens for b in batches})
    for n in lengths:
        fastest = min(b.prompt_ms for b in batches if b.tokens == n)
        for after in ("answer", "one token"):
            group = [b for b in batches if b.tokens == n and b.after == after]
            if not group:
                continue
            delayed = sum(b.prompt_ms > fastest + 15 for b in group)
            print(f"| {n} | {after} | {len(group)} | {med(b.prompt_ms for b in group):.2f} "
                  f"| {med(b.host_ms for b in group):.2f} | {med(b.sync_ms for b in group):.2f} "
                  f"| {med(b.prompt_ms - b.host_ms for b in group):.2f} | {delayed} of {len(group)} |")
    # the splits whose host time differs most, for the most common length with both kinds of batch
    both = [n for n in lengths if {b.after for b in batches if b.tokens == n} == {"answer", "one token"}]
    if not both:
        return
    n = max(both, key=lambda n: sum(b.tokens == n for b in batches))
    groups = {after: [b.graphs[0] for b in batches if b.tokens == n and b.after == after]
              for after in ("answer", "one token")}
    n_splits = min(len(g.splits) for gs in groups.values() for g in gs)
    if any(len(g.splits) != n_splits for gs in groups.values() for g in gs):
        print(f"\n{n}-token prompt graphs differ in their splits: no split-by-split comparison")
        return
    rows = []
    for i in range(n_splits):
        a = med(g.splits[i][2] + g.splits[i][3] for g in groups["answer"])
        o = med(g.splits[i][2] + g.splits[i][3] for g in groups["one token"])
        rows.append((a - o, i, a, o))
    rows.sort(reverse=True)
    print(f"\n{n}-token prompt graphs, splits by how much more host time they took after an answer "
          f"(median us: after an answer / after one token):")
    for d, i, a, o in rows[:top]:
        backend, nodes, _, _, first = groups["answer"][0].splits[i]
        print(f"  split {i:3d} {backend:<8} {nodes:4d} nodes: {a:8.1f} / {o:8.1f} ({d:+.1f}) [{first}]")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("logs", nargs="+", type=Path, help="server logs (serve_bench.py --keep-logs)")
    ap.add_argument("--top", type=int, default=8, help="splits listed per log")
    ap.add_argument("--json", type=Path, help="also write the sums per log and split count here")
    ap.add_argument("--prompts", action="store_true",
                    help="prompt batches after an answer against those after a one-token request (N=1 logs)")
    a = ap.parse_args(argv)
    doc = {}
    for path in a.logs:
        try:
            text = path.read_text(errors="replace")
        except OSError as exc:
            print(f"timeline.py: {path}: {exc.strerror}", file=sys.stderr)
            return 1
        if a.prompts:
            batches = prompt_batches(*parse_tasks(text))
            report_prompts(path, batches, a.top)
            doc[str(path)] = [asdict(b) for b in batches]
            continue
        shapes = parse(text)
        report(path, shapes, a.top)
        doc[str(path)] = {n: asdict(sh) for n, sh in shapes.items()}
    if a.json:
        a.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
