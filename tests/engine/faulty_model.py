"""A test-only model hook: a Llama whose first stage fails on chosen token ids.

`RAISE_TOKEN` anywhere in a step's input raises (the whole plan fails); `NAN_TOKEN` turns the
embedding of its row into NaN, which reaches only its own request's rows (and KV blocks)."""
from stagewise.model.llama import LlamaForCausalLM

RAISE_TOKEN = 997
NAN_TOKEN = 998


class FaultyLlamaForCausalLM(LlamaForCausalLM):
    def forward(self, input_ids, positions, batch, *, input_embeds=None, pp_proxy_tensors=None):
        if input_ids is not None and bool((input_ids == RAISE_TOKEN).any()):
            raise RuntimeError("injected fault")
        if input_ids is not None and bool((input_ids == NAN_TOKEN).any()):
            input_embeds = self.embed_tokens(input_ids).masked_fill((input_ids == NAN_TOKEN)[:, None], float("nan"))
        return super().forward(input_ids, positions, batch, input_embeds=input_embeds,
                               pp_proxy_tensors=pp_proxy_tensors)
