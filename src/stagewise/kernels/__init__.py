"""Our C kernels for the CPU and the quantized weight formats they read (GGUF blocks, int8/int4).
Sources in `csrc/` (one file per concern, ISA picked at build time), their build and cache
(`build`), the ops' C++ registration (`native`), and per concern a module with the ctypes
bindings, the argument checks and the `stagewise::` ops (`gemm`, `attention`, `quant`; `registry`
declares the ops); `report` says which of them a stage runs (or PyTorch's op instead, and why).
Importing this package imports no torch: `build` and `report` alone are safe for the driver.
See docs/kernels.md.
"""
