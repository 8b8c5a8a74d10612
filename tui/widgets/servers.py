"""The served (and installed) models, one row each: health, uptime, throughput, context, cache."""

from __future__ import annotations

from textual.widgets import DataTable

from moeplug.serving.monitor import ServerMetrics, Snapshot
from moeplug.serving.launch import cache_summary
from moeplug.tui.format import duration, rate

COLUMNS = [("name", "name"), ("state", "state"), ("uptime", "up"), ("prefill", "pp t/s"), ("decode", "tg t/s"),
           ("requests", "req"), ("context", "ctx"), ("cache", "expert cache"), ("url", "url")]


def server_rows(snap: Snapshot, recent: dict[str, ServerMetrics]) -> list[tuple[str, list[str]]]:
    """(name, cells) per served model, then the installed models not served ("stopped").
    recent: each server's counters' growth over the last refreshes (the last requests)."""
    rows = []
    for s in snap.servers:
        m = recent.get(s.name) or s.metrics
        ctx = f"{s.ctx_used}/{s.n_ctx}" if s.n_ctx else "-"
        reqs = str(s.metrics.requests_processing) if s.metrics else "-"
        rows.append((s.name, [s.name, s.state if s.state != "starting/unhealthy" else "starting",
                              duration(s.uptime_s) if s.alive else "-",
                              rate(m.prompt_tokens_per_s) if m else "-", rate(m.decode_tokens_per_s) if m else "-",
                              reqs, ctx, cache_summary(s.record.cache), s.record.url]))
    served = {s.name for s in snap.servers}
    for m in snap.installed:
        if m.name not in served:
            rows.append((m.name, [m.name, "stopped", "-", "-", "-", "-", "-", "-", "-"]))
    return rows


class ServersTable(DataTable):
    """Row keys are model names; the cursor picks the model the other panels show."""

    def on_mount(self) -> None:
        self.cursor_type = "row"
        self.zebra_stripes = False
        for key, label in COLUMNS:
            self.add_column(label, key=key)

    def show(self, rows: list[tuple[str, list[str]]]) -> None:
        keys = [k for k, _ in rows]
        if keys != [str(r.value) for r in self.rows]:
            selected = self.selected_name
            self.clear()
            for key, cells in rows:
                self.add_row(*cells, key=key)
            if selected in keys:
                self.move_cursor(row=keys.index(selected))
            return
        for key, cells in rows:
            for (col, _), value in zip(COLUMNS, cells):
                self.update_cell(key, col, value, update_width=True)  # "59s" -> "1m02s": widen, never cut

    @property
    def selected_name(self) -> str | None:
        if not self.row_count:
            return None
        return str(self.coordinate_to_cell_key(self.cursor_coordinate).row_key.value)
