"""Spreading a VRAM budget of expert slots over the MoE layers.

Per decoded token, a MoE layer whose experts stay in host memory costs a round trip to the CPU
(activations down, expert pass, result up) plus the CPU time of each picked expert without a
slot; a layer with every expert resident (a "whole" layer) runs on the GPU alone, like a layer
stock llama.cpp offloads. So a slot is worth the share of the layer's selections it serves times
the CPU time of one expert, and the last slot of a layer also saves the round trip.

With a skewed router (real models) the hottest experts of every layer win; with a near-uniform
one (the random-weight benchmark model) spreading buys almost nothing per slot and whole layers
win, as in stock `-ncmoe`. The allocation minimises the modelled CPU time per token over all
layers (a small knapsack, solved exactly by dynamic programming), so it lands on whichever the
profile supports.

One rule of placement comes first: the whole layers are the first ones and the partly resident
layers follow them, as stock `--fit` keeps the experts of the last layers in RAM. Prompt batches
upload the experts of those layers, and where they sit costs more than the bytes: on the GPU
machine, three layers' experts in RAM ran prefill 4% slower as layers 4, 30 and 47 than as 45, 46
and 47 (same bytes), and the planner had picked 4 and 30 for slots only for a slightly more skewed
router there. With a skewed router every layer is partly resident and the rule does not bind.

The hit curve of a layer (share of selections its top-N experts serve) comes from the profile, and
what it must predict is the hit rate on prompts the profile has not seen: the slots are fixed. So
experts are ranked on half of the profile's prompts and scored on the other half (two-fold
cross-validation by prompt). Ranking and scoring on the same tokens overstates the curve (the
experts that ranked first were partly lucky), and so does a split of the same prompts' tokens:
consecutive tokens of one prompt route alike, because the context steers the router. On the
random-weight benchmark model a split by token made the top quarter of experts look like half of
the traffic, a split by prompt 25.5%, and llama-server measured 26.1% on new random tokens.

Speculative decoding changes the unit of work: the trunk verifies a batch of k = draft tokens + 1
tokens at once, and a batch reads each missed expert once, however many of its tokens picked it.
So what a slot saves per step is not k times its per-token share but the chance that the batch
picks its expert at all: with p_e the expert's per-token selection probability (its selections
over the tokens, n_expert_used times its share of the layer's selections), 1 - (1 - p_e)^k. That
is near 1 for a hot expert whether k is 1 or 4, and grows about k-fold for a rare one, so batches
make a flat layer's slots worth more next to a skewed layer's (in the gpt-oss-20b trace 4
consecutive tokens touch 9.3 of 32 experts per layer, not 16). `LayerCost.tokens_per_step` is k;
the round trip and slot pass stay one per step, and the modelled time is per verification step
(per decoded token at k = 1, today's model exactly). The per-rank probabilities come from the
cross-validated hit curve's steps, so the ranking is still judged on prompts it was not made from;
tokens of one batch are treated as independent draws, which overstates the distinct experts a
little (consecutive tokens route alike) and so, if anything, values the slots of flat layers high.

Prompts cost too. A prompt batch (up to a ubatch of 512 tokens) uploads, for every layer that is
not whole, the experts its tokens picked that have no slot. How fast depends on the path: the
cache's prompt batches copy the experts on the GPU itself, the later weights of a layer while the
one before computes (native/DESIGN.md, "Prefill"); stock's scheduler copies from the host, one
weight after another. The two rates (CostModel.upload_bytes_per_s, stock_upload_bytes_per_s) were
fitted to llama-server's prefill on the GPU machine (run 2026-12-02-server-rounds-vram: 38 us per
uploaded expert of 2.65 MB on the cache's path, 56 us on stock's, within 3.9 ms rms of prompts taking
29-102 ms). A plan that runs without the copies ahead (`LayerCost.copy_ahead`) copies each weight only
when its split starts, as stock does, so its uploads are priced at stock's rate (run
2026-12-03-prefill-16gib). The model has no fixed stall per layer: fitted beside the uploads it came
out below zero. The uploads explain why placement matters:
the benchmark model's early layers route a 64-token prompt to 94-42 distinct experts, its later ones
to ~25, so keeping the later layers' experts in RAM (as --fit does) uploads a third fewer bytes than
keeping the first ones there. How many distinct experts a prompt batch picks per layer comes from
the profile's prompt tokens, split by prompt as above (the slots ranked on one half, the batches of
the other half counted), and `prefill_weight` says how many prompt tokens the workload has per
generated token (1 by default; 0 plans for decode only).
A profile without prompt tokens (one made from a decode trace) adds no prompt cost.

Long prompts (run 2026-12-03-ubatch-auto). The bundled prompts have at most 256 tokens, one batch each, so
the profile says nothing of a workload whose prompts fill many batches. Given a prompt length
(`moeplug plan --prompt-tokens N`), a layer's uploads are priced from its hit curve instead
(long_prompt_uploads): the prompt cut into batches of the ubatch, each batch picking the expert ranked
r with chance 1 - (1 - p_r)^b. A batch of 512 picks nearly every expert, so both paths upload all the
experts a layer holds in RAM once per batch, bound by the bus, not by compute: priced at
CostModel.long_prompt_upload_bytes_per_s on either path. That is what makes the ubatch a lever (plan.py,
choose_ubatch): 2048 uploads a quarter of 512's bytes per prompt token, for activations that take
VRAM from the slots.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from moeplug.profile.format import PHASE_DECODE, Profile, ProfileSource
from moeplug.planner.costs import DEFAULT_COSTS, CostModel

TIE_BREAK_S = 1e-12
PREFILL_WEIGHT = 1.0  # prompt tokens per generated token
PREFILL_UBATCH = 512  # llama-server's ubatch: a longer prompt uploads once per ubatch
PREFILL_GUARD_DOUBLINGS = 10  # allocate_against_stock weighs prompts at most 1024 times more
# Misses on both sides of the link (--moe-cache-stream S, native/DESIGN.md): the GPU computes the hottest
# missed experts carrying S of a partly resident layer's missed selections from pinned RAM while the
# CPU computes the rest; the shares weighed (stream_share), priced by CostModel's stream_* figures.
STREAM_SHARES = (0.25, 0.5, 0.75, 1.0)


@dataclass
class LayerCost:
    bytes_per_expert: int
    n_expert: int
    n_expert_used: int
    hits: np.ndarray  # [n_expert + 1]: share of selections the top-N experts serve, N = 0..n_expert
    tokens_per_step: int = 1  # k: tokens one batch verifies (speculative decoding: draft tokens + 1)
    # per prompt token: experts uploaded with the top-N resident, N = 0..n_expert (prefill_uploads),
    # and prompt batches; None: no prompt cost (the profile holds no prompt tokens)
    prefill: np.ndarray | None = None
    prefill_batches: float = 0.0
    prefill_weight: float = PREFILL_WEIGHT
    copy_ahead: bool = True  # False: a prompt batch's expert weights are copied one at a time, as stock's
    prompt_rate: float | None = None  # bytes/s of a prompt batch's uploads on either path (None: the path's own)
    costs: CostModel = DEFAULT_COSTS  # the machine's figures (planner/costs.py)

    def missed_experts(self, n_slots: np.ndarray) -> np.ndarray:
        """Expected distinct experts a step computes on the CPU with n_slots resident: at k = 1 the
        per-token misses, n_expert_used * (1 - hits); in a batch of k tokens, the sum over the
        experts ranked after the slots of 1 - (1 - p)^k (module docstring)."""
        if self.tokens_per_step == 1:
            return self.n_expert_used * (1.0 - self.hits[n_slots])
        return distinct_after(self.hits, self.n_expert_used, [self.tokens_per_step])[n_slots]

    def seconds(self, n_slots: np.ndarray, stock: bool = False) -> np.ndarray:
        """Modelled host-side time per step (a decoded token, or a verification batch of
        tokens_per_step tokens) with n_slots resident experts; stock: prompt batches on stock's path."""
        cpu = self.missed_experts(n_slots) * self.bytes_per_expert / self.costs.cpu_expert_bytes_per_s
        t = self.costs.round_trip_s + np.where(n_slots > 0, self.costs.slot_pass_s, 0.0) + cpu + self.prompt_seconds(n_slots, stock)
        return np.where(n_slots >= self.n_expert, 0.0, t)

    def prompt_seconds(self, n_slots: np.ndarray, stock: bool = False) -> np.ndarray:
        """The layer's share of prompt processing per step, weighted by prompt tokens per generated
        token: its uploads per prompt token (module docstring), 0 without prompt data."""
        if self.prefill_weight <= 0:
            return np.zeros_like(np.asarray(n_slots), dtype=np.float64)
        return self.prefill_weight * self.tokens_per_step * self.prompt_token_seconds(n_slots, stock)

    def prompt_token_seconds(self, n_slots: np.ndarray, stock: bool = False) -> np.ndarray:
        """What the layer adds to a prompt batch per prompt token with n_slots resident: the experts
        it uploads, on the cache's path or stock's (module docstring); 0 for a whole layer or without
        prompt data. Without the copies ahead the cache's copies wait in turn as stock's do, so they
        are priced at stock's rate."""
        n_slots = np.asarray(n_slots)
        if self.prefill is None:
            return np.zeros_like(n_slots, dtype=np.float64)
        rate = self.prompt_rate or (self.costs.stock_upload_bytes_per_s if stock or not self.copy_ahead else self.costs.upload_bytes_per_s)
        per_token = self.prefill[np.minimum(n_slots, self.n_expert)] * self.bytes_per_expert / rate
        return np.where(n_slots >= self.n_expert, 0.0, per_token)


def uniform_hits(n_expert: int) -> np.ndarray:
    return np.arange(n_expert + 1, dtype=np.float64) / n_expert


def _curve(rank_decode: np.ndarray, rank_prefill: np.ndarray, score_counts: np.ndarray) -> np.ndarray:
    """Share of score_counts' selections served by the experts a server would fill its slots with from
    counts rank_decode and rank_prefill (slot_order: the engine's one ranking)."""
    order = slot_order(rank_decode, rank_prefill)
    total = score_counts.sum()
    if total == 0:
        return uniform_hits(len(rank_decode))
    return np.concatenate([[0.0], np.cumsum(score_counts[order]) / total])


def _layer_counts(seq: np.ndarray, n_layers: int, n_expert: int, weights: np.ndarray | None = None) -> np.ndarray:
    """[n_layers, n_expert] selection counts of seq [n_steps, n_layers, n_expert_used], each step
    counted `weights[step]` times (None: once; int64 then)."""
    counts = np.zeros((n_layers, n_expert), dtype=np.int64 if weights is None else np.float64)
    for layer in range(n_layers):
        ids = seq[:, layer, :]
        step_w = None if weights is None else np.broadcast_to(weights[:, None], ids.shape).ravel()
        ids = ids.ravel()
        keep = (ids >= 0) & (ids < n_expert)
        counts[layer] = np.bincount(ids[keep], weights=None if step_w is None else step_w[keep], minlength=n_expert)
    return counts


def _prompt_folds(sources: list[ProfileSource]) -> np.ndarray:
    """0/1 per token of the concatenated sources: alternate prompts go to alternate halves. With a
    single prompt, its first and second half (the least shared context a split can leave)."""
    folds, n_prompts = [], 0
    for s in sources:
        prompt = s.meta[:, 0] if s.meta.shape[0] == len(s.seq) else np.zeros(len(s.seq), np.int32)
        _, index = np.unique(prompt, return_inverse=True)
        folds.append((index.ravel() + n_prompts) % 2)
        n_prompts += int(index.max()) + 1
    if n_prompts < 2:
        n = len(folds[0])
        return (np.arange(n) >= n // 2).astype(np.int64)
    return np.concatenate(folds)


def hit_curves(profile: Profile | None, n_layers: int, n_expert: int) -> np.ndarray:
    """float [n_layers, n_expert + 1]: each layer's expected share of selections its top-N serve.

    Sources with sequences are cross-validated by prompt, each token counted at its source's
    weight (older traffic counts less after a decayed merge). Counts no sequence holds (a
    llama-server's live counts: the file's counts minus the weighted sequences) have no prompts
    to split: half of them goes to each fold, so that part is scored on itself. Each fold's experts
    are ranked as the engine fills its slots from a profile (slot_order: generated tokens' selections
    first, then the prompts'), and scored on the other fold's selections of both."""
    if profile is None:
        return np.tile(uniform_hits(n_expert), (n_layers, 1))
    sources = [s for s in profile.sources if len(s.seq)]
    if sources:
        seq = np.concatenate([s.seq for s in sources]).astype(np.int64)
        weights = np.concatenate([np.full(len(s.seq), s.weight) for s in sources])
        # a source without per-step phases (no meta rows) counts as generated tokens
        decode = np.concatenate([s.meta[:, 2] == PHASE_DECODE if s.meta.shape[0] == len(s.seq)
                                 else np.ones(len(s.seq), dtype=bool) for s in sources])
        fold = _prompt_folds(sources)
        halves = [[_layer_counts(seq[(fold == f) & (decode == d)], n_layers, n_expert, weights[(fold == f) & (decode == d)])
                   for d in (True, False)] for f in (0, 1)]  # [fold][decode, prefill]
        if any(not len(s.seq) for s in profile.sources):
            for phase, counted in enumerate((profile.counts_decode, profile.counts_prefill)):
                rest = np.maximum(counted.astype(np.float64) - halves[0][phase] - halves[1][phase], 0.0) / 2
                halves[0][phase], halves[1][phase] = halves[0][phase] + rest, halves[1][phase] + rest
        curves = np.stack([(_curve(*(h[i] for h in halves[0]), sum(h[i] for h in halves[1])) +
                            _curve(*(h[i] for h in halves[1]), sum(h[i] for h in halves[0]))) / 2
                           for i in range(n_layers)])
    else:
        counts = profile.counts_decode if profile.counts_decode.sum() > 0 else profile.counts_prefill
        curves = np.stack([_curve(d, p, c) for d, p, c in zip(np.asarray(profile.counts_decode, dtype=np.int64),
                                                               np.asarray(profile.counts_prefill, dtype=np.int64),
                                                               np.asarray(counts, dtype=np.int64))])
    curves = np.maximum.accumulate(np.clip(curves, 0.0, 1.0), axis=1)
    curves[:, -1] = 1.0
    return curves


def prefill_uploads(profile: Profile | None, n_layers: int, n_expert: int,
                    ubatch: int = PREFILL_UBATCH) -> tuple[np.ndarray, float] | None:
    """Per layer, the experts a prompt batch uploads per prompt token with the top-N resident
    (float [n_layers, n_expert + 1]), and prompt batches per prompt token; None where the profile
    holds no prompt tokens. The prompt tokens of each prompt are cut into batches of `ubatch`; the
    experts are ranked on the other half of the prompts (the folds of hit_curves) and the distinct
    experts of each batch counted behind the top N."""
    if profile is None:
        return None
    sources = [s for s in profile.sources if len(s.seq) and s.meta.shape[0] == len(s.seq)]
    if not sources or not any((s.meta[:, 2] == 0).any() for s in sources):
        return None
    seq = np.concatenate([s.seq for s in sources]).astype(np.int64)
    meta = np.concatenate([s.meta for s in sources])
    prompt_id = np.concatenate([s.meta[:, 0].astype(np.int64) + (i << 32) for i, s in enumerate(sources)])
    fold = _prompt_folds(sources)
    ranks = [_layer_counts(seq[fold == f], n_layers, n_expert) for f in (0, 1)]
    # per fold and layer, the experts by the other fold's counts (most selected first, then lower id)
    orders = [[np.lexsort((np.arange(n_expert), -ranks[1 - f][layer])) for layer in range(n_layers)] for f in (0, 1)]
    uploads = np.zeros((n_layers, n_expert + 1))
    n_batches = n_tokens = 0
    prefill = meta[:, 2] == 0
    for pid in np.unique(prompt_id[prefill]):
        steps = np.flatnonzero(prefill & (prompt_id == pid))
        order = orders[int(fold[steps[0]])]
        for start in range(0, len(steps), ubatch):
            batch = seq[steps[start:start + ubatch]]  # [tokens, n_layers, k]
            n_batches += 1
            n_tokens += len(batch)
            for layer in range(n_layers):
                ids = batch[:, layer, :].ravel()
                used = np.zeros(n_expert, dtype=np.float64)
                used[ids[(ids >= 0) & (ids < n_expert)]] = 1.0
                ranked = used[order[layer]]
                uploads[layer] += np.concatenate([np.cumsum(ranked[::-1])[::-1], [0.0]])
    return uploads / n_tokens, n_batches / n_tokens


def distinct_after(hits: np.ndarray, n_expert_used: int, batches: list[int]) -> np.ndarray:
    """float [n_expert + 1]: the distinct experts ranked N or later (N = 0..n_expert) that batches of
    these many tokens pick, summed over the batches: the expert ranked r, of per-token probability p_r
    (the hit curve's step times n_expert_used), with chance 1 - (1 - p_r)^b in a batch of b tokens,
    tokens taken as independent draws (module docstring)."""
    p = np.clip(n_expert_used * np.diff(hits), 0.0, 1.0)  # per-token probability by rank
    picked = sum(1.0 - (1.0 - p) ** b for b in batches)
    return np.concatenate([np.cumsum(picked[::-1])[::-1], [0.0]])  # [N]: ranks N.. summed


def long_prompt_uploads(hits: np.ndarray, n_expert_used: int, prompt_tokens: int,
                        ubatch: int = PREFILL_UBATCH) -> tuple[np.ndarray, float]:
    """One layer's experts uploaded per prompt token with the top-N resident (float [n_expert + 1]),
    and prompt batches per prompt token, for prompts of `prompt_tokens` tokens cut into batches of
    `ubatch`: where the profile's prompts are shorter than the prompts a workload sends (its bundled
    prompts have at most 256 tokens), counted as for verification batches (distinct_after): a batch of
    512 picks nearly every expert of a layer, so a prompt of several batches uploads the experts without
    a slot once per batch, and a larger ubatch fewer times."""
    sizes = [ubatch] * (prompt_tokens // ubatch) + ([prompt_tokens % ubatch] if prompt_tokens % ubatch else [])
    return distinct_after(hits, n_expert_used, sizes) / prompt_tokens, len(sizes) / prompt_tokens


def slot_order(counts_decode: np.ndarray, counts_prefill: np.ndarray) -> np.ndarray:
    """The experts of one layer in the order llama-server fills its slots from a profile
    (common/moeplug-cache.cpp): most generated-token selections first, then most prompt-token
    selections, then the lower id."""
    ids = np.arange(len(counts_decode))
    return np.lexsort((ids, -np.asarray(counts_prefill), -np.asarray(counts_decode)))


def served_share(profile: Profile, slots_per_layer: list[int], counts: np.ndarray) -> list[float | None]:
    """Per MoE layer, the share of `counts` ([n_layers, n_expert]: selections of some traffic)
    that the slots a server holds from `profile` would have served; a whole layer serves all,
    a layer without slots none; None where the traffic has no selection."""
    out: list[float | None] = []
    for i, n in enumerate(slots_per_layer):
        total = float(counts[i].sum())
        if total <= 0:
            out.append(None)
            continue
        resident = slot_order(profile.counts_decode[i], profile.counts_prefill[i])[:n]
        out.append(float(counts[i][resident].sum()) / total)
    return out


def _unit_weights(layers: list[LayerCost], room: int) -> tuple[list[int], int]:
    """Each layer's bytes per expert in units of the smallest, and room in those units."""
    unit = min(layer.bytes_per_expert for layer in layers)
    weights = [max(1, round(layer.bytes_per_expert / unit)) for layer in layers]
    return weights, int(min(room // unit, sum(w * layer.n_expert for w, layer in zip(weights, layers))))


def _partly_resident_tails(layers: list[LayerCost], weights: list[int], budget: int) -> tuple[list, list]:
    """Dynamic programme from the last layer: best[i][b] is the least modelled time of layers i..
    with fewer slots than experts each, within b units; pick[i][b] the slots of layer i there."""
    best = [np.zeros(budget + 1) for _ in range(len(layers) + 1)]
    pick = [np.zeros(budget + 1, dtype=np.int32) for _ in layers]
    for i in range(len(layers) - 1, -1, -1):
        layer, w = layers[i], weights[i]
        n = np.arange(layer.n_expert)
        # between equal plans, slots go to the first of these layers, next to the whole ones
        cost = layer.seconds(n) + np.where(n > 0, TIE_BREAK_S * i, 0.0)
        nxt = np.full(budget + 1, np.inf)
        for slots in n[: budget // w + 1]:
            used = slots * w
            cand = best[i + 1][: budget + 1 - used] + cost[slots]
            better = cand < nxt[used:]
            nxt[used:][better] = cand[better]
            pick[i][used:][better] = slots
        best[i] = nxt
    return best, pick


def allocate(layers: list[LayerCost], room: int) -> list[int]:
    """Slots per layer whose bytes fit in room and minimise the modelled host time per token, the
    whole layers first and the partly resident ones after them."""
    if not layers:
        return []
    weights, budget = _unit_weights(layers, room)
    if budget <= 0:
        return [0] * len(layers)
    best, pick = _partly_resident_tails(layers, weights, budget)
    whole_units = np.concatenate([[0], np.cumsum([w * layer.n_expert for w, layer in zip(weights, layers)])])
    n_whole, least = 0, np.inf
    for k in range(len(layers) + 1):  # k whole layers; between equal plans the most
        if whole_units[k] > budget:
            break
        t = best[k][budget - whole_units[k]]
        if t <= least:
            n_whole, least = k, t

    slots_per_layer = [layer.n_expert for layer in layers[:n_whole]] + [0] * (len(layers) - n_whole)
    b = budget - int(whole_units[n_whole])
    for i in range(n_whole, len(layers)):
        slots_per_layer[i] = int(pick[i][b])
        b -= slots_per_layer[i] * weights[i]
    return slots_per_layer


def modelled_seconds(layers: list[LayerCost], slots_per_layer: list[int], stock: bool = False) -> float:
    """Modelled host-side time per step; stock: prompt batches on stock's path (a placement without
    the cache)."""
    return float(sum(layer.seconds(np.array(n), stock) for layer, n in zip(layers, slots_per_layer)))


def modelled_prompt_seconds(layers: list[LayerCost], slots_per_layer: list[int], stock: bool = False) -> float:
    """Modelled time the layers that are not whole add to prompt processing, per prompt token."""
    return float(sum(layer.prompt_token_seconds(np.array(n), stock) for layer, n in zip(layers, slots_per_layer)))


def stream_saving(layers: list[LayerCost], slots_per_layer: list[int], share: float) -> float:
    """Modelled host seconds per step that streaming this share of the partly resident layers'
    misses saves (negative: it costs): per layer, the CPU's misses run beside the GPU's instead of
    alone, and the GPU's pass adds its own time (constants above)."""
    saved = 0.0
    for layer, n in zip(layers, slots_per_layer):
        if not 0 < n < layer.n_expert:
            continue  # a whole layer misses nothing; a layer without slots has no cache to stream from
        c = layer.costs
        cpu = c.stream_cpu_scale * float(layer.missed_experts(np.array(n))) * layer.bytes_per_expert / c.cpu_expert_bytes_per_s
        saved += cpu - max((1.0 - share) * cpu, share * c.stream_gpu_ratio * cpu) - c.stream_layer_s
    return saved


def stream_share(layers: list[LayerCost], slots_per_layer: list[int]) -> tuple[float, float]:
    """The share of misses to stream (STREAM_SHARES, or 0) and its modelled saving per step: the
    share saving most, where that is at least CostModel.stream_min_saving of the modelled host time;
    none where the GPU's pass over a missed expert, its bytes over the bus, costs more than the CPU's.

    Measured: on the gpt-oss-20b shape at 25% (1.8 missed experts of 13 MB per layer and token)
    decode ran 60.2 t/s at 0.75, 54.2 at 1 and 48.3 without; at 50% (0.8 missed) 78.5 at 0.75 against
    82.6 without; with a draft (batches of 4) 61.1 at 0.75, 55.7 at 0.5, 46.0 without. The extra pass
    costs per layer, so streaming pays where a layer misses many bytes per step: large experts, few
    slots, verification batches."""
    if not layers or layers[0].costs.stream_gpu_ratio >= 1.0:
        return 0.0, 0.0  # the bus carries a miss slower than the CPU computes it: no share pays its bytes
    total = modelled_seconds([replace(layer, prefill=None) for layer in layers], slots_per_layer)  # decode's
    best = max(((stream_saving(layers, slots_per_layer, s), s) for s in STREAM_SHARES), default=(0.0, 0.0))
    if total <= 0 or best[0] < layers[0].costs.stream_min_saving * total:
        return 0.0, 0.0
    return best[1], best[0]


def allocate_against_stock(layers: list[LayerCost], room: int, stock_slots: list[int]) -> tuple[list[int], float]:
    """The slots for `room` (allocate()), or stock's placement where that is modelled no slower:
    stock_slots, the whole layers --fit keeps with the bytes the cache would spend on room and its
    copies ahead, run without the cache. Prompt batches may not get slower than stock's (by more than
    CostModel.prefill_guard_tolerance): where the slots allocate() spreads would make them so, the prompt weight
    is doubled until they do not (at most 2^PREFILL_GUARD_DOUBLINGS times), and where no weight keeps
    them, stock's placement is the plan. Returns the slots and the factor the prompt weight took (1: none needed).

    Why: decode and prefill trade where a budget leaves few layers in RAM. Slots spread over more
    layers than stock keeps in RAM save decode time, but each of those layers uploads the experts
    a prompt picks without a slot, and an unfamiliar prompt picks many (Qwen3 shape, 16 GiB, six
    partly resident layers against stock's three in RAM: unseen text prefill 0.93x of stock, one
    prompt 0.81x, for decode 1.03x; run 2026-12-02-server-rounds-vram). A prompt is answered
    after its prefill: moeplug does not buy decode speed with it."""
    slots, factor = allocate(layers, room), 1.0
    if any(layer.prefill is not None for layer in layers) and all(layer.prefill_weight > 0 for layer in layers):
        tolerance = layers[0].costs.prefill_guard_tolerance
        limit = modelled_prompt_seconds(layers, stock_slots, stock=True) * (1.0 + tolerance)
        while modelled_prompt_seconds(layers, slots) > limit and factor < 2.0 ** PREFILL_GUARD_DOUBLINGS:
            factor *= 2.0
            slots = allocate([replace(layer, prefill_weight=layer.prefill_weight * factor) for layer in layers], room)
        if modelled_prompt_seconds(layers, slots) > limit:
            return list(stock_slots), factor
    if modelled_seconds(layers, stock_slots, stock=True) <= modelled_seconds(layers, slots):
        return list(stock_slots), factor
    return slots, factor
