"""llama.cpp's prompt-lookup decoding for benchmarks/offline/speculative.py, under the Python of a venv with
llama-cpp-python (standard library + llama_cpp only). Loads the model once per variant ("off": plain
decoding; "lookupK": `LlamaPromptLookupDecoding(num_pred_tokens=K)`), then answers JSON lines on
stdin, one greedy batch-1 generation each, with the tokens, wall seconds and time to first token.

    PYTHON benchmarks/workers/llamacpp_lookup.py MODEL.gguf THREADS CTX VARIANT[,VARIANT...]
"""
from __future__ import annotations

import json
import sys
import time


def load(path: str, threads: int, ctx: int, variant: str):
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    draft = None if variant == "off" else LlamaPromptLookupDecoding(num_pred_tokens=int(variant.removeprefix("lookup")))
    return llama_cpp.Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=ctx, verbose=False,
                           seed=0, draft_model=draft)


def generate(llm, prompt: list[int], n: int) -> dict:
    eos = llm.token_eos()
    tokens: list[int] = []
    t0 = time.perf_counter()
    first = None
    for tok in llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
        if first is None:
            first = time.perf_counter() - t0
        tokens.append(int(tok))           # EOS counts, as in stagewise's outputs
        if int(tok) == eos or len(tokens) == n:
            break
    return {"tokens": tokens, "wall_s": time.perf_counter() - t0, "ttft_s": first or 0.0}


def main() -> None:
    path, threads, ctx, variants = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(",")
    models = {v: load(path, threads, ctx, v) for v in variants}
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        print(json.dumps(generate(models[req["variant"]], req["prompt"], req["n"])), flush=True)


if __name__ == "__main__":
    main()
