"""Images in: decoding under limits (`images`), chat messages with image parts (`messages`) and the
driver-side vision encoder that turns them into prompt embeddings (`encoder`). The stages never see
an image: they receive the prompt as embeddings with the image features spliced in."""
