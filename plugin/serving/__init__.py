"""llama-server processes: start, query and stop them; the installed model's launch; status, metrics, traffic."""
