"""QLoRA (Dettmers et al., "QLoRA: Efficient Finetuning of Quantized LLMs", 2023): a 4-bit NF4 base
through bitsandbytes, LoRA adapters in float32 on top.

bitsandbytes 0.50 loads 4-bit weights on a CPU but warns that its 4-bit autograd kernel is missing
there, so on a CPU we do not trust it blindly: before offering QLoRA we compare the LoRA gradients of
the 4-bit model with those of an unquantized reference holding the *same dequantized* weights, and
refuse with :class:`HardwareError` if they differ (or if the 4-bit path fails). On CUDA the
bitsandbytes kernels are its supported path and the check is skipped.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import pathlib

import torch

from .errors import HardwareError

GRAD_RTOL = 1e-3  # relative L2 difference allowed between 4-bit and reference LoRA gradients


def bnb_config():
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32,
                              bnb_4bit_use_double_quant=False)


def load_4bit_model(base_dir, *, attn_implementation=None):
    from transformers import AutoModelForCausalLM

    kw = {"quantization_config": bnb_config(), "dtype": torch.float32}
    if attn_implementation:
        kw["attn_implementation"] = attn_implementation
    if not torch.cuda.is_available():
        kw["device_map"] = {"": "cpu"}
    return AutoModelForCausalLM.from_pretrained(str(base_dir), **kw)


def dequantized_reference(model_4bit):
    """A copy of ``model_4bit`` whose 4-bit Linears are plain float32 Linears with the dequantized weights."""
    import bitsandbytes as bnb

    ref = copy.deepcopy(model_4bit)
    for name, module in list(ref.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, bnb.nn.Linear4bit):
                w = bnb.functional.dequantize_4bit(child.weight.data, child.weight.quant_state).float()  # (out, in)
                lin = torch.nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                lin.weight.data.copy_(w)
                if child.bias is not None:
                    lin.bias.data.copy_(child.bias.data.float())
                setattr(module, child_name, lin)
    return ref


def lora_gradient_mismatch(base_dir) -> float:
    """Max over LoRA parameters of ||g_4bit - g_ref|| / ||g_ref|| on a small batch of the built-in task.

    The gradients are taken the way train() takes them: in training mode, after a forward pass without
    gradients (train() measures the held-out loss before training). On a CPU with AVX512-BF16,
    bitsandbytes 0.50 repacks the 4-bit weights on such a pass for a bf16 inference kernel that has no
    autograd, and from then on no gradient flows back through the base layers: a check made before that
    pass would offer QLoRA and training would silently compute wrong gradients."""
    from peft import LoraConfig, get_peft_model

    from zoo_gym.evaluation.evaluate import collate, load_tokenizer, tokenize_examples
    from .tasks import builtin_examples

    tok = load_tokenizer(base_dir)
    m4 = load_4bit_model(base_dir)
    ref = dequantized_reference(m4)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False, task_type="CAUSAL_LM")
    grads = []
    ids, mask, labels = collate(tokenize_examples(tok, builtin_examples("default", n=8, seed=99)),
                                pad_id=tok.pad_token_id)
    for m in (m4, ref):
        torch.manual_seed(0)  # identical random A and B in both
        pm = get_peft_model(m, copy.deepcopy(cfg))
        pm.eval()
        with torch.no_grad():  # the evaluation train() makes before training
            pm(input_ids=ids, attention_mask=mask)
        pm.train()
        torch.manual_seed(1)  # the same dropout masks in both, where the model has dropout
        pm.zero_grad()
        pm(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        grads.append({k: p.grad.detach().float().clone() for k, p in pm.named_parameters()
                      if p.requires_grad and p.grad is not None})
    g4, gr = grads
    if set(g4) != set(gr) or not gr:
        return float("inf")
    worst = 0.0
    for k in gr:
        if not torch.isfinite(g4[k]).all():
            return float("inf")
        worst = max(worst, float((g4[k] - gr[k]).norm() / gr[k].norm().clamp(min=1e-12)))
    return worst


@functools.lru_cache(maxsize=8)
def _checked(base_dir: str) -> float:
    return lora_gradient_mismatch(base_dir)


def check_qlora(base_dir: pathlib.Path | None) -> None:
    """Raise HardwareError unless 4-bit QLoRA can train correctly here."""
    if importlib.util.find_spec("bitsandbytes") is None:
        raise HardwareError("quantization='4bit' needs bitsandbytes: pip install 'zoo-gym[qlora]'.")
    if torch.cuda.is_available() or base_dir is None:
        return
    try:
        err = _checked(str(base_dir))
    except Exception as e:  # the 4-bit CPU path itself failed
        raise HardwareError(
            f"quantization='4bit' is not usable on this CPU: bitsandbytes' 4-bit path failed ({type(e).__name__}: "
            f"{e}); train without quantization (the tiny model needs none) or on a CUDA GPU."
        ) from e
    if not err <= GRAD_RTOL:
        raise HardwareError(
            f"quantization='4bit' is refused on this CPU: QLoRA gradients differ from an unquantized reference "
            f"with the same dequantized weights by {err:.3g} (relative, > {GRAD_RTOL}); train without "
            f"quantization or on a CUDA GPU."
        )
