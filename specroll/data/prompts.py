"""Turning a question into the prompt token ids the policy generates from."""

from __future__ import annotations

import warnings
import weakref

INSTRUCTION = (
    "Solve the problem step by step. "
    "Then write the final answer as a number on its own last line, in the form '#### <number>'."
)
# For LaTeX answers (MATH, DAPO), read by the math_verify reward.
BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

# Tokenizers already warned about, so a training loop warns once rather than per prompt.
_WARNED_NO_CHAT_TEMPLATE: weakref.WeakSet = weakref.WeakSet()


def prompt_text(tokenizer, question: str, instruction: str = INSTRUCTION) -> str:
    """The text of the prompt for ``question``, as :func:`format_prompt` tokenizes it.

    Without a chat template: a plain ``Question: ...\\nAnswer:`` prompt, to which the tokenizer
    adds its own special tokens (BOS); with one, the template's rendering, which holds them.
    """
    message = f"{question.strip()}\n\n{instruction}" if instruction else question.strip()
    if tokenizer.chat_template is None:
        return f"Question: {message}\nAnswer:"
    # Rendering to text first sidesteps apply_chat_template(tokenize=True) returning a
    # BatchEncoding in transformers 5.
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True
    )


def format_prompt(tokenizer, question: str, instruction: str = INSTRUCTION) -> list[int]:
    """Token ids of the prompt for ``question``, ending where the model's answer starts.

    The user message is the question followed by ``instruction`` (if any), rendered through the
    tokenizer's chat template with the assistant generation prompt appended. A tokenizer
    without a chat template gets a plain ``Question: ...\\nAnswer:`` prompt instead, with a
    warning (once per tokenizer) since base models follow it less reliably.
    """
    text = prompt_text(tokenizer, question, instruction)
    if tokenizer.chat_template is None:
        if tokenizer not in _WARNED_NO_CHAT_TEMPLATE:
            _WARNED_NO_CHAT_TEMPLATE.add(tokenizer)
            warnings.warn(
                f"{type(tokenizer).__name__} has no chat template; falling back to a plain "
                "'Question: ...\\nAnswer:' prompt",
                stacklevel=2,
            )
        # No template wrote the special tokens, so let the tokenizer add its BOS if it has one.
        return list(tokenizer(text)["input_ids"])
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
