"""Golden plans: a fixed set of planning requests and the plans they give, committed as JSON.

The planner's arithmetic is spread over many functions; a change that means to move code without
changing behaviour must leave every plan here the same (its JSON, its server arguments and its
environment): exactly in its integers, flags, bytes and names, and in its modelled floats to the
precision golden_floats.py states (9 significant digits written, compared to one unit in the
last), since their last bits differ between CPUs. A change that means to change plans rewrites the
files on purpose:

    .venv/bin/python tests/test_golden_plans.py --write

and the diff of tests/golden/plans/ is the review of what it changed.

The models are written header-only (sparse files: the planner and the profile's fingerprint read
the GGUF header and tensor table, never the weights), so the full Qwen3-30B-A3B and gpt-oss-20b
shapes cost nothing on disk. The routing is made by integer arithmetic, not a random generator,
so it stays the same across numpy versions. No native build, no GPU: the machine's facts are
fixed in each case.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from golden_floats import ABS_TOL, differences, rounded

from moeplug.planner.fit_estimate import DeviceNeed
from moeplug.model.inspect import inspect_model
from moeplug.planner.plan import make_plan
from moeplug.planner.record import Plan
from moeplug.planner.request import MachineFacts, PlanRequest
from moeplug.profile.format import PHASE_DECODE, PHASE_PREFILL, Profile, ProfileSource, model_fingerprint, \
    write_profile
from moeplug.core.sizes import GIB, MIB
from moeplug.planner.speculation import Speculation
from moeplug.model.synth import ModelSpec, shape_spec

GOLDEN = Path(__file__).with_name("golden") / "plans"
ROOT_MARK = "$ROOT"


def write_header_only(spec: ModelSpec, out: Path) -> Path:
    """The model's GGUF header and tensor table as make_model writes them, the data left a hole and
    the tokenizer the built-in one unpadded (a padded 200k-token vocabulary takes the GGUF reader
    seconds; the planner reads the vocabulary's size from the token embeddings' shape)."""
    from moeplug.model.synth import header_writer
    from moeplug.model.synth.archs import plan_model
    from moeplug.model.synth.vocab import builtin_vocab

    vocab = builtin_vocab()
    plan = plan_model(spec, spec.vocab_size or len(vocab))
    writer = header_writer(spec, plan, vocab, out)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    align = 32
    size = out.stat().st_size
    size += -size % align
    size += sum(t.n_bytes + (-t.n_bytes % align) for t in plan.tensors)
    with open(out, "r+b") as f:
        f.truncate(size)
    return out


def mix32(values: list[np.ndarray | int]) -> np.ndarray:
    """A 32-bit hash of small integers (multiply-xorshift rounds), elementwise: uniform enough to
    stand for a draw, and the same on every machine."""
    mask = np.uint64(0xFFFFFFFF)
    x = np.full(np.shape(values[0]), 0x9E3779B9, dtype=np.uint64)
    for v in values:
        x = ((x ^ (np.asarray(v, dtype=np.uint64) & mask)) * np.uint64(0x85EBCA6B)) & mask
        x ^= x >> np.uint64(13)
        x = (x * np.uint64(0xC2B2AE35)) & mask
        x ^= x >> np.uint64(16)
    return x


def routing(n_tokens: int, n_layer: int, n_expert: int, used: int, salt: int, draws: int = 64) -> np.ndarray:
    """[n_tokens, n_layer, used] distinct expert ids per token, Zipf-skewed over a per-layer order,
    from integer hashing alone (no random generator): each token takes its first `used` distinct
    draws, and the lowest ids it lacks where the draws run out."""
    weights = 1.0 / np.arange(1, n_expert + 1) ** 1.1
    cdf = np.cumsum(weights) / weights.sum()
    tokens = np.arange(n_tokens)
    out = np.zeros((n_tokens, n_layer, used), dtype=np.int16)
    for layer in range(n_layer):
        step = next(s for s in range(2 * layer + 3, 10 * n_expert) if math.gcd(s, n_expert) == 1)
        order = (step * np.arange(n_expert) + layer * 7 + salt) % n_expert
        taken = np.zeros((n_tokens, n_expert), dtype=bool)
        picks = np.full((n_tokens, used), -1, dtype=np.int64)
        count = np.zeros(n_tokens, dtype=np.int64)
        for i in range(draws):
            u = mix32([tokens, layer, i, salt]).astype(np.float64) / float(1 << 32)
            e = order[np.minimum(np.searchsorted(cdf, u, side="right"), n_expert - 1)]
            new = ~taken[tokens, e] & (count < used)
            picks[tokens[new], count[new]] = e[new]
            taken[tokens[new], e[new]] = True
            count += new
        for t in np.flatnonzero(count < used):
            free = np.flatnonzero(~taken[t])[:used - count[t]]
            picks[t, count[t]:] = free
        out[:, layer] = picks
    return out


def write_profile_for(model: Path, n_trunk: int, out: Path, prompts: int = 6, prompt_len: int = 24,
                      decode_len: int = 16, salt: int = 1) -> Path:
    """A profile of `model` with prompt and decode steps over its first n_trunk MoE layers."""
    from moeplug.profile.from_trace import _down_tensors

    fp = model_fingerprint(model)
    tensors = _down_tensors(fp.expert_tensors)
    per_prompt = prompt_len + decode_len
    n = prompts * per_prompt
    seq = np.full((n, len(tensors), fp.n_expert_used), -1, dtype=np.int16)
    seq[:, :n_trunk] = routing(n, n_trunk, fp.n_expert, fp.n_expert_used, salt)
    meta = np.array([[t // per_prompt, t % per_prompt, PHASE_PREFILL if t % per_prompt < prompt_len else PHASE_DECODE]
                     for t in range(n)], dtype=np.int32)
    counts = {phase: np.zeros((len(tensors), fp.n_expert), dtype=np.int64) for phase in (PHASE_PREFILL, PHASE_DECODE)}
    for t in range(n):
        for row in range(n_trunk):
            for e in seq[t, row]:
                counts[int(meta[t, 2])][row, e] += 1
    source = ProfileSource(label="golden", prompt_labels=[f"prompt {p}" for p in range(prompts)], seq=seq, meta=meta,
                           n_predict=decode_len)
    profile = Profile(fingerprint=fp, tensors=tensors, counts_prefill=counts[PHASE_PREFILL],
                      counts_decode=counts[PHASE_DECODE], sources=[source])
    return write_profile(profile, out)


MODELS: dict[str, tuple[ModelSpec, int]] = {  # name: (spec, MoE layers of the trunk)
    "demo": (ModelSpec(arch="qwen3moe", layers=4, experts=32, used=4, embd=256, expert_ff=256, dtype="q8_0",
                       seed=1234, name="moeplug-demo-qwen3moe"), 4),
    "qwen3": (shape_spec("qwen3-30b-a3b"), 48),
    "gptoss": (shape_spec("gpt-oss-20b"), 24),
    "hyv3-mtp": (ModelSpec(arch="hy_v3", layers=6, experts=16, used=2, embd=256, expert_ff=256, heads=4, heads_kv=2,
                           head_dim=64, dtype="q8_0", seed=7, mtp_layers=1), 6),
    "draft": (ModelSpec(arch="qwen3moe", layers=2, experts=8, used=2, embd=256, expert_ff=256, heads=4, heads_kv=2,
                        head_dim=64, dtype="q8_0", seed=11, name="golden-draft"), 2),
}
GPT_OSS_EXPERTS = 24 * 32 * 3 * 2880 * 2880 // 32 * 17  # the gpt-oss-20b shape's expert matrices (test_shapes)


@dataclass(frozen=True)
class Case:
    """One planning request: the model, its context and budget, and make_plan's other choices."""

    name: str
    model: str
    budget: int | list[int] | None
    ctx: int = 4096
    profile: bool = True
    options: dict[str, Any] = field(default_factory=dict)
    spec: str | None = None  # "ngram", "mtp" or "draft" (the golden draft model)
    need: tuple[int, int, int] | None = None  # llama.cpp's fit figure (model, context, compute), MiB


CASES = [
    Case("demo-no-gpu", "demo", None, options=dict(slots_in_ram=8)),
    Case("demo-no-gpu-no-profile", "demo", None, profile=False),
    Case("demo-1gib", "demo", 1 * GIB),
    Case("qwen3-8gib", "qwen3", 8 * GIB),
    Case("qwen3-12gib", "qwen3", 12 * GIB),
    Case("qwen3-16gib", "qwen3", 16 * GIB),
    Case("qwen3-12gib-no-profile", "qwen3", 12 * GIB, profile=False),
    Case("qwen3-12gib-static", "qwen3", 12 * GIB, options=dict(policy="static")),
    Case("qwen3-12gib-decode-only", "qwen3", 12 * GIB, options=dict(prefill_weight=0.0)),
    Case("qwen3-12gib-no-copy-ahead", "qwen3", 12 * GIB, options=dict(copy_ahead=False)),
    Case("qwen3-16gib-16-cores", "qwen3", 16 * GIB, options=dict(cpu_cores=16)),
    Case("qwen3-12gib-threads-6", "qwen3", 12 * GIB, options=dict(cpu_cores=16, threads=6)),
    Case("qwen3-12gib-little-ram", "qwen3", 12 * GIB, options=dict(ram_available=8 * GIB)),
    Case("qwen3-12gib-long-prompts", "qwen3", 12 * GIB, options=dict(prompt_tokens=4096, prefill_weight=8.0)),
    Case("qwen3-12gib-ubatch-1024", "qwen3", 12 * GIB, options=dict(ubatch=1024, prompt_tokens=2048)),
    Case("qwen3-12gib-fit-figure", "qwen3", 12 * GIB, need=(1100, 400, 300)),
    Case("qwen3-12gib-expert-room", "qwen3", 12 * GIB, options=dict(expert_room=10 * GIB)),
    Case("qwen3-ctx-32k", "qwen3", 12 * GIB, ctx=32768),
    Case("qwen3-full", "qwen3", 40 * GIB),
    Case("qwen3-too-small", "qwen3", 2 * GIB),
    Case("qwen3-two-gpus", "qwen3", [6 * GIB, 6 * GIB]),
    Case("qwen3-two-gpus-uneven", "qwen3", [8 * GIB, 4 * GIB]),
    Case("qwen3-two-gpus-no-profile", "qwen3", [6 * GIB, 6 * GIB], profile=False),
    Case("qwen3-12gib-ngram", "qwen3", 12 * GIB, spec="ngram"),
    Case("qwen3-12gib-draft", "qwen3", 12 * GIB, spec="draft"),
    Case("gptoss-7gib", "gptoss", 7 * GIB),
    Case("gptoss-10gib", "gptoss", 10 * GIB),
    Case("gptoss-10gib-long-prompts", "gptoss", 10 * GIB, options=dict(prompt_tokens=3000, prefill_weight=4.0)),
    Case("gptoss-6gib", "gptoss", 6 * GIB),
    Case("gptoss-8gib-16-cores", "gptoss", 8 * GIB, options=dict(cpu_cores=16)),
    Case("gptoss-two-gpus", "gptoss", [4 * GIB, 4 * GIB]),
    Case("hyv3-mtp-spec", "hyv3-mtp", 1 * GIB, spec="mtp"),
    Case("hyv3-mtp-no-spec", "hyv3-mtp", 1 * GIB),
    Case("hyv3-mtp-partial", "hyv3-mtp", 1000 * MIB, spec="mtp"),
]


def build_inputs(root: Path) -> dict[str, tuple[Path, Path]]:
    """Each model (header-only) and its profile, under root."""
    out = {}
    for name, (spec, n_trunk) in MODELS.items():
        model = write_header_only(spec, root / f"{name}.gguf")
        out[name] = (model, write_profile_for(model, n_trunk, root / f"{name}.moeprof", salt=len(name)))
    return out


def speculation(kind: str | None, inputs: dict[str, tuple[Path, Path]]) -> Speculation | None:
    if kind is None:
        return None
    return Speculation(kind, draft=str(inputs["draft"][0])) if kind == "draft" else Speculation(kind)


def plan_case(case: Case, inputs: dict[str, tuple[Path, Path]]) -> Plan | str:
    """The plan a case asks for, or the one-line error the planner gives."""
    from moeplug.core.errors import MoeplugError

    model, profile = inputs[case.model]
    need = DeviceNeed("CUDA0", *(v * MIB for v in case.need)) if case.need else None
    options = dict(ram_available=64 * GIB) | case.options
    facts = {k: options.pop(k) for k in ("ram_available", "cpu_cores", "expert_room") if k in options}
    request = PlanRequest(case.ctx, case.budget, spec=speculation(case.spec, inputs), **options)
    try:
        return make_plan(inspect_model(model), request, MachineFacts(need=need, **facts),
                         profile_path=profile if case.profile else None)
    except MoeplugError as exc:
        return f"error: {exc}"


def plan_doc(case: Case, inputs: dict[str, tuple[Path, Path]], root: Path) -> dict[str, Any]:
    """What a case gives, as parsed JSON: the plan's JSON, its server arguments and environment (or
    the planner's error), the temporary folder's path written as $ROOT; its floats unrounded."""
    plan = plan_case(case, inputs)
    doc: dict[str, Any] = ({"error": plan} if isinstance(plan, str) else
                           {"plan": plan.to_json(), "server_args": plan.server_args, "server_env": plan.server_env()})
    marked: dict[str, Any] = json.loads(json.dumps(doc).replace(str(root), ROOT_MARK))
    return marked


def golden_text(doc: dict[str, Any]) -> str:
    """What is committed for a case: its document, the floats rounded as golden_floats writes them."""
    return json.dumps(rounded(doc), indent=1, sort_keys=True) + "\n"


def golden_doc(case: Case) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((GOLDEN / f"{case.name}.json").read_text())
    return doc


def check_golden(case: Case, doc: dict[str, Any]) -> None:
    """The golden comparison: doc is the committed plan of case, to golden_floats' precision."""
    found = differences(golden_doc(case), doc)
    shown = "\n  ".join(found[:20]) + (f"\n  ... {len(found) - 20} more" if len(found) > 20 else "")
    assert not found, (f"the plan for {case.name} changed:\n  {shown}\n"
                       "if on purpose, run 'python tests/test_golden_plans.py --write'")


@dataclass
class Planned:
    """The golden models and profiles under root, and each case's document, planned once."""

    root: Path
    inputs: dict[str, tuple[Path, Path]]
    docs: dict[str, dict[str, Any]] = field(default_factory=dict)

    def doc(self, case: Case) -> dict[str, Any]:
        """A fresh copy of the case's document (a test may change it)."""
        if case.name not in self.docs:
            self.docs[case.name] = plan_doc(case, self.inputs, self.root)
        copy: dict[str, Any] = json.loads(json.dumps(self.docs[case.name]))
        return copy


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> Planned:
    root = tmp_path_factory.mktemp("golden")
    return Planned(root, build_inputs(root))


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_plan_is_the_golden_one(case: Case, planned: Planned) -> None:
    check_golden(case, planned.doc(case))


def nudged(doc: Any, ulps: list[int]) -> Any:
    """doc with every float moved by a few units in its last place (one step of math.nextafter
    each), in turn up and down by 1 to 8 ulps; ulps collects the steps taken."""
    if isinstance(doc, float):
        steps = (len(ulps) % 8 + 1) * (-1) ** len(ulps)
        ulps.append(steps)
        for _ in range(abs(steps)):
            doc = math.nextafter(doc, math.inf if steps > 0 else -math.inf)
        return doc
    if isinstance(doc, list):
        return [nudged(v, ulps) for v in doc]
    if isinstance(doc, dict):
        return {k: nudged(doc[k], ulps) for k in sorted(doc)}
    return doc


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_last_bit_difference_is_the_golden_plan(case: Case, planned: Planned) -> None:
    """The modelled floats moved in their last 1-4 bits, as another CPU's summation moves them: the
    plan is still the golden one, where a comparison of the text would fail."""
    doc = planned.doc(case)
    ulps: list[int] = []
    moved = nudged(doc, ulps)
    if not ulps:
        assert "error" in doc  # a planner error: no floats
        return
    assert json.dumps(moved) != json.dumps(doc)
    check_golden(case, moved)


DRAFT = next(c for c in CASES if c.name == "qwen3-12gib-draft")  # the case that failed on another CPU


def _args(doc: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """The server arguments as the document holds them twice: in the plan and beside it."""
    return [("plan.server_args", doc["plan"]["server_args"]), ("server_args", doc["server_args"])]


def _set_flag(flag: str, value: str) -> Callable[[dict[str, Any]], list[str]]:
    def edit(doc: dict[str, Any]) -> list[str]:
        places = []
        for where, args in _args(doc):
            i = args.index(flag) + 1
            args[i] = value
            places.append(f"{where}[{i}]")
        return places
    return edit


def _drop_flag(flag: str) -> Callable[[dict[str, Any]], list[str]]:
    def edit(doc: dict[str, Any]) -> list[str]:
        for _, args in _args(doc):
            i = args.index(flag)
            del args[i:i + 2]
        return [where for where, _ in _args(doc)]
    return edit


def _set(key: str, change: Callable[[Any], Any]) -> Callable[[dict[str, Any]], list[str]]:
    def edit(doc: dict[str, Any]) -> list[str]:
        doc["plan"][key] = change(doc["plan"][key])
        return [f"plan.{key}"]
    return edit


def _slot_more(doc: dict[str, Any]) -> list[str]:
    doc["plan"]["slots_per_layer"][20] += 1
    return ["plan.slots_per_layer[20]"]


CHANGES: dict[str, Callable[[dict[str, Any]], list[str]]] = {  # a change, and the places it changed
    "a slot count": _slot_more,
    "the cache policy flag": _set_flag("--moe-cache-policy", "static"),
    "a flag's number": _set_flag("--moe-cache-uploads", "7"),
    "a flag dropped": _drop_flag("--moe-cache-offload-min-batch"),
    "copy-ahead off": _set("copy_ahead", lambda v: not v),
    "one byte": _set("expert_vram_bytes", lambda v: v + 1),
    "a modelled time by 1e-7": _set("modelled_host_ms", lambda v: v * (1 + 1e-7)),
    "an integer written as a float": _set("stock_ncmoe", float),
}


@pytest.mark.parametrize("change", CHANGES, ids=list(CHANGES))
def test_a_real_change_is_not_the_golden_plan(change: str, planned: Planned) -> None:
    """A slot count, a flag, a byte or a modelled float beyond the stated precision changed in the
    real plan, its floats nudged in their last bits as well: the comparison fails and names each
    place changed, and only those."""
    doc = planned.doc(DRAFT)
    places = CHANGES[change](doc)
    found = differences(golden_doc(DRAFT), nudged(doc, []))
    assert [d.split(": ", 1)[0] for d in found] == places, found
    with pytest.raises(AssertionError, match=re.escape(places[0])):
        check_golden(DRAFT, doc)


def test_a_rounding_boundary_is_no_difference() -> None:
    """Two values on either side of a 9th-digit rounding boundary write different last digits; each
    still compares equal to the other's written form; two units off in the 9th digit do not, nor does
    a difference from zero above ABS_TOL."""
    low, high = 0.1234567885, math.nextafter(0.1234567885, 1.0)
    written = rounded([low, high])
    assert written[0] != written[1]
    assert differences(written, [high, low]) == []
    assert differences([0.123456789], [0.123456791]) != []
    assert differences([0.0], [1e-16]) == [] and differences([0.0], [10 * ABS_TOL]) != []
    # qwen3-12gib-draft's modelled host time, written on one CPU and computed on an AMD EPYC
    assert differences(rounded([14.806614713968257]), [14.806614713968253]) == []


def test_every_golden_file_has_a_case() -> None:
    assert sorted(p.stem for p in GOLDEN.glob("*.json")) == sorted(c.name for c in CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_golden_files_are_as_written(case: Case) -> None:
    """Each file is what --write writes: its floats to the written precision, nothing edited by hand."""
    text = (GOLDEN / f"{case.name}.json").read_text()
    assert golden_text(json.loads(text)) == text


def test_header_only_models_read_as_the_full_shape(planned: Planned) -> None:
    info = inspect_model(planned.inputs["gptoss"][0])
    weights = sum(t.n_bytes for t in info.tensors if t.name.endswith("_exps.weight"))
    assert weights == GPT_OSS_EXPERTS and len(info.layers) == 24
    assert planned.inputs["gptoss"][0].stat().st_blocks * 512 < 64 * MIB  # a hole, not 13 GiB of zeros


def main(argv: list[str]) -> int:
    import tempfile

    if argv != ["--write"]:
        print("usage: python tests/test_golden_plans.py --write", file=sys.stderr)
        return 2
    GOLDEN.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        inputs = build_inputs(root)
        for case in CASES:
            (GOLDEN / f"{case.name}.json").write_text(golden_text(plan_doc(case, inputs, root)))
    print(f"wrote {len(CASES)} golden plans to {GOLDEN}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
