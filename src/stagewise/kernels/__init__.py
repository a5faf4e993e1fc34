"""Our CPU kernels and the quantized weight formats they read (GGUF blocks, int8/int4)."""
