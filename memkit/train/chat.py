"""Turning instruction and chat records into (token ids, labels) with the loss on the answer only.

Alpaca records use the Stanford Alpaca prompt (tatsu-lab/stanford_alpaca: train.py, PROMPT_DICT),
the prompt the format was released with; the loss is on `output` + EOS.

Chat records are rendered with the tokenizer's own chat template (transformers
`apply_chat_template`). Tokenizers without one (memkit's byte tokenizer, base-model tokenizers)
get FALLBACK_CHAT_TEMPLATE, which is then set on the tokenizer, so the saved `final/` folder
renders conversations the way the model was trained.

Assistant-only loss: the conversation is rendered prefix by prefix. For assistant turn i, the
text of turns [0, i) with the generation prompt (the assistant header) is where the turn's
loss starts, and the text of turns [0, i] is where it ends (so the template's end-of-turn
token is learned). Tokens whose character span starts inside such a span get labels; all
others get IGNORE_INDEX. This needs a template that renders a conversation's prefixes as
prefixes of the whole; a template that rewrites earlier turns is refused with a clear line.
"""
from __future__ import annotations

from memkit.errors import MemkitError
from memkit.train.data import IGNORE_INDEX

ALPACA_PROMPT = ("Below is an instruction that describes a task, paired with an input that provides "
                 "further context. Write a response that appropriately completes the request.\n\n"
                 "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
ALPACA_PROMPT_NO_INPUT = ("Below is an instruction that describes a task. Write a response that "
                          "appropriately completes the request.\n\n"
                          "### Instruction:\n{instruction}\n\n### Response:\n")
"""tatsu-lab/stanford_alpaca: train.py, PROMPT_DICT (prompt_input / prompt_no_input)."""

FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")
"""Used when the tokenizer has no chat template. Renders

    <|system|>\\nYou are terse.\\n<|user|>\\nHi\\n<|assistant|>\\nHello<eos>

(plain text headers, which any tokenizer encodes; each assistant turn closed by EOS). Newlines
are Jinja string literals: transformers renders templates with trim_blocks, which drops a
newline written after a block tag (transformers: utils/chat_template_utils.py)."""


CHAT_ROLES = ("system", "user", "assistant", "tool")
"""The roles chat templates render (transformers' chat templating docs: system, user, assistant,
and tool for tool results); another name would be rendered or dropped as the template pleases."""


def check_roles(messages: list[dict], *, where: str) -> None:
    """Every turn's role is a chat role; one line naming the turn and the known roles."""
    for i, message in enumerate(messages):
        if message["role"] not in CHAT_ROLES:
            raise MemkitError(f"{where}: messages[{i}] has role {message['role']!r}; use one of "
                              f"{', '.join(CHAT_ROLES)}")


def alpaca_prompt(record: dict) -> str:
    template = ALPACA_PROMPT if record["input"] else ALPACA_PROMPT_NO_INPUT
    return template.format(instruction=record["instruction"], input=record["input"])


def ensure_chat_template(tokenizer) -> str:
    """The tokenizer's chat template; FALLBACK_CHAT_TEMPLATE (set on it) when it has none."""
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = FALLBACK_CHAT_TEMPLATE
    return tokenizer.chat_template


def chat_example(tokenizer, messages: list[dict], *, where: str) -> tuple[list[int], list[int]]:
    """(input ids, labels) of one conversation; labels are IGNORE_INDEX outside assistant turns."""
    def render(turns, generation_prompt=False) -> str:
        return tokenizer.apply_chat_template(turns, tokenize=False,
                                             add_generation_prompt=generation_prompt)

    check_roles(messages, where=where)
    full = render(messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        head = render(messages[:i], generation_prompt=True) if i else ""
        upto = render(messages[: i + 1])
        if not (upto.startswith(head) and full.startswith(upto)):
            raise MemkitError(f"{where}: the tokenizer's chat template does not render the conversation's "
                              "first turns as a prefix of the whole, so the assistant turns cannot be "
                              "located for the loss; use a template without that (or prompt/completion records)")
        spans.append((len(head), len(upto)))
    if not spans or all(start == end for start, end in spans):
        raise MemkitError(f"{where}: the assistant turns render to no text; nothing to take the loss on")
    return _ids_and_labels(tokenizer, full, spans)


def _ids_and_labels(tokenizer, text: str, spans) -> tuple[list[int], list[int]]:
    if tokenizer.is_fast:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        labels = [tok if any(s <= start < e for s, e in spans) else IGNORE_INDEX
                  for tok, (start, _) in zip(ids, enc["offset_mapping"])]
        return ids, labels
    # Slow tokenizers have no offsets: tokenize the pieces between span edges separately.
    edges = sorted({0, len(text), *(x for span in spans for x in span)})
    ids, labels = [], []
    for start, end in zip(edges, edges[1:]):
        piece = tokenizer(text[start:end], add_special_tokens=False)["input_ids"]
        inside = any(s <= start < e for s, e in spans)
        ids += piece
        labels += piece if inside else [IGNORE_INDEX] * len(piece)
    return ids, labels
