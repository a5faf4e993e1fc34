"""PEFT LoRA adapters of a tiny checkpoint for the LoRA tests, and their oracle: PEFT's merged-weights
model (`merge_and_unload`), run greedily in float32."""
import peft
import torch

ADAPTERS = {  # name -> LoraConfig fields; B is drawn non-zero (PEFT starts it at zero: the base model)
    "attn": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp": dict(r=8, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"]),
}
NEW_TOKENS = 6


def _make_adapter(base_dir, out_dir, seed: int, **fields) -> None:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = peft.get_peft_model(model, peft.LoraConfig(lora_dropout=0.0, **fields))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name or "lora_A" in name:
                param.copy_(0.3 * torch.randn(param.shape, generator=gen))
    model.save_pretrained(out_dir)


def make_adapters(llama_dir, root) -> dict[str, str]:
    """Every adapter of ADAPTERS under `root`: {name: directory}."""
    out = {}
    for seed, (name, fields) in enumerate(ADAPTERS.items()):
        _make_adapter(llama_dir, root / name, seed + 1, **fields)
        out[name] = str(root / name)
    return out


def merged_greedy(base_dir, adapter_dir: str | None, ids: list[int]) -> tuple[list[int], torch.Tensor]:
    """PEFT's merged model (or the base model): greedy tokens and the prompt's last-row log-softmax."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_dir).merge_and_unload().eval()
    seq = list(ids)
    with torch.no_grad():
        first = torch.log_softmax(model(torch.tensor([seq])).logits[0, -1].float(), -1)
        for _ in range(NEW_TOKENS):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):], first
