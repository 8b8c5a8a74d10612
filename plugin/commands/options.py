"""The CLI's option types and shared options: every numeric option is range- and type-checked
here, at parse time, so a bad value is one line and exit 2 before anything runs or is written.

Each type is an argparse `type=` callable that says what it accepts (`describe()`); values
with a meaning of their own (0 jobs: one per core) are named in the option's help. What needs
the model (a context above its training context) is checked where the model is read
(`moeplug.planner.estimates.context_size`), with the same one-line error and exit code.
"""

from __future__ import annotations

import argparse
import math
import re
from typing import Any

from moeplug.core.errors import MoeplugError
from moeplug.machine.gpu import MAX_PLANNED_GPUS
from moeplug.core.sizes import parse_size

INT32_MAX = 2**31 - 1  # llama.cpp reads its counts into an int
UINT32_MAX = 2**32 - 1
MAX_BUDGET = 1 << 50  # 1 PiB: no GPU has more


class Number:
    """An int or float in [lo, hi] (finite)."""

    def __init__(self, kind: type, lo: float, hi: float, what: str) -> None:
        self.kind, self.lo, self.hi, self.what = kind, lo, hi, what
        self.__name__ = what  # argparse names the type in some messages

    def describe(self) -> str:
        kind = "an integer" if self.kind is int else "a number"
        return f"{kind} from {self.lo} to {self.hi}"

    def __call__(self, text: str) -> Any:
        try:
            value = self.kind(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected {self.what}, {self.describe()}; got {text!r}") from None
        if isinstance(value, float) and not math.isfinite(value) or not self.lo <= value <= self.hi:
            raise argparse.ArgumentTypeError(f"{text} is out of range: expected {self.what}, {self.describe()}")
        return value


class Size:
    """A byte size as people write it (12GiB, 8000MiB, 12G), positive, at most `hi` bytes."""

    def __init__(self, hi: int = MAX_BUDGET, what: str = "a size") -> None:
        self.hi, self.what = hi, what
        self.__name__ = what

    def describe(self) -> str:
        return "a positive size like 12GiB or 8000MiB"

    def __call__(self, text: str) -> int:
        try:
            value = parse_size(text)
        except MoeplugError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if not 0 < value <= self.hi:
            raise argparse.ArgumentTypeError(f"{text} is out of range: expected {self.describe()}, at most 1 PiB")
        return value


class Budgets:
    """--vram-budget: one size (one GPU, an int) or one per GPU in CUDA device order (12GiB,12GiB: a
    list); at most as many as the planner splits layers over."""

    MAX_GPUS = MAX_PLANNED_GPUS

    def __init__(self) -> None:
        self.item = Size(what="a VRAM budget")
        self.__name__ = "a VRAM budget"

    def describe(self) -> str:
        return f"{self.item.describe()}, or one per GPU like 12GiB,12GiB (at most {self.MAX_GPUS})"

    def __call__(self, text: str) -> int | list[int]:
        parts = text.split(",")
        if len(parts) == 1:
            return self.item(text)
        if any(not p.strip() for p in parts):
            raise argparse.ArgumentTypeError(f"{text!r} has an empty budget: expected {self.describe()}")
        if len(parts) > self.MAX_GPUS:
            raise argparse.ArgumentTypeError(f"{text!r} gives {len(parts)} budgets: moeplug plans at most "
                                             f"{self.MAX_GPUS} GPUs (one budget each)")
        return [self.item(p.strip()) for p in parts]


class RpcHosts:
    """--rpc: the rpc-servers whose devices hold layers, HOST:PORT comma-separated (machine.rpc), as
    endpoints; "none": no remote device (an installed model's dropped)."""

    __name__ = "rpc-servers"

    def __call__(self, text: str) -> tuple[str, ...]:
        from moeplug.machine.rpc import parse_rpc

        if text.strip().lower() == "none":
            return ()
        try:
            return tuple(h.endpoint for h in parse_rpc(text))
        except MoeplugError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix("--rpc ")) from None


class RpcBudgets:
    """--rpc-budget: one size per remote device, in llama.cpp's order (RPC0, RPC1, ...)."""

    __name__ = "remote budgets"

    def __init__(self) -> None:
        self.item = Size(what="a remote device's budget")

    def __call__(self, text: str) -> list[int]:
        parts = text.split(",")
        if any(not p.strip() for p in parts):
            raise argparse.ArgumentTypeError(f"{text!r} has an empty budget: expected one size per remote device, "
                                             f"like 20GiB,8GiB")
        return [self.item(p.strip()) for p in parts]


class IntList:
    """Comma-separated integers in [lo, hi], returned sorted and without repeats (e.g. 8,16,32)."""

    def __init__(self, lo: int, hi: int, what: str) -> None:
        self.item = Number(int, lo, hi, what)
        self.__name__ = what

    def describe(self) -> str:
        return f"comma-separated {self.item.describe().replace('an integer', 'integers')}"

    def __call__(self, text: str) -> list[int]:
        parts = [p for p in text.split(",") if p.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"expected {self.describe()}, got {text!r}")
        return sorted({self.item(p) for p in parts})


class CudaArch:
    """A CUDA architecture as CMake takes it: 90, 89, 120a."""

    __name__ = "a CUDA architecture"
    _RE = re.compile(r"^[1-9]\d{1,2}[af]?$")

    def describe(self) -> str:
        return "a CUDA architecture like 90 or 120a"

    def __call__(self, text: str) -> str:
        if not self._RE.match(text):
            raise argparse.ArgumentTypeError(f"expected {self.describe()}, got {text!r}")
        return text


# what the commands take
CTX = Number(int, 1, INT32_MAX, "a context size in tokens")
PORT = Number(int, 1, 65535, "a TCP port")
JOBS = Number(int, 0, 4096, "a number of compile jobs")
THREADS = Number(int, 1, 4096, "a number of threads")
TOKENS = Number(int, 0, INT32_MAX, "a number of tokens")
COUNT = Number(int, 1, INT32_MAX, "a count")
LAYERS = Number(int, 0, INT32_MAX, "a number of layers")
SEED = Number(int, 0, UINT32_MAX, "a seed")
TEMPERATURE = Number(float, 0.0, 100.0, "a temperature")
SLOTS = IntList(1, INT32_MAX, "slot counts")
EXPERTS = Number(int, 1, 1 << 16, "a number of experts")
TTL = Number(int, 0, INT32_MAX, "a number of seconds")
SECONDS = Number(float, 0.01, 86400.0, "a number of seconds")
HALF_LIFE = Number(int, 1, 2**53, "a half-life in tokens")
GAIN = Number(float, 0.0, 1.0, "a share of expert selections")
IDLE_SECONDS = Number(float, 0.0, 86400.0, "a number of seconds")
DRAFT_TOKENS = Number(int, 1, 1024, "a number of draft tokens")
PREFILL_WEIGHT = Number(float, 0.0, 1000.0, "prompt tokens per generated token")
SERVER_THREADS = Number(int, 0, 1024, "a number of threads (0: llama.cpp's default)")
ROUNDS = Number(int, 1, 100, "a number of rounds")
REPEATS = Number(int, 1, 32, "a number of requests")
GENERATE = Number(int, 1, 4096, "a number of tokens to generate")
PROMPT_CAP = Number(int, 0, 100000, "a number of prompts")
CONCURRENT = Number(int, 2, 64, "a number of prompts sent at once")
SHORT_PROMPT = Number(int, 1, 4096, "a prompt length in tokens")
BUDGET = Budgets()
CUDA_ARCH = CudaArch()

NUMERIC_TYPES = (Number, Size, Budgets, IntList, CudaArch)


# ---------------------------------------------------------------------------------------------
# options more than one command takes


def add_json(p: argparse.ArgumentParser, help: str = "machine-readable output") -> None:
    p.add_argument("--json", action="store_true", help=help)


def add_backend(p: argparse.ArgumentParser, what: str = "build") -> None:
    """--cpu | --cuda | --vulkan | --backend NAME -> args.backend ("cpu", "cuda", "vulkan" or None: CUDA
    when nvcc and a GPU are here, else the CPU)."""
    from moeplug.machine.backend import Backend

    group = p.add_mutually_exclusive_group()
    group.add_argument("--cpu", dest="backend", action="store_const", const="cpu", help=f"force a CPU {what}")
    group.add_argument("--cuda", dest="backend", action="store_const", const="cuda", help=f"force a CUDA {what}")
    group.add_argument("--vulkan", dest="backend", action="store_const", const="vulkan",
                       help=f"a Vulkan {what} (AMD, Intel or NVIDIA GPUs; Mesa's lavapipe without one)")
    group.add_argument("--backend", dest="backend", choices=[b.value for b in Backend],
                       help=f"the {what}'s backend (default: CUDA when nvcc and a GPU are here, else the CPU)")
    p.set_defaults(backend=None)


def add_ctx(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--ctx", type=CTX, help=help)
    p.add_argument("--ctx-override", action="store_true",
                   help="allow a --ctx above the model's training context")


def add_plan_options(p: argparse.ArgumentParser, budget_help: str, ctx_help: str) -> None:
    p.add_argument("--vram-budget", type=BUDGET, help=budget_help)
    add_ctx(p, ctx_help)
    p.add_argument("--calibration", metavar="FILE", default=None,
                   help="plan with the costs in this calibration file (what 'moeplug calibrate' writes, or one "
                        "written by hand to plan for another machine; default: this machine's own calibration, "
                        "else the GPU machine's fitted figures); kept with an installed model's plan")
    p.add_argument("--rpc", type=RpcHosts(), metavar="HOST:PORT[,...]", default=None,
                   help="llama.cpp rpc-servers on other machines ('moeplug rpc-server' there) whose devices hold "
                        "layers: whole layers, before this machine's GPU; 'none' drops them (kept with an installed "
                        "model's plan)")
    p.add_argument("--rpc-budget", type=RpcBudgets(), metavar="SIZE[,...]", default=None,
                   help="what each remote device may hold, in the order of --rpc (default: its free memory)")


def listen_address(text: str) -> str:
    """--host: an IP address (a name would be resolved who knows where)."""
    import ipaddress

    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an IP address (e.g. 127.0.0.1, 0.0.0.0, ::1)") from None


def add_serve_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=PORT, help="port, 1-65535 (default: a free one)")
    p.add_argument("--host", type=listen_address, default=None,
                   help="address llama-server listens on (default 127.0.0.1: this machine only; any other is "
                        "reachable from elsewhere, without an API key: a warning says so)")
    p.add_argument("--allow-fallback", action="store_true", help="serve without the cache when it cannot engage")
    p.add_argument("--metrics", action=argparse.BooleanOptionalAction, default=True,
                   help="count slot hits on llama-server's /metrics ('moeplug status' and the dashboard show the "
                        "measured hit rate; costs a small read per MoE layer and batch); on by default, "
                        "--no-metrics turns it off")
    p.add_argument("--record", action=argparse.BooleanOptionalAction, default=None,
                   help="count the router's selections (llama-server --moe-cache-record) for 'moeplug reprofile', "
                        "which learns the served traffic's routing from them (cost within noise on a GPU); on by "
                        "default where the build has it, --no-record turns it off ('moeplug reprofile --all' then "
                        "skips the model while it is served)")


def add_prefill_weight(p: argparse.ArgumentParser, keep: bool = False) -> None:
    """--prefill-weight W: prompt tokens per generated token the plan weighs (allocate.py)."""
    default = "the installed plan's" if keep else "1"
    p.add_argument("--prefill-weight", type=PREFILL_WEIGHT, default=None, metavar="W",
                   help=f"prompt tokens per generated token to plan for, 0-1000: prompt batches upload the experts "
                        f"of every layer that is not whole (default: {default}; 0: decode only)")


def add_threads(p: argparse.ArgumentParser, keep: bool = False) -> None:
    """--threads N: the server's CPU threads (plan.server_threads)."""
    default = "the installed plan's choice" if keep else "half the physical cores where at most a quarter of the MoE " \
                                                          "layers are partly resident, on 8 cores or more; else llama.cpp's"
    p.add_argument("--threads", "-t", type=SERVER_THREADS, default=None, metavar="N",
                   help=f"CPU threads of the server, 0-1024 (0: llama.cpp's default, a thread per physical core; "
                        f"default: {default})")


def add_spec_options(p: argparse.ArgumentParser, shorthands: bool = False, keep: bool = False) -> None:
    """--spec draft:PATH|mtp|ngram|none and --spec-draft-max N (checked where the plan is made:
    moeplug.planner.speculation); shorthands: also --draft PATH and --mtp; keep: a model's installed
    speculation stays unless --spec is given."""
    group = p.add_mutually_exclusive_group()
    default = "the installed model's" if keep else "none"
    group.add_argument("--spec", metavar="draft:PATH|mtp|ngram|none",
                       help=f"speculative decoding: a draft model (all on the GPU), the model's MTP (NextN) head, or "
                            f"n-gram drafts; its VRAM is planned for (default: {default})")
    if shorthands:
        group.add_argument("--draft", metavar="DRAFT.gguf", help="the same as --spec draft:DRAFT.gguf")
        group.add_argument("--mtp", action="store_true", help="the same as --spec mtp")
    p.add_argument("--spec-draft-max", type=DRAFT_TOKENS,
                   help="tokens drafted per step, 1-1024 (default: llama.cpp's, 3 for a draft model or MTP head, "
                        "48 for n-grams)")
