"""The chat format shared by pretraining, fine-tuning, evaluation and GRPO.

Everyone renders with one template: the one in the checkpoint's tokenizer files. The built-in tiny model
ships ``CHAT_TEMPLATE`` (ChatML, Qwen style: a completion is exactly ``content<|im_end|>``); a base
without a chat template gets ``PLAIN_TEMPLATE`` at ``gym-server init`` (or ``--chat-template FILE``),
and ``load_tokenizer`` applies the same fallback to any tokenizer without one (a completion is
``answer`` followed by eos). A completion is the text the full conversation adds to the prompt rendered
with the generation prompt (``render_pair``); a template for which the prompt is not a prefix of the
conversation is refused by ``check_template``. Details: docs/design/training.md.
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

PLAIN_TEMPLATE = (
    "{% for message in messages %}"
    "{% if not loop.first %}{{ '\\n\\n' }}{% endif %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}{{ '### Instruction:\\n' + message['content'] }}"
    "{% else %}{{ '### Response:\\n' + message['content'] + eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ ('\\n\\n' if messages else '') + '### Response:\\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """A tokenizer's chat template (or its special tokens) cannot render prompt/completion pairs."""


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
    """The built-in ChatML prompt ending with the assistant header (the tiny model's format)."""
    parts = []
    for m in prompt_messages(ex):
        parts.append(f"{IM_START}{m['role']}\n{m['content']}{IM_END}")
    return "\n".join(parts) + f"\n{IM_START}assistant\n"


def render_completion(ex: dict) -> str:
    """The built-in ChatML completion (the tiny model's format)."""
    return f"{ex['output']}{IM_END}"


def ensure_chat_template(tokenizer):
    """Give a tokenizer without a chat template ``PLAIN_TEMPLATE``, and one without a pad token its eos
    token as pad. Returns the tokenizer (changed in place)."""
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = PLAIN_TEMPLATE
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _render(tokenizer, messages: list[dict], *, add_generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # noqa: BLE001 - jinja errors of all kinds: say which template failed
        raise ChatTemplateError(f"the chat template cannot render a conversation: {type(exc).__name__}: {exc}") from None


def render_prompt_with(tokenizer, ex: dict) -> str:
    """The prompt of ``ex`` in ``tokenizer``'s chat template, ending where the answer starts."""
    return _render(tokenizer, prompt_messages(ex), add_generation_prompt=True)


def render_pair(tokenizer, ex: dict) -> tuple[str, str]:
    """(prompt, completion) text of ``ex`` in ``tokenizer``'s chat template.

    The completion is what the conversation with the answer adds to the prompt (the same split TRL
    trains on); where a template renders the last turn differently, the split is at the longest
    common prefix."""
    msgs = prompt_messages(ex)
    prompt = _render(tokenizer, msgs, add_generation_prompt=True)
    full = _render(tokenizer, msgs + [{"role": "assistant", "content": ex["output"]}], add_generation_prompt=False)
    if full.startswith(prompt):
        return prompt, full[len(prompt):]
    k = 0
    for a, b in zip(prompt, full):
        if a != b:
            break
        k += 1
    return prompt[:k], full[k:]


def check_template(tokenizer) -> None:
    """Raise ChatTemplateError (one sentence) unless the template renders a prompt/completion pair
    whose completion holds the answer and ends the turn."""
    if tokenizer.eos_token is None:
        raise ChatTemplateError("the tokenizer has no eos token: a completion could never end; set eos_token "
                                "in its tokenizer_config.json")
    ex = {"instruction": "Add the numbers.", "input": "2+3", "output": "5"}
    prompt, completion = render_pair(tokenizer, ex)
    if "Add the numbers." not in prompt or "5" not in completion:
        raise ChatTemplateError("the chat template does not render the user turn into the prompt and the "
                                f"answer into the completion (prompt {prompt!r}, completion {completion!r})")
