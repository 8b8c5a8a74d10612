"""Hooks for model-swap proxies: moeplug's installed models as llama-server router presets
(`--models-preset`) and llama-swap config fragments, kept in step with the installed plans.

One module per target (`llama_server_presets`, `llama_swap`, `ollama`), each a pure function from
the installed models to a fragment plus an atomic writer; `plan_files` writes each model's plan as
the file the engine reads (which the targets' entries name, and Ollama's runners find), `command`
what a proxy starts, `store` records which hooks moeplug maintains, `maintain` regenerates them
(install, re-plan, profile change, model removal) and `watch` does the same when the model store or
the profiles change behind moeplug's back.
"""

from moeplug.hooks.maintain import refresh_hooks

__all__ = ["refresh_hooks"]
