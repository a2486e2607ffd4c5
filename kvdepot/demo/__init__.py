"""Demo model runner for kvdepot (SmolLM2-135M-Instruct on CPU)."""
