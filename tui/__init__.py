"""moeplug.tui: the Textual dashboard (per-layer slots, hit rates, server metrics).

Not built yet: it comes with the dashboard issue, once the slot cache exposes runtime counters.
"""
