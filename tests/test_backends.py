"""One notion of backend (machine.backend): what each GPU backend can do, the plans made for a Vulkan
GPU (the cache's CUDA-only paths refused with their reason, never dropped without a word), GPUs as
llama.cpp lists them, and plans that do not rely on pinned host memory under WSL2 or where a server's
log showed it refused. The Vulkan build itself and the cache on it: tests/test_vulkan.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from helpers import plan_with, run_cli
from moeplug.core.errors import MoeplugError
from moeplug.core.sizes import GIB
from moeplug.machine.backend import Backend, backend
from moeplug.machine.devices import parse_devices
from moeplug.machine.probes import pinned_memory, pinned_refused, wsl
from moeplug.model.inspect import inspect_model
from moeplug.planner.record import Plan
from test_plan import big_expert_model, fixed_bytes, flat_wide_model

# what llama-server --list-devices printed for Mesa's lavapipe (GGML_VK_VISIBLE_DEVICES=0) and, on another
# machine, for an AMD card beside an RPC device
LAVAPIPE = """Available devices:
  Vulkan0: llvmpipe (LLVM 15.0.6, 256 bits) (23987 MiB, 21000 MiB free)
"""
AMD = """Available devices:
  RPC0: 127.0.0.1:50052 (24105 MiB, 24105 MiB free)
  Vulkan0: AMD Radeon RX 7600 (RADV NAVI33) (8176 MiB, 7962 MiB free)
"""


def test_a_backend_is_its_name_and_says_what_it_can() -> None:
    assert Backend.CUDA == "cuda" and backend("vulkan") is Backend.VULKAN and backend(None) is Backend.CPU
    assert json.dumps({"b": Backend.VULKAN}) == '{"b": "vulkan"}' and f"{Backend.CUDA}" == "cuda"
    assert Backend.CUDA.can_stream and Backend.CUDA.can_copy_ahead and Backend.CUDA.missing() == []
    assert Backend.VULKAN.gpu and not Backend.VULKAN.can_stream and not Backend.VULKAN.can_copy_ahead
    assert len(Backend.VULKAN.missing()) == 4 and not Backend.CPU.gpu and Backend.CPU.missing() == []
    assert (Backend.CUDA.device_prefix, Backend.VULKAN.device_prefix) == ("CUDA", "Vulkan")
    with pytest.raises(MoeplugError, match="backend 'metal': one of cpu, cuda, vulkan"):
        backend("metal")


def test_a_plan_record_keeps_its_backend_typed(tmp_path: Path, fixture_models) -> None:
    info = inspect_model(fixture_models["qwen3moe"])
    plan = plan_with(info, 2048, 1 << 40, backend=Backend.VULKAN)
    assert plan.backend is Backend.VULKAN
    doc = json.loads(json.dumps(plan.to_json()))
    assert doc["backend"] == "vulkan" and "device_env" not in doc
    assert Plan.from_json(doc).backend is Backend.VULKAN
    assert Plan.from_json(doc | {"backend": "cuda"}).backend is Backend.CUDA  # records of older moeplugs


def test_llama_cpp_lists_the_gpus_nvml_does_not_see() -> None:
    [lvp] = parse_devices(LAVAPIPE, Backend.VULKAN)
    assert (lvp.device, lvp.name, lvp.total_bytes, lvp.free_bytes) == ("Vulkan0", "llvmpipe (LLVM 15.0.6, 256 bits)",
                                                                      23987 << 20, 21000 << 20)
    assert lvp.used_bytes == (23987 - 21000) << 20 and lvp.compute_capability == ""
    [amd] = parse_devices(AMD, Backend.VULKAN)  # the remote device is not this machine's GPU
    assert amd.device == "Vulkan0" and amd.name == "AMD Radeon RX 7600 (RADV NAVI33)"
    assert parse_devices(AMD, Backend.CUDA) == []


def test_a_vulkan_plan_refuses_what_only_cuda_can_with_its_reason(tmp_path: Path) -> None:
    """A flat router missing many large experts: on CUDA the GPU streams a share of the misses and
    copies ahead; on Vulkan slots are planned with neither, the short-prompt flag left out, and the plan
    says why in its notes; the copies ahead asked for on Vulkan are a one-line error."""
    model, profile = flat_wide_model(tmp_path)
    info = inspect_model(model)
    budget = fixed_bytes(info, 2048) + 9 * info.expert_bytes // 10
    args = dict(profile=profile, ram_available=64 * GIB)
    cuda = plan_with(info, 2048, budget, tmp_path / "p.gguf", **args)
    assert cuda.backend is Backend.CUDA and "--moe-cache-stream" in cuda.server_args
    # without the copies ahead the same budget holds more slots, and streaming pays less: a smaller budget
    vk = plan_with(info, 2048, budget - 2 * info.expert_bytes // 10, tmp_path / "p.gguf", backend=Backend.VULKAN,
                   **args)
    assert vk.backend is Backend.VULKAN and any(0 < n < info.n_expert for n in vk.slots_per_layer)
    assert "--moe-cache-slots" in vk.server_args and "--moe-cache-stream" not in vk.server_args
    assert "--moe-cache-offload-min-batch" not in vk.server_args and vk.stream_share == 0
    assert not vk.copy_ahead and "--moe-cache-copy-ahead" not in vk.server_args  # a backend without them needs no switch
    assert any(n.startswith("no streamed misses (--moe-cache-stream)") and "Vulkan cannot yet" in n for n in vk.notes)
    [summary] = [n for n in vk.notes if n.startswith("on Vulkan the slots")]
    assert "not on Vulkan yet: streamed misses" in summary and "copies ahead" in summary
    with pytest.raises(MoeplugError, match="copies ahead: not on Vulkan yet"):
        plan_with(info, 2048, budget, tmp_path / "p.gguf", backend=Backend.VULKAN, copy_ahead=True, **args)


def test_a_software_vulkan_device_is_named_for_the_server(tmp_path: Path) -> None:
    model, profile = big_expert_model(tmp_path)
    info = inspect_model(model)
    env = (("GGML_VK_VISIBLE_DEVICES", "0"),)
    plan = plan_with(info, 2048, fixed_bytes(info, 2048) + 3 * info.expert_bytes // 4, tmp_path / "p.gguf",
                     profile=profile, backend=Backend.VULKAN, device_env=env, ram_available=64 * GIB)
    assert plan.server_env() == {"GGML_VK_VISIBLE_DEVICES": "0"}
    assert Plan.from_json(json.loads(json.dumps(plan.to_json()))).server_env() == {"GGML_VK_VISIBLE_DEVICES": "0"}


def test_two_vulkan_gpus_are_named_as_llama_cpp_names_them(tmp_path: Path) -> None:
    model, profile = big_expert_model(tmp_path)
    info = inspect_model(model)
    each = fixed_bytes(info, 2048) + info.expert_bytes // 2
    plan = plan_with(info, 2048, [each, each], tmp_path / "p.gguf", profile=profile, backend=Backend.VULKAN,
                     ram_available=64 * GIB)
    assert [d.device for d in plan.devices] == ["Vulkan0", "Vulkan1"]


def test_wsl2_is_read_from_the_kernel(tmp_path: Path) -> None:
    version = tmp_path / "version"
    version.write_text("Linux version 5.15.167.4-microsoft-standard-WSL2 (root@f9c826d3017f) (gcc (GCC) 11.2.0)\n")
    assert wsl(version)
    ok, note = pinned_memory(None, version)
    assert not ok and note.startswith("WSL2: pinned host memory is capped near 1 GiB")
    version.write_text("Linux version 6.1.0-28-amd64 (debian-kernel@lists.debian.org) (gcc-12 (Debian 12.2.0-14))\n")
    assert not wsl(version) and pinned_memory(None, version) == (True, "")
    assert not wsl(tmp_path / "missing")


def test_a_log_that_shows_pinned_memory_refused_is_kept(tmp_path: Path) -> None:
    log = ("load_tensors: loading model tensors, this can take a while... (mmap = false)\n"
           "ggml_vulkan: Failed to allocate pinned memory (vk::Device::allocateMemory: ErrorOutOfDeviceMemory)\n"
           "load_tensors:          CPU model buffer size =  1920.00 MiB\n")
    assert pinned_refused(log) == ("ggml_vulkan: Failed to allocate pinned memory (vk::Device::allocateMemory: "
                                   "ErrorOutOfDeviceMemory)")
    cuda = "ggml_cuda_host_malloc: failed to allocate 1920.00 MiB of pinned memory: out of memory\n"
    assert pinned_refused(cuda) == cuda.strip()
    assert pinned_refused("load_tensors: CUDA_Host model buffer size = 1920.00 MiB\n") is None
    marker = tmp_path / "pinned-memory-refused"
    marker.write_text(pinned_refused(log) + "\n")
    ok, note = pinned_memory(marker, tmp_path / "no-version")
    assert not ok and "Failed to allocate pinned memory" in note and str(marker) in note


def test_plans_without_pinned_memory_map_the_experts_and_stream_none(tmp_path: Path) -> None:
    """Under WSL2 (or after a refusal) the plan loads the experts memory-mapped, streams no misses though
    the GPU would, and says both in its notes."""
    model, profile = flat_wide_model(tmp_path)
    info = inspect_model(model)
    budget = fixed_bytes(info, 2048) + 9 * info.expert_bytes // 10
    note = "WSL2: pinned host memory is capped near 1 GiB, so the plan does not rely on it"
    plan = plan_with(info, 2048, budget, tmp_path / "p.gguf", profile=profile, ram_available=64 * GIB,
                     pinned=False, pinned_note=note)
    assert plan.load_mode == "mmap" and "-lm" not in plan.server_args and plan.stream_share == 0
    assert "--moe-cache-stream" not in plan.server_args and note in plan.notes
    assert any(n.startswith("no streamed misses") and "needs pinned host memory" in n for n in plan.notes)


def test_a_vulkan_build_without_its_tools_is_one_line(tmp_path: Path, monkeypatch) -> None:
    """`moeplug native build --vulkan` where glslc and the headers are missing: one line naming the
    Debian packages, exit 1, before anything is fetched or configured."""
    from moeplug.native import vulkan

    monkeypatch.setattr(vulkan, "INCLUDE_DIRS", (tmp_path,))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("VULKAN_SDK", raising=False)
    r = run_cli("native", "build", "--vulkan")
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "apt-get install libvulkan-dev spirv-headers glslc" in lines[0], r.stderr
    r = run_cli("native", "build", "--backend", "vulkan", "--sanitize")
    assert r.returncode == 1 and "sanitized builds are CPU builds (drop --vulkan)" in r.stderr
    r = run_cli("native", "build", "--backend", "metal")
    assert r.returncode == 2 and "invalid choice: 'metal'" in r.stderr
    assert os.environ.get("PATH") == str(tmp_path)
