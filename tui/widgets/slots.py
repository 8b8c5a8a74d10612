"""The selected model's expert slots per MoE layer: planned, predicted and measured hit rates; for a
plan split over several devices (GPUs, remote devices) a line per device; why a model is down, waits
on a remote device or lost one."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import DataTable, Static

from moeplug.planner.record import describe_blocks
from moeplug.serving.monitor import ServerSnapshot
from moeplug.tui.format import percent, size, strip

COLUMNS = [("block", "blk"), ("slots", "slots"), ("kind", "kind"), ("predicted", "pred"), ("measured", "meas")]
KIND = {"whole": "whole", "partial": "partly", "ram": "in RAM"}


def layer_rows(s: ServerSnapshot) -> list[list[str]]:
    """blk, slots/experts, kind, predicted and measured hit rate, per MoE layer."""
    return [[str(x.block), f"{x.slots}/{x.n_expert}", KIND[x.kind], percent(x.predicted_hit_rate),
             percent(x.measured_hit_rate)] for x in s.layers]


def summary_lines(s: ServerSnapshot | None) -> list[str]:
    if s is None:
        return ["no served model selected"]
    why = [f"{s.state}: {s.state_why}"] if s.state_why else []  # down, waiting on or lost a remote host
    if not s.plan:
        return why + ["the plan it runs is not known (launched by an older moeplug): the cache line says the slots"]
    p = s.plan
    c = s.cache_counters
    lines = [f"fit {p.fit_fraction:.0%} · hit pred {percent(p.predicted_hit_rate)} "
             f"meas {percent(c.hit_rate) if c else '-'}",  # counted past the start-up check (monitor.past_probe)
             f"CPU read {size(s.cpu_bytes_per_token)}/token" if c else _uncounted(s)]
    hits = [x.measured_hit_rate if x.measured_hit_rate is not None else x.predicted_hit_rate for x in s.layers]
    lines.append(f"hit/layer {strip(hits)}")
    lines += device_lines(s)
    lines += [f"⚠ {w}" for w in p.warnings or []]
    lines += [f"served with stock's placement: {s.placement_why}"] if s.placement == "stock" else []
    return why + lines


def device_lines(s: ServerSnapshot) -> list[str]:
    """A line per device of a plan split over several (remote devices first, as llama.cpp orders
    them): name, where (this machine, or its rpc-server), blocks, whole layers, slots, budget."""
    return [f"{d['device']} {d['endpoint'] or 'this machine'}: blk {describe_blocks(d['blocks'], d['output'])}, "
            f"{d['whole_layers']}/{d['moe_layers']} whole, {d['slots']} slots, {size(d['budget_bytes'])}"
            for d in s.devices]


def _uncounted(s: ServerSnapshot) -> str:
    """Why there is no measured hit rate: served without the counters (s restarts it with them), or
    not answering /metrics now."""
    if "--metrics" not in s.record.args:
        return "measured: not counted (served --no-metrics; s restarts it with counters)"
    return "measured: /metrics did not answer"


class SlotsPanel(Vertical):
    def compose(self) -> ComposeResult:
        yield Static(id="slots-summary")
        yield DataTable(id="layers", cursor_type="none", zebra_stripes=False)

    def on_mount(self) -> None:
        table = self.query_one("#layers", DataTable)
        for key, label in COLUMNS:
            table.add_column(label, key=key)

    def show(self, s: ServerSnapshot | None) -> None:
        self.border_title = f"expert slots: {s.name}" if s else "expert slots"
        self.query_one("#slots-summary", Static).update("\n".join(summary_lines(s)))
        table = self.query_one("#layers", DataTable)
        table.clear()
        for row in layer_rows(s) if s else []:
            table.add_row(*row, key=row[0])
