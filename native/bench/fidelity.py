"""Fidelity of the expert cache on a GPU: no further from stock --cpu-moe than stock full offload is.

Run on a machine with an NVIDIA GPU (moeplug importable, as for bench.py):

    python native/bench/fidelity.py [--prompts 50] [--tokens 256] [--share 0.5]

Builds the patched tree (cached under ~/.cache/moeplug/build), writes a mid-size qwen3moe-shaped
Q4_K model (12 layers x 64 experts, random weights), profiles it on random tokens and runs
`test-moe-cache --fidelity`: stock `--cpu-moe` generates greedily (the reference), stock full
offload and the cache with `--share` of every layer's experts in VRAM run teacher-forced on its
tokens. Both figures (top-token agreement, KL divergence) are printed; the exit status is
test-moe-cache's: 0 when the cache is no worse than full offload on both.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from bench import patched_build


def main() -> int:
    from moeplug.model.synth import ModelSpec, make_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--tokens", type=int, default=256, help="greedy tokens per prompt")
    ap.add_argument("--share", type=float, default=0.5, help="share of each layer's experts resident")
    ap.add_argument("--model", type=Path, default=Path("/tmp/moeplug-bench/fidelity-qwen3moe-q4_k.gguf"))
    ap.add_argument("--prebuilt", type=Path, help="a bin/ folder of a patched build with test-moe-cache")
    ap.add_argument("--jobs", type=int, default=0)
    a = ap.parse_args()
    if not 0 < a.share < 1:
        print(f"--share {a.share}: give a share between 0 and 1 (both ends are bitwise, see test-moe-cache)",
              file=sys.stderr)
        return 2

    patched = patched_build(a.prebuilt, a.jobs)
    spec = ModelSpec(arch="qwen3moe", layers=12, experts=64, used=8, embd=1024, expert_ff=512, heads=16,
                     heads_kv=4, head_dim=64, dtype="q4_k", seed=7)
    if not a.model.exists():
        a.model.parent.mkdir(parents=True, exist_ok=True)
        make_model(spec, a.model)
    profile = a.model.with_suffix(".random.profile.gguf")
    if not profile.exists():
        subprocess.run([str(patched.binary("llama-moe-profile")), "-m", str(a.model), "--random", "16:128",
                        "--out", str(profile), "-n", "16", "-ngl", "99"], check=True, capture_output=True)
    slots = max(1, int(a.share * spec.experts))
    cmd = [str(patched.binary("test-moe-cache")), "-m", str(a.model), "-ngl", "99", "--cpu-moe",
           "--moe-cache-profile", str(profile), "--moe-cache-slots", str(slots),
           "--fidelity", str(a.prompts), "-n", str(a.tokens), "-c", str(32 + a.tokens + 64)]
    print(f"# {' '.join(cmd)}", file=sys.stderr)
    return subprocess.run(cmd, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
