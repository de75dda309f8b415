"""The chat format shared by pretraining, fine-tuning, evaluation and GRPO (ChatML, Qwen style).

The template puts the newline *before* each ``<|im_start|>`` rather than after ``<|im_end|>``, so a
completion is exactly ``content<|im_end|>``: the loss and the generated answer stop at the end token.
"""

from __future__ import annotations

IM_START, IM_END, PAD = "<|im_start|>", "<|im_end|>", "<|endoftext|>"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if not loop.first %}{{ '\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '\\n<|im_start|>assistant\\n' }}{% endif %}"
)


def user_text(ex: dict) -> str:
    """The user turn of an alpaca record: instruction, then the input on its own line if any."""
    inp = ex.get("input") or ""
    return f"{ex['instruction']}\n{inp}" if inp else ex["instruction"]


def prompt_messages(ex: dict) -> list[dict]:
    msgs = []
    if ex.get("system"):
        msgs.append({"role": "system", "content": ex["system"]})
    for user, assistant in ex.get("history") or ():
        msgs.append({"role": "user", "content": user})
        msgs.append({"role": "assistant", "content": assistant})
    msgs.append({"role": "user", "content": user_text(ex)})
    return msgs


def render_prompt(ex: dict) -> str:
    """Prompt text ending with the assistant header (what generation starts from)."""
    parts = []
    for m in prompt_messages(ex):
        parts.append(f"{IM_START}{m['role']}\n{m['content']}{IM_END}")
    return "\n".join(parts) + f"\n{IM_START}assistant\n"


def render_completion(ex: dict) -> str:
    return f"{ex['output']}{IM_END}"
