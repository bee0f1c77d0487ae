"""Chat data shared by the SFT tests: Llama-3's and ChatML's templates, tiny byte-level BPE
tokenizers trained here and saved as Hugging Face lays a tokenizer directory out, conversations."""

import json
from pathlib import Path

import tokenizers

LLAMA3 = """{{- bos_token }}
{%- for message in messages %}
{%- if message['role'] not in ['system', 'user', 'assistant'] %}
{{- raise_exception('Unknown role: ' + message['role']) }}
{%- endif %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
{%- if message['role'] == 'assistant' %}
{%- generation %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endgeneration %}
{%- else %}
{{- message['content'] | trim + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""
"""Llama-3's template, its assistant content in HF's ``{% generation %}`` markers."""

CHATML = """{%- for message in messages %}
{%- if loop.first and message.role != 'system' %}
{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- if message.role in ['system', 'user'] %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}{% generation %}{{- message.content + '<|im_end|>\\n' }}{% endgeneration %}
{%- else %}
{{- raise_exception('Unknown role: ' + message.role) }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""
"""Qwen's ChatML template (its default system message included), the generation markers where
this package's span rule puts the assistant's tokens: the content, ``<|im_end|>`` and the newline."""

FORMATS = {
    "llama3": (LLAMA3, ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                        "<|eot_id|>"], "<|begin_of_text|>", "<|eot_id|>", "<|eot_id|>"),
    "chatml": (CHATML, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>", "<|im_end|>\n"),
}
"""name -> (template, special tokens, bos, eos, what ends an assistant span)."""

CAPITALS = [("France", "Paris"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Japan", "Tokyo"), ("Peru", "Lima"),
            ("Kenya", "Nairobi"), ("Chile", "Santiago"), ("Egypt", "Cairo")]
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def conversation(i: int) -> list[dict]:
    """Conversation ``i``: one to three turns of capital and arithmetic questions, with or without a system message."""
    country, capital = CAPITALS[i % len(CAPITALS)]
    a, b = i % 5, (i // 5) % 5
    messages = [{"role": "system", "content": "You are a helpful assistant."}] if i % 2 else []
    messages += [{"role": "user", "content": f"What is the capital of {country}?"},
                 {"role": "assistant", "content": f"The capital of {country} is {capital}."}]
    for turn in range(i % 3):
        messages += [{"role": "user", "content": f"What is {NUMBERS[a + turn]} plus {NUMBERS[b]}?"},
                     {"role": "assistant", "content": f"It is {NUMBERS[a + turn + b]}."}]
    return messages


GOLDEN = [{"role": "system", "content": "You are a helpful assistant."},
          {"role": "user", "content": "What is the capital of France?"},
          {"role": "assistant", "content": "The capital of France is Paris."},
          {"role": "user", "content": "What is two plus two?"},
          {"role": "assistant", "content": "It is four."}]


def write_tokenizer(directory: Path, name: str, with_template: bool = True) -> Path:
    """A byte-level BPE with the format's special tokens, saved as Hugging Face lays it out."""
    template, special, bos, eos, _ = FORMATS[name]
    corpus = [json.dumps(conversation(i)) for i in range(40)]
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus * 3, vocab_size=400, min_frequency=2, special_tokens=special)
    directory.mkdir(parents=True, exist_ok=True)
    bpe.save(str(directory / "tokenizer.json"))
    config = {"eos_token": eos, **({"bos_token": bos} if bos else {})}
    if with_template and name == "llama3":  # the template in tokenizer_config.json (older layout)
        config["chat_template"] = template
    elif with_template:  # chat_template.jinja beside it (newer layout)
        (directory / "chat_template.jinja").write_text(template)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory
