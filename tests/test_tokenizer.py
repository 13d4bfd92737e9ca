"""The daemon renders and tokenizes chats without transformers, exactly as transformers would."""
import subprocess
import sys

import pytest

from clawd.tokenizer import ChatTokenizer, TemplateError

CONVERSATIONS = [
    ([{"role": "user", "content": "Hi"}], None),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo wörld 你好 🦦"},
      {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "  spaces\n\tand tabs  "}], None),
    ([{"role": "user", "content": "Weather in Paris?"},
      {"role": "assistant", "content": None, "tool_calls": [
          {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
      {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"},
      {"role": "tool", "tool_call_id": "call_2", "content": "sunny"}],
     [{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]),
]


@pytest.mark.parametrize("messages, tools", CONVERSATIONS)
def test_same_ids_as_transformers(tiny_model, messages, tools):
    from transformers import AutoTokenizer
    ours = ChatTokenizer(tiny_model).encode_chat(messages, tools)
    hf = AutoTokenizer.from_pretrained(tiny_model)
    theirs = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    theirs = theirs["input_ids"] if not isinstance(theirs, list) else theirs
    assert ours == list(theirs)


def test_model_info(tiny_model):
    tok = ChatTokenizer(tiny_model)
    im_end = tok.tokenizer.token_to_id("<|im_end|>")
    assert im_end in tok.info.eos_ids
    assert tok.info.context_length == 2048
    assert im_end in tok.special_ids
    assert tok.tokenizer.token_to_id("<tool_call>") not in tok.special_ids


def test_template_errors_are_client_errors(tmp_path, tiny_model):
    import json
    import shutil
    model = tmp_path / "m"
    shutil.copytree(tiny_model, model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}x"
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(TemplateError, match="first must be user"):
        ChatTokenizer(model).render([{"role": "assistant", "content": "x"}], None)


def test_loading_does_not_import_torch(tiny_model):
    code = ("import sys; from clawd.tokenizer import ChatTokenizer; "
            f"ChatTokenizer({str(tiny_model)!r}).encode_chat([{{'role': 'user', 'content': 'x'}}], None); "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cached_piecewise_encoding_equals_whole_encoding(tiny_model):
    from hypothesis import given, settings, strategies as st
    tok = ChatTokenizer(tiny_model)
    assert tok._splitter is not None
    markers = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</tool_call>", "<think>", "\n", " "]
    pieces = st.one_of(st.sampled_from(markers), st.text(max_size=12))

    @settings(max_examples=300, deadline=None, database=None)
    @given(st.lists(pieces, max_size=12))
    def check(parts):
        text = "".join(parts)
        whole = tok.tokenizer.encode(text, add_special_tokens=False).ids
        assert tok.encode(text) == whole
        assert tok.encode(text) == whole  # and again, from the cache

    check()


def test_piece_cache_is_bounded_in_bytes(tiny_model):
    from clawd.tokenizer import cache_entry_bytes
    tok = ChatTokenizer(tiny_model)
    tok.cache_max_bytes = 4000
    for i in range(50):
        tok.encode_chat([{"role": "user", "content": f"message {i}"}], None)
    assert tok.cache_bytes == sum(cache_entry_bytes(p, len(ids)) for p, ids in tok._cache.items())
    assert 4000 - 400 < tok.cache_bytes <= 4000  # full, and entries here take < 400 bytes each
    assert "user\nmessage 49" in tok._cache and "user\nmessage 0" not in tok._cache  # least recent went first


def test_huge_piece_is_encoded_but_not_cached(tiny_model, monkeypatch):
    import clawd.tokenizer
    monkeypatch.setattr(clawd.tokenizer, "MAX_ENTRY_BYTES", 1000)  # one 1,000-byte entry at most
    tok = ChatTokenizer(tiny_model)
    text = "<|im_start|>user\n" + "word " * 200 + "<|im_end|><|im_start|>assistant\n"
    assert tok.encode(text) == tok.tokenizer.encode(text, add_special_tokens=False).ids
    assert list(tok._cache) == ["assistant\n"]  # the 1,000-character piece was not worth keeping


def test_held_pieces_join_the_cache_only_when_kept(tiny_model):
    tok = ChatTokenizer(tiny_model)
    text = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>user\nhello<|im_end|>"
    ids, fresh = tok.encode_held(text)
    assert ids == tok.tokenizer.encode(text, add_special_tokens=False).ids
    assert list(fresh) == ["user\nhello", "\n"] and tok._cache == {} and tok.cache_bytes == 0
    tok.keep(fresh)
    assert list(tok._cache) == ["user\nhello", "\n"] and tok.encode(text) == ids


# A ChatML template that names the model when a conversation has no system message (as SmolLM2's and Qwen's do).
DEFAULT_SYSTEM_TEMPLATE = (
    "{% if messages[0].role != 'system' %}<|im_start|>system\nYou are Otter, a helpful model.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("template, default", [
    (DEFAULT_SYSTEM_TEMPLATE, "You are Otter, a helpful model."),
    ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}", ""),  # adds none
    ("{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}x", ""),  # refuses one
])
def test_default_system_is_the_text_a_template_adds_without_a_system_message(tmp_path, tiny_model, template, default):
    import json
    import shutil
    model = tmp_path / "m"
    shutil.copytree(tiny_model, model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = ChatTokenizer(model)
    assert tok.default_system() == default
    if default:  # a system message holding it renders what the template renders without one
        user = [{"role": "user", "content": "Hi"}]
        assert tok.render([{"role": "system", "content": default}, *user], None) == tok.render(user, None)
