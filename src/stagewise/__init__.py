"""stagewise: a compact LLM inference engine built around pipeline parallelism with captured prefill graphs."""
