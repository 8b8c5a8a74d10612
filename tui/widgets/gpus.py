"""Per GPU: VRAM used of total as a bar with the planned budget drawn on it, and utilisation."""

from __future__ import annotations

from textual.widgets import Static

from moeplug.serving.monitor import Snapshot
from moeplug.tui.format import bar, gib

BAR_WIDTH = 10


def gpu_lines(snap: Snapshot) -> list[str]:
    if not snap.gpus:
        in_ram = any((s.record.cache or {}).get("device") == "CPU" for s in snap.servers)
        return ["no GPU: slots in RAM" if in_ram else "no GPU: experts on the CPU", "(no NVIDIA GPU or driver)"]
    budgets = [s.plan.vram_budget_bytes for s in snap.servers if s.plan and s.plan.vram_budget_bytes]
    lines = []
    for g in snap.gpus:
        marker = budgets[0] if budgets and g.index == 0 else None  # plans are for GPU 0
        util = f" {g.utilization}%" if g.utilization is not None else ""
        lines.append(f"{g.index} {g.name[:30]}")
        lines.append(f"{bar(g.used_bytes, g.total_bytes, BAR_WIDTH, marker)} {gib(g.used_bytes)}/"
                     f"{gib(g.total_bytes)} GiB{util}")
    if budgets:
        lines.append(f"┃ planned budget {gib(budgets[0])} GiB")
    return lines


class GpuPanel(Static):
    def show(self, snap: Snapshot) -> None:
        self.update("\n".join(gpu_lines(snap)))
