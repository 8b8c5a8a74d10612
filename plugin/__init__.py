"""moeplug: profiled expert slots for Mixture-of-Experts models on llama.cpp.

The library is usable without the CLI: `moeplug.model.inspect.inspect_model`,
`moeplug.model.synth.make_model`, `moeplug.native.build`.
"""

__version__ = "0.1.0"
