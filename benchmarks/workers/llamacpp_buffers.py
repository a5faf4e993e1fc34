"""llama.cpp's model parameters without ggml's AMX "extra buffers": that kernel crashes on the first
Q4_1 decode on AMX CPUs, the plain CPU buffers work. Shared by the workers that run llama.cpp."""


def without_extra_buffers(llama_cpp) -> None:
    """Make every later model llama_cpp loads use the plain CPU buffers."""
    default = llama_cpp.llama_cpp.llama_model_default_params

    def params_without_extra_bufts():
        p = default()
        p.use_extra_bufts = False
        return p
    llama_cpp.llama_cpp.llama_model_default_params = params_without_extra_bufts
