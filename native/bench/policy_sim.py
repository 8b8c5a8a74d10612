"""The dynamic slot policy beside alternatives, simulated on the gpt-oss-20b decode trace.

Each held-out request (64 replayed prompt tokens as one batch, then 64 decoded tokens, one at a
time; the slots carry over from request to request as in one server) is served by N slots per
layer, seeded with the profile's top N (trace prompts 0:400). The share of decoded tokens' expert
selections that hit a slot is printed for:
  - static: the profile's slots, never changed;
  - the engine's rule (llama-moeplug-policy.cpp): use counts decayed with a half-life of H tokens and
    seeded at the profile's steady state; after each batch, per layer, the hottest missed expert
    replaces the coldest resident one where it beats it by the margin, at most `uploads` swaps over
    all layers, one pending per layer, a swapped expert resident from the batch after the next;
  - looser variants of that rule (no cap, several swaps per layer, no margin);
  - the engine's rule with the slots filled from each prompt batch's own copies: on the GPU a prompt
    batch copies every expert it selects into VRAM (the slots' ones from the slots, the others over
    the bus), so after it each layer could keep, device to device and at no bus cost, the `slots`
    hottest of the experts it holds and the ones the batch used (a lever not built: this says what
    it would buy);
  - LRU per layer, every miss inserted at once (an upload per miss, free of cost here).
Beside it, the experts each prompt batch selects without a slot, per layer and request: what a new
prompt's batch uploads on the GPU, which the slots the previous request left decide. And a variant
that keeps the profile as a floor under the counts (`--prior F`: an expert's count never weighs less
than F times its seed), so that a request's routing does not wash the generally hot experts out of
the slots before the next prompt (simulated, not built).
No weights, no timing: which experts are resident when, only.

    python native/bench/policy_sim.py --slots 8 --requests 24
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "traces" / "gpt-oss-20b" / \
    "decode-routing-mmlu.npz"


def requests_of(experts: np.ndarray, offsets: np.ndarray, first: int, count: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Held-out prompts from `first` with at least 128 decoded tokens: (64 as the prompt, the next 64)."""
    out = []
    for p in range(first, len(offsets) - 1):
        seq = experts[offsets[p]:offsets[p + 1]]
        if len(seq) >= 128:
            out.append((seq[:64], seq[64:128]))
    return out[:count]


def engine(prof: np.ndarray, reqs, slots: int, half_life: float, margin: float, uploads: int,
           per_layer: int, fill_from_prompt: bool = False, prior: float = 0.0) -> tuple[float, float, float]:
    """Hit share of decoded selections, swaps (uploads) per decoded token and the experts a prompt
    batch selects without a slot (per layer and request) under the decayed-count rule;
    fill_from_prompt: after each prompt batch the slots are the hottest of the resident experts and
    the batch's own, at once and without an upload; prior: the rule compares counts plus prior times
    the seed (the profile's steady state), a floor the decay never takes away."""
    n_layer, n_expert = prof.shape
    seed = prof * half_life / np.log(2)
    score = seed.copy()
    floor = prior * seed
    res = np.zeros((n_layer, n_expert), bool)
    for layer in range(n_layer):
        res[layer, np.argsort(-prof[layer])[:slots]] = True
    pending: list[tuple[int, int, int]] = []  # (step it lands after, layer, expert)
    hits = total = swaps = step = 0

    def after(ids: np.ndarray, prompt: bool = False) -> None:
        nonlocal pending, swaps
        score[:] *= 2 ** (-len(ids) / half_life)
        for layer in range(n_layer):
            np.add.at(score[layer], ids[:, layer].ravel(), 1.0)
        for t, layer, e in pending:
            if t <= step:
                res[layer, e] = True
        pending = [x for x in pending if x[0] > step]
        if prompt and fill_from_prompt:
            for layer in range(n_layer):
                held = res[layer].copy()
                held[np.unique(ids[:, layer])] = True
                pool = np.nonzero(held)[0]
                res[layer] = False
                res[layer, pool[np.argsort(-score[layer, pool], kind="stable")[:slots]]] = True
            pending = []
            return
        cands = []
        for layer in range(n_layer):
            if per_layer == 1 and any(pl == layer for _, pl, _ in pending):
                continue
            waiting = {pe for _, pl, pe in pending if pl == layer}
            eff = score[layer] + floor[layer]
            missed = [e for e in np.argsort(-eff) if not res[layer, e] and e not in waiting]
            resident = sorted(np.nonzero(res[layer])[0], key=lambda e: eff[e])
            for k, e in enumerate(missed[:min(per_layer, len(resident))]):
                out = resident[k]
                if eff[e] <= eff[out] + margin:
                    break
                cands.append((eff[e] - eff[out], layer, e, out))
        cands.sort(key=lambda c: -c[0])
        for _, layer, e, out in cands[:uploads] if uploads else cands:
            res[layer, out] = False
            pending.append((step + 1, layer, e))
            swaps += 1

    prompt_misses = 0
    for prompt, decoded in reqs:
        prompt_misses += sum(int((~res[layer, np.unique(prompt[:, layer])]).sum()) for layer in range(n_layer))
        step += 1
        after(prompt, prompt=True)
        for t in range(len(decoded)):
            ids = decoded[t:t + 1]
            for layer in range(n_layer):
                for e in ids[0, layer]:
                    total += 1
                    hits += bool(res[layer, e])
            step += 1
            after(ids)
    return hits / total, swaps / sum(len(d) for _, d in reqs), prompt_misses / (n_layer * len(reqs))


def lru(prof: np.ndarray, reqs, slots: int) -> tuple[float, float, float]:
    """Hit share and uploads per decoded token of an LRU per layer (every miss inserted at once), and the
    experts a prompt batch selects without a slot (before it inserts them)."""
    n_layer = prof.shape[0]
    res = [list(np.argsort(-prof[layer])[:slots][::-1]) for layer in range(n_layer)]  # most recent last
    hits = total = ups = prompt_misses = 0
    for prompt, decoded in reqs:
        prompt_misses += sum(len(set(np.unique(prompt[:, layer])) - set(res[layer])) for layer in range(n_layer))
        for counted, seq in ((False, prompt), (True, decoded)):
            for t in range(len(seq)):
                for layer in range(n_layer):
                    for e in seq[t, layer]:
                        hit = e in res[layer]
                        if counted:
                            total += 1
                            hits += hit
                            ups += not hit
                        if hit:
                            res[layer].remove(e)
                        else:
                            res[layer].pop(0)
                        res[layer].append(e)
    return hits / total, ups / sum(len(d) for _, d in reqs), prompt_misses / (n_layer * len(reqs))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--slots", type=int, default=8, help="slots per layer (of 32)")
    ap.add_argument("--requests", type=int, default=24, help="held-out requests")
    ap.add_argument("--half-life", type=float, default=32.0)
    ap.add_argument("--prior", type=float, default=0.5, help="the floor variant's prior (times the seed)")
    ap.add_argument("--train", type=int, default=400, help="trace prompts the profile is made of (0:N); the "
                    "requests are held-out prompts from N on")
    a = ap.parse_args(argv)
    if not a.trace.is_file():  # the default lives in the project's shared data, outside the repository
        ap.error(f"no routing trace at {a.trace}: pass --trace PATH (an npz trace, moeplug.trace's layout)")
    d = np.load(a.trace)
    experts, offsets = d["experts"], d["offsets"]
    train = experts[offsets[0]:offsets[a.train]]
    n_layer, n_expert = experts.shape[1], int(experts.max()) + 1
    prof = np.stack([np.bincount(train[:, layer].ravel(), minlength=n_expert) for layer in range(n_layer)]) / len(train)
    reqs = requests_of(experts, offsets, a.train, a.requests)
    if not reqs:
        ap.error(f"no held-out prompt from {a.train} on has 128 decoded tokens")
    print(f"{len(reqs)} requests, {a.slots} of {n_expert} slots per layer; hit share of decoded selections, "
          f"swaps (uploads) per decoded token, experts a prompt batch selects without a slot (per layer)")
    rows = [("static (the profile's slots)", engine(prof, reqs, a.slots, a.half_life, 1e9, 0, 1)),
            ("engine: margin 2, 8 uploads, one per layer", engine(prof, reqs, a.slots, a.half_life, 2.0, 8, 1)),
            ("margin 2, no cap, one per layer", engine(prof, reqs, a.slots, a.half_life, 2.0, 0, 1)),
            ("margin 0.5, no cap, two per layer", engine(prof, reqs, a.slots, a.half_life, 0.5, 0, 2)),
            ("margin 0, no cap, four per layer", engine(prof, reqs, a.slots, a.half_life, 0.0, 0, 4)),
            ("engine, slots filled from the prompt batch", engine(prof, reqs, a.slots, a.half_life, 2.0, 8, 1, True)),
            (f"engine, the profile a floor ({a.prior:g})", engine(prof, reqs, a.slots, a.half_life, 2.0, 8, 1,
                                                                  prior=a.prior)),
            ("LRU, every miss inserted at once", lru(prof, reqs, a.slots))]
    for name, (hit, swaps, misses) in rows:
        print(f"{name:<44} {hit:6.1%} {swaps:6.2f} {misses:6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
