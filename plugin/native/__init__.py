"""The native half: a pinned llama.cpp, our patch series, and builds of it.

    from moeplug.native import resolve_options, build
    result = build(resolve_options(backend="cpu", stock=False, jobs=0, cuda_arch=None))
    result.binary("llama-server")
"""

from moeplug.native.build import BuildOptions, BuildResult, build, installed_builds, resolve_options
from moeplug.native.features import detect_features
from moeplug.native.lock import NativeSpec, load_spec

__all__ = ["BuildOptions", "BuildResult", "NativeSpec", "build", "detect_features", "installed_builds",
           "load_spec", "resolve_options"]
