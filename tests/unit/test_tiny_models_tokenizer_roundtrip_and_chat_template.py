"""The tiny tokenizer: deterministic training, lossless round trip of text, ChatML template, special tokens,
and an offline reload from a saved model folder."""

from transformers import AutoTokenizer

from mrl.models.tiny import CHAT_TEMPLATE, make_tiny_hf_model, train_tiny_tokenizer

TEXTS = [
    "What is 17 + 25? Let us think step by step.",
    "unseen wörds, émojis 🙂 and\ttabs\nnewlines",
    "  leading spaces and \\boxed{42}",
]


def test_training_is_deterministic_and_caller_text_changes_the_merges():
    a, b = train_tiny_tokenizer(), train_tiny_tokenizer()
    assert a.get_vocab() == b.get_vocab()
    assert len(a) == 512
    task = ["zyxwv qrstu " * 50]
    c = train_tiny_tokenizer(corpus=task)
    assert c.get_vocab() != a.get_vocab()
    assert len(c("zyxwv qrstu")["input_ids"]) < len(a("zyxwv qrstu")["input_ids"])


def test_text_round_trips_and_special_tokens_are_single_ids(tmp_path):
    path = make_tiny_hf_model("llama", tmp_path / "m")
    tok = AutoTokenizer.from_pretrained(path)
    for text in TEXTS:
        ids = tok(text, add_special_tokens=True)["input_ids"]
        assert tok.decode(ids) == text
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|pad|>" and tok.bos_token is None
    for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|pad|>"):
        assert len(tok(special, add_special_tokens=False)["input_ids"]) == 1
    assert tok.chat_template == CHAT_TEMPLATE


def test_chat_template_renders_chatml_with_generation_prompt():
    tok = train_tiny_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=False)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(tok.eos_token_id) == 2
    assert tok.decode(ids) == text.removesuffix("<|im_start|>assistant\n")
