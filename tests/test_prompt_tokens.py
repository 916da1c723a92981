"""The gateway's prompt tokenizer: chat requests rendered by the model's template and encoded
as vLLM does (the e2e suite checks the same against a real vLLM's ``/tokenize``)."""

from __future__ import annotations

import json

import pytest

from duetime.web.prefix_keys import prompt_block_keys, token_block_keys
from duetime.web.prompt_tokens import PromptTokenizer, TokenizerError
from duetime.web.requests import parse_completion

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
STRICT = ("{% for m in messages %}{% if m['role'] == 'tool' %}"
          "{{ raise_exception('no tools here') }}{% endif %}{{ m['content'] }}{% endfor %}")


def make_folder(path, template=CHATML, *, jinja_file=False, bos=False):
    """A tokenizer folder as transformers saves one: a byte-level BPE over a small corpus with
    the ChatML markers as special tokens, and the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, the quick brown fox jumps over the lazy dog"] * 50,
                            trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "pad_token": {"content": "<|endoftext|>"}}
    if jinja_file:
        (path / "chat_template.jinja").write_text(template)
    elif template is not None:
        config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path, tok


def chat(**body):
    return parse_completion(json.dumps(body).encode(), chat=True)


def test_chat_is_rendered_by_the_template_and_encoded_without_special_tokens(tmp_path):
    folder, tok = make_folder(tmp_path / "m", bos=True)
    pt = PromptTokenizer(folder)
    msgs = [{"role": "system", "content": "the lazy dog"},
            {"role": "user", "content": "hello world"}]
    text = ("<|im_start|>system\nthe lazy dog<|im_end|>\n<|im_start|>user\nhello world"
            "<|im_end|>\n<|im_start|>assistant\n")
    assert pt.render({"messages": msgs}) == text
    ids = pt.ids(chat(messages=msgs))
    assert ids == tok.encode(text, add_special_tokens=False).ids
    assert ids[0] == tok.token_to_id("<|im_start|>")  # the markers are single tokens
    # add_generation_prompt false drops the assistant header; add_special_tokens adds the BOS
    assert pt.render({"messages": msgs, "add_generation_prompt": False}) == text[:-len(
        "<|im_start|>assistant\n")]
    assert pt.ids(chat(messages=msgs, add_special_tokens=True))[0] == tok.token_to_id("<s>")


def test_completions_add_special_tokens_and_token_ids_pass(tmp_path):
    folder, tok = make_folder(tmp_path / "m", bos=True)
    pt = PromptTokenizer(folder / "tokenizer.json")  # (the file; its folder's config found)
    assert pt.has_template
    req = parse_completion(json.dumps({"prompt": "hello world"}).encode(), chat=False)
    assert pt.ids(req) == tok.encode("hello world").ids
    assert pt.ids(req)[0] == tok.token_to_id("<s>")
    req = parse_completion(json.dumps({"prompt": [[5, 6, 7]]}).encode(), chat=False)
    assert pt.ids(req) == [5, 6, 7]


def test_what_vllm_changes_before_rendering(tmp_path):
    """Text parts joined by newlines, ``developer`` as ``system`` unless the template names it;
    images, a request's own template and a template's refusal give None (the estimate)."""
    folder, _ = make_folder(tmp_path / "m")
    pt = PromptTokenizer(folder)
    parts = [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]
    assert pt.render({"messages": [{"role": "user", "content": parts}]}).startswith(
        "<|im_start|>user\nhello\nworld<|im_end|>")
    assert pt.render({"messages": [{"role": "developer", "content": "x"}]}).startswith(
        "<|im_start|>system\nx")
    named = PromptTokenizer(make_folder(tmp_path / "d", CHATML + "{# 'developer' #}")[0])
    assert named.render({"messages": [{"role": "developer", "content": "x"}]}).startswith(
        "<|im_start|>developer\nx")
    image = [{"type": "image_url", "image_url": {"url": "data:,"}}]
    assert pt.render({"messages": [{"role": "user", "content": image}]}) is None
    assert pt.render({"messages": [{"role": "user", "content": "x"}],
                      "chat_template": "{{ 1 }}"}) is None
    strict = PromptTokenizer(make_folder(tmp_path / "s", STRICT)[0])
    assert strict.render({"messages": [{"role": "user", "content": "a"}]}) == "a"
    assert strict.render({"messages": [{"role": "tool", "content": "a"}]}) is None


def test_template_sources(tmp_path):
    """chat_template.jinja wins over tokenizer_config.json; a list of named templates gives the
    default one; an explicit file overrides both; a broken template is a TokenizerError."""
    folder, _ = make_folder(tmp_path / "j", "J{{ messages[0]['content'] }}", jinja_file=True)
    assert PromptTokenizer(folder).render({"messages": [{"role": "user", "content": "x"}]}) \
        == "Jx"
    folder, _ = make_folder(tmp_path / "l", [{"name": "tool_use", "template": "T"},
                                             {"name": "default", "template": "D"}])
    assert PromptTokenizer(folder).render({"messages": [{"role": "user", "content": "x"}]}) \
        == "D"
    (tmp_path / "o.jinja").write_text("O{{ eos_token }}{{ pad_token }}")
    over = PromptTokenizer(folder, tmp_path / "o.jinja")
    assert over.render({"messages": [{"role": "user", "content": "x"}]}) \
        == "O<|im_end|><|endoftext|>"
    none, _ = make_folder(tmp_path / "n", None)
    assert not PromptTokenizer(none).has_template
    with pytest.raises(TokenizerError, match="does not compile"):
        PromptTokenizer(make_folder(tmp_path / "b", "{% for %}")[0])
    with pytest.raises(TokenizerError, match=r"not a tokenizer\.json"):
        PromptTokenizer(tmp_path / "o.jinja")


def test_the_gateway_keys_blocks_by_the_servers_tokens(tmp_path):
    """With a tokenizer folder in the pool, the gateway counts a chat prompt as its token ids
    and keys its blocks by them, so a conversation's next turn starts with the blocks of the
    turn before."""
    from duetime.gateway.app import Gateway
    from duetime.gateway.config import pool_from_dict

    folder, tok = make_folder(tmp_path / "m")
    pool = pool_from_dict({"instances": [{"name": "s", "model": "qwen3-0.6b", "url": "http://h",
                                          "profile": "qwen3-0.6b"}],
                           "tokenizer": str(folder)})
    intake = Gateway(pool).intake
    first = [{"role": "user", "content": "the quick brown fox " * 20}]
    req = chat(messages=first)
    n = intake.count_tokens(req)
    text = PromptTokenizer(folder).render({"messages": first})
    assert req.token_ids == tok.encode(text, add_special_tokens=False).ids and n == len(
        req.token_ids)
    keys = prompt_block_keys(req, 16)
    assert keys == token_block_keys(req.token_ids, 16) and len(keys) == n // 16
    second = chat(messages=[*first, {"role": "assistant", "content": "the lazy dog"},
                            {"role": "user", "content": "hello world"}])
    intake.count_tokens(second)
    assert prompt_block_keys(second, 16)[:len(keys)] == keys


def test_a_returning_conversation_is_encoded_from_its_kept_prefix_exactly(tmp_path):
    """Each turn's prompt equals the whole text's encoding, though after the first turn only
    the part after the previous turn's last special token is encoded: random conversations
    whose messages hold spaces, newlines, non-ASCII text and the special markers themselves."""
    import random

    from duetime.web.prompt_tokens import PrefixIds

    folder, tok = make_folder(tmp_path / "m", bos=True)
    pt = PromptTokenizer(folder)
    rng = random.Random(0)
    pieces = ["the", " quick", " fox", "\n", "  ", "é", "中文", "<|im_end|>", "<|im_start|>",
              " \n", "hello world", "<|endoftext|>", "dog "]

    def text() -> str:
        return "".join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))

    turns = 0
    for _ in range(60):
        messages = [{"role": "system", "content": text()}]
        for _ in range(5):
            messages.append({"role": "user", "content": text()})
            rendered = pt.render({"messages": messages})
            assert pt.ids(chat(messages=messages)) == tok.encode(
                rendered, add_special_tokens=False).ids, rendered
            turns += 1
            messages.append({"role": "assistant", "content": text()})
    assert pt.prefixes.hits == turns - 60  # (every turn after a conversation's first)
    small = PrefixIds(size=2)
    for k in range(3):
        small.keep(f"p{k}", [k])
    assert small.longest("p0 and on", [2]) == (0, [])  # (the oldest went out)
    assert small.longest("p2 and on", [2]) == (2, [2])


def test_a_special_token_that_strips_what_follows_is_not_a_cut(tmp_path):
    from tokenizers import AddedToken

    folder, tok = make_folder(tmp_path / "m")
    tok.add_special_tokens([AddedToken("<|sep|>", rstrip=True, normalized=False)])
    tok.save(str(folder / "tokenizer.json"))
    pt = PromptTokenizer(folder)
    assert "<|sep|>" not in pt.cut_after and "<|im_end|>" in pt.cut_after
    messages = [{"role": "user", "content": "hello <|sep|>  world"}]
    for _ in range(2):
        rendered = pt.render({"messages": messages})
        assert pt.ids(chat(messages=messages)) == tok.encode(rendered,
                                                             add_special_tokens=False).ids
        messages += [{"role": "assistant", "content": "the <|sep|> \n dog"},
                     {"role": "user", "content": "<|sep|> fox"}]


def test_kept_chains_give_the_keys_a_fresh_chain_gives() -> None:
    """Prompts that share runs of whole blocks with earlier ones (a returning conversation,
    two conversations with one system prompt, a salt, another block size) get the keys of a
    chain computed from scratch; a caller that changes its list changes nothing kept."""
    import random
    from array import array

    from duetime.web import prefix_keys as pk

    def fresh(ids: list[int], bs: int, salt: str | None) -> list[int]:
        n = len(ids) // bs
        raw = array("q", ids[:n * bs]).tobytes()
        return pk._chain([raw[i * 8 * bs:(i + 1) * 8 * bs] for i in range(n)], pk._TOKENS,
                         salt)

    rng = random.Random(3)
    kept = pk._KEPT
    hits = kept.hits
    base = [rng.randrange(50_000) for _ in range(2_000)]
    for _ in range(400):
        ids = base[:rng.randrange(len(base))] + [rng.randrange(50_000)
                                                 for _ in range(rng.randrange(200))]
        bs, salt = rng.choice([16, 32]), rng.choice([None, "tenant-a"])
        got = token_block_keys(ids, bs, salt=salt)
        assert got == fresh(ids, bs, salt)
        got.clear()  # (the caller's list)
        assert token_block_keys(ids, bs, salt=salt) == fresh(ids, bs, salt)
    assert kept.hits - hits > 400
    # a prompt whose first block differs from every kept one hashes from scratch
    assert token_block_keys([1] * 64, 16) == fresh([1] * 64, 16, None)


def test_prompts_encoded_with_the_gil_released_give_the_same_ids_on_many_threads(tmp_path):
    """``release=True`` (a long prompt encoded off the gateway's event loop) gives the ids
    the plain encoding gives, with several threads encoding returning conversations at once
    (their kept prefixes shared)."""
    import random
    import threading

    folder, tok = make_folder(tmp_path / "m", bos=True)
    pt = PromptTokenizer(folder)
    pieces = ["the", " quick", " fox", "\n", "é", "<|im_end|>", "<|im_start|>", "hello world"]
    failures: list[str] = []

    def talk(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(15):
            messages = [{"role": "system", "content": "hello world " * rng.randint(0, 40)}]
            for _ in range(4):
                messages.append({"role": "user", "content": "".join(
                    rng.choice(pieces) for _ in range(rng.randint(1, 60)))})
                want = tok.encode(pt.render({"messages": messages}),
                                  add_special_tokens=False).ids
                if pt.ids(chat(messages=messages), release=rng.random() < 0.7) != want:
                    failures.append(f"{seed}: {messages}")
                messages.append({"role": "assistant", "content": "dog " * rng.randint(0, 9)})

    threads = [threading.Thread(target=talk, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[:1]
    assert pt.prefixes.hits > 0
    words = "hello world " * 30
    assert pt.ids(parse_completion(json.dumps({"prompt": words}).encode(), chat=False),
                  release=True) == tok.encode(words).ids
