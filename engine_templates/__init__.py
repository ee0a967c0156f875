"""What is being optimized: model presets and the op registry (worker side: stdlib, torch, triton)."""
