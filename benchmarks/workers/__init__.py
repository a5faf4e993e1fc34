"""Workers: scripts a benchmark runs by path under an engine's own interpreter (a vLLM or llama.cpp
virtual environment, standard library + that engine only), never entry points. They import nothing
of benchmarks/."""
