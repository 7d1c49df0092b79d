"""Model code: decoder, weight loading (safetensors, GGUF via conversion), tokenizer, model resolution."""
