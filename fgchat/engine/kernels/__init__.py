"""GPU/CPU kernels of the decode step and prefill: attention backends, fused Triton stages, projections, launch helpers, sampling."""
