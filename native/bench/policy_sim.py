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

Then, at 12.5%, 25% and 50% of each layer's experts (--sizes), the designs that upload every miss
beside the static slots and moeplug's rule: LRU per layer, and upstream llama.cpp's expert cache after
our pin as its design is published (uses decayed with a half-life of 128 tokens and kept after
eviction, 8 frequency classes each an LRU list, every miss uploaded; --cpu-share F adds it computing F
of the misses on the CPU once full), both serving decoded tokens only and starting empty. Beside each
hit share: the uploads and the experts computed on the CPU per decoded token, and the host time per
decoded token the planner's cost model (plugin/planner/allocate.py) gives them at 6, 25 and 55 GB/s of bus.

    python native/bench/policy_sim.py --slots 8 --requests 24
    python native/bench/policy_sim.py --requests 40 --cpu-share 0.5
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moeplug.planner.costs import DEFAULT_COSTS

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
           per_layer: int, fill_from_prompt: bool = False, prior: float = 0.0,
           stats: dict[str, float] | None = None) -> tuple[float, float, float]:
    """Hit share of decoded selections, swaps (uploads) per decoded token and the experts a prompt
    batch selects without a slot (per layer and request) under the decayed-count rule;
    fill_from_prompt: after each prompt batch the slots are the hottest of the resident experts and
    the batch's own, at once and without an upload; prior: the rule compares counts plus prior times
    the seed (the profile's steady state), a floor the decay never takes away. stats: where given,
    "trips" is set to the layers per decoded token with a miss (each a CPU pass and its round trip)."""
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

    prompt_misses = trips = 0
    for prompt, decoded in reqs:
        prompt_misses += sum(int((~res[layer, np.unique(prompt[:, layer])]).sum()) for layer in range(n_layer))
        step += 1
        after(prompt, prompt=True)
        for t in range(len(decoded)):
            ids = decoded[t:t + 1]
            for layer in range(n_layer):
                missed = False
                for e in ids[0, layer]:
                    total += 1
                    hits += bool(res[layer, e])
                    missed |= not res[layer, e]
                trips += missed
            step += 1
            after(ids)
    if stats is not None:
        stats["trips"] = trips / sum(len(d) for _, d in reqs)
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


# Upstream llama.cpp's own expert cache after our pin, modelled from its published design (not from its
# code): each expert's uses decayed with a half-life of 128 tokens and kept after it is evicted; 8
# frequency classes, each an LRU list; every miss uploaded, or with --moe-cache-cpu-share F a share F
# of the misses computed on the CPU once the cache is full; the cache serves decoded tokens only (prompt
# batches read it and change nothing). Its plain LRU predecessor is the same with one class.
CLASSES = 8
CLASS_HALF_LIFE = 128.0  # tokens
SIZES = (0.125, 0.25, 0.5)  # shares of each layer's experts held, the table's rows
BUS_GB_S = (6.0, 25.0, 55.0)  # host-to-device bandwidths the table prices uploads at: PCIe 4 unpinned, pinned, the H200


@dataclass
class Served:
    """What a policy did per decoded token, summed over the layers."""

    hit: float  # share of the decoded tokens' expert selections served from VRAM
    uploads: float  # experts copied host to device
    cpu: float  # missed experts computed on the CPU
    trips: float  # layers whose misses waited on the host: a CPU pass, or a sync and read-back before uploads
    slot_passes: float = 0.0  # layers with a pass over their slots apart from the rest (moeplug's two passes)

    def seconds(self, expert_bytes: float, bus_bytes_per_s: float) -> float:
        """Host-side time per decoded token in the planner's cost model (plugin/planner/allocate.py): uploads at
        the bus's rate, CPU experts at DEFAULT_COSTS.cpu_expert_bytes_per_s, a round trip per waiting layer and a slot
        pass per partly resident one, one after another (the GPU's own time, alike for every policy,
        left out)."""
        return (self.uploads * expert_bytes / bus_bytes_per_s + self.cpu * expert_bytes / DEFAULT_COSTS.cpu_expert_bytes_per_s
                + self.trips * DEFAULT_COSTS.round_trip_s + self.slot_passes * DEFAULT_COSTS.slot_pass_s)


def frequency_class(uses: float) -> int:
    """The class of an expert with `uses` decayed uses (the one being made included): one class per
    doubling, 1 use class 0, 128 or more the last."""
    return min(CLASSES - 1, int(np.log2(max(uses, 1.0))))


def upload_every_miss(reqs, n_layer: int, n_expert: int, slots: int, classed: bool, cpu_share: float = 0.0,
                      half_life: float = CLASS_HALF_LIFE) -> Served:
    """Upstream's cache (module comment above) with `slots` experts per layer, empty at the start:
    classed, the frequency classes; else plain LRU. A used expert takes the class of its decayed uses
    and goes to the recent end of that class's list; a miss is uploaded into the cache, evicting the
    least recently used expert of the lowest class that holds one (never one the same token selected:
    where every resident one is, the miss is uploaded for the token and not kept). cpu_share F: once a
    layer's cache is full, F of its misses (every 1/F-th, carried over from token to token) are computed
    on the CPU and leave the cache as it was."""
    uses = np.zeros((n_layer, n_expert))
    used_at = np.zeros((n_layer, n_expert))  # the token the uses were last brought up to date at
    held: list[dict[int, tuple[int, int]]] = [{} for _ in range(n_layer)]  # expert -> (class, token of its last use)
    owed = np.zeros(n_layer)  # the CPU share carried over, per layer
    hits = total = uploads = cpu = trips = 0
    clock = 0
    for _, decoded in reqs:
        for t in range(len(decoded)):
            clock += 1
            for layer in range(n_layer):
                cache, token = held[layer], {int(e) for e in decoded[t, layer]}
                waited = False
                for e in map(int, decoded[t, layer]):
                    u = uses[layer, e] * 2.0 ** (-(clock - used_at[layer, e]) / half_life) + 1.0
                    uses[layer, e], used_at[layer, e] = u, clock
                    entry = (frequency_class(u) if classed else 0, clock)
                    total += 1
                    if e in cache:
                        hits += 1
                        cache[e] = entry
                        continue
                    waited = True
                    if len(cache) >= slots:
                        owed[layer] += cpu_share
                        if owed[layer] >= 1.0:
                            owed[layer] -= 1.0
                            cpu += 1
                            continue
                    uploads += 1
                    if len(cache) >= slots:
                        victims = [x for x in cache if x not in token]
                        if not victims:
                            continue
                        del cache[min(victims, key=lambda x: cache[x])]
                    cache[e] = entry
                trips += waited
    tokens = sum(len(d) for _, d in reqs)
    return Served(hits / total, uploads / tokens, cpu / tokens, trips / tokens)


def slots_of(share: float, n_expert: int) -> int:
    """Slots per layer for a share of the experts (at least one)."""
    return max(1, round(share * n_expert))


def design_rows(prof: np.ndarray, reqs, n_expert_used: int, half_life: float, cpu_share: float | None,
                sizes: tuple[float, ...] = SIZES) -> list[tuple[float, str, Served]]:
    """Per share of the experts: the profile's static slots and moeplug's rule (engine: misses on the
    CPU, its swaps uploaded), plain LRU and upstream's classed design (every miss uploaded), and the
    classed design with a CPU share where one is given."""
    n_layer, n_expert = prof.shape
    rows = []
    for share in sizes:
        slots = slots_of(share, n_expert)
        partial = n_layer if slots < n_expert else 0
        for name, margin, uploads in (("static (the profile's slots)", 1e9, 0),
                                      ("moeplug's rule (misses on the CPU)", 2.0, 8)):
            stats: dict[str, float] = {}
            hit, swaps, _ = engine(prof, reqs, slots, half_life, margin, uploads, 1, stats=stats)
            rows.append((share, name, Served(hit, swaps, n_layer * n_expert_used * (1 - hit), stats["trips"],
                                             partial)))
        rows.append((share, "LRU, every miss uploaded", upload_every_miss(reqs, n_layer, n_expert, slots, False)))
        rows.append((share, "upstream's classes, every miss uploaded",
                     upload_every_miss(reqs, n_layer, n_expert, slots, True)))
        if cpu_share:
            rows.append((share, f"upstream's classes, CPU share {cpu_share:g}",
                         upload_every_miss(reqs, n_layer, n_expert, slots, True, cpu_share)))
    return rows


def gpt_oss_expert_bytes() -> int:
    """Bytes of one routed expert of the gpt-oss-20b shape the trace is from (moeplug.model.synth): its three
    matrices in the shape's expert type."""
    import gguf

    from moeplug.model.synth import shape_spec

    spec = shape_spec("gpt-oss-20b")
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[spec.n_expert_dtype.upper()]]
    return 3 * spec.embd * spec.expert_ff // block * size


def print_designs(rows: list[tuple[float, str, Served]], n_expert: int, expert_bytes: float,
                  buses: tuple[float, ...] = BUS_GB_S) -> None:
    """The table of design_rows: per row the hit share, uploads and CPU experts per decoded token and
    the modelled host time per decoded token at each bus speed."""
    at = " / ".join(f"{b:g}" for b in buses)
    print(f"\nthe upload-every-miss designs beside moeplug's rule, per decoded token; host time from the planner's "
          f"costs (CPU {DEFAULT_COSTS.cpu_expert_bytes_per_s / 1e9:g} GB/s of expert bytes, {DEFAULT_COSTS.round_trip_s * 1e6:g} us a round "
          f"trip, {DEFAULT_COSTS.slot_pass_s * 1e6:g} us a slot pass), experts of {expert_bytes / 1e6:.2f} MB, the bus at {at} GB/s")
    print(f"{'experts held':<14} {'policy':<42} {'hit':>6} {'uploads':>8} {'CPU':>7}  ms per token at {at} GB/s")
    for share, name, s in rows:
        ms = " / ".join(f"{1e3 * s.seconds(expert_bytes, b * 1e9):.2f}" for b in buses)
        held = f"{share:.1%} ({slots_of(share, n_expert)})"
        print(f"{held:<14} {name:<42} {s.hit:6.1%} {s.uploads:8.2f} {s.cpu:7.2f}  {ms} ms")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--slots", type=int, default=8, help="slots per layer (of 32)")
    ap.add_argument("--requests", type=int, default=24, help="held-out requests")
    ap.add_argument("--half-life", type=float, default=32.0)
    ap.add_argument("--prior", type=float, default=0.5, help="the floor variant's prior (times the seed)")
    ap.add_argument("--train", type=int, default=400, help="trace prompts the profile is made of (0:N); the "
                    "requests are held-out prompts from N on")
    ap.add_argument("--sizes", default="12.5,25,50", help="the designs' table: percent of each layer's experts held, "
                    "a row group each ('' : no table)")
    ap.add_argument("--cpu-share", type=float, default=0.0, help="also upstream's classed design computing this "
                    "share of the misses on the CPU once its cache is full (--moe-cache-cpu-share; 0: no such row)")
    ap.add_argument("--buses", default=",".join(f"{b:g}" for b in BUS_GB_S), help="bus speeds (GB/s) the designs' "
                    "uploads are priced at")
    ap.add_argument("--expert-bytes", type=float, help="bytes of one expert (default: the gpt-oss-20b shape's)")
    a = ap.parse_args(argv)
    try:
        sizes = tuple(float(x) / 100 for x in a.sizes.split(",") if x.strip())
        buses = tuple(float(x) for x in a.buses.split(",") if x.strip())
    except ValueError:
        ap.error(f"--sizes {a.sizes!r}, --buses {a.buses!r}: numbers separated by commas")
    if any(not 0 < x <= 1 for x in sizes) or not buses or any(b <= 0 for b in buses):
        ap.error("--sizes: percents above 0 and at most 100; --buses: at least one speed, above 0")
    if not 0 <= a.cpu_share < 1:
        ap.error("--cpu-share: from 0 to below 1")
    if not a.trace.is_file():  # the default lives in the project's shared data, outside the repository
        ap.error(f"no routing trace at {a.trace}: pass --trace PATH (an npz trace, moeplug.profile.trace's layout)")
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
    if sizes:
        used = experts.shape[2]
        print_designs(design_rows(prof, reqs, used, a.half_life, a.cpu_share or None, sizes), n_expert,
                      a.expert_bytes or gpt_oss_expert_bytes(), buses)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
