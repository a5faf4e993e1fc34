"""What a checkpoint holds, read without building a model: the file formats (HF safetensors
directories in `files.py`, GGUF metadata in `gguf_meta.py`) and the tokenizer a GGUF file carries
(`saved_tokenizer.py`). Nothing here imports torch models; tensor reading lives in `model.loader` /
`model.gguf`."""
