"""Quantized weights: GGUF block formats kept as they are, and fp8 / int4 made from bf16 at load."""
