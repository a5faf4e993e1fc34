"""A user-registered architecture whose forward declares the optional inputs in another order
and spelling: `forward(input_ids, positions, batch, pp_proxy_tensors=None, inputs_embeds=None)`."""
from stagewise.model.llama import LlamaForCausalLM


class OddLlamaForCausalLM(LlamaForCausalLM):
    calls: list = []

    def forward(self, input_ids, positions, batch, pp_proxy_tensors=None, inputs_embeds=None):
        return super().forward(input_ids, positions, batch, input_embeds=inputs_embeds,
                               pp_proxy_tensors=pp_proxy_tensors)
