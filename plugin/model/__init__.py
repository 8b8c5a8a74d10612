"""The model: GGUF inspection, model references and downloads, llama.cpp's architectures, synthetic models, the demo."""
