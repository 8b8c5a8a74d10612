"""This machine's facts: its NVIDIA GPUs (NVML) and its free RAM and cores."""
