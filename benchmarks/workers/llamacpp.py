"""What the workers that run llama.cpp (llama-cpp-python) share, standard library only: its model
parameters without ggml's AMX "extra buffers" (that kernel crashes on the first Q4_1 decode on AMX
CPUs, the plain CPU buffers work), and greedy generation one sequence at a time."""


def without_extra_buffers(llama_cpp) -> None:
    """Make every later model llama_cpp loads use the plain CPU buffers."""
    default = llama_cpp.llama_cpp.llama_model_default_params

    def params_without_extra_bufts():
        p = default()
        p.use_extra_bufts = False
        return p
    llama_cpp.llama_cpp.llama_model_default_params = params_without_extra_bufts


def greedy(llm, prompts: list[list[int]], n: int) -> list[list[int]]:
    """`n` greedy tokens for each prompt, request after request (the binding decodes one sequence at
    a time); the loop stops at `n` tokens, not at EOS."""
    outs = []
    for prompt in prompts:
        tokens: list[int] = []
        for tok in llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            tokens.append(int(tok))
            if len(tokens) == n:
                break
        outs.append(tokens)
    return outs
