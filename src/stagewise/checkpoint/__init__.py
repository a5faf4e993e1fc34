"""What a checkpoint holds, read without building a model: the file formats (HF safetensors
directories in `files.py`, GGUF metadata in `gguf_meta.py`), the tokenizer a GGUF file carries
(`saved_tokenizer.py`), the model's facts read once from either (`facts.py`), the embedding
pooling a sentence-transformers checkpoint declares (`pooling.py`) and what a LoRA adapter's files
hold (`lora_files.py`: PEFT directories and GGUF LoRA files, without their weights).
Nothing here imports torch models; tensor reading lives in `model.loader` / `model.gguf`."""
