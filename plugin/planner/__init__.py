"""The planner: a request and this machine's facts in, one plan record out (slots, flags, notes)."""
