"""The Search-R1 text protocol, checked against literal strings written out from the protocol page."""
import copy
import dataclasses

import pytest

from llds_jax import protocol
from llds_jax.config.sections import RolloutConfig

PROMPT_TOKENS = RolloutConfig.max_prompt_tokens  # the run's default prompt cut

PROMPT_PARIS = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you get "
    "new information. After reasoning, if you find you lack some knowledge, you can call a search engine by "
    "<search> query </search> and it will return the top searched results between <information> and "
    "</information>. You can search as many times as your want. If you find no further external knowledge "
    "needed, you can directly provide the answer inside <answer> and </answer>, without detailed illustrations. "
    "For example, <answer> Beijing </answer>. Question: what is the capital of france?\n"
)


@pytest.mark.parametrize("question", [
    "what is the capital of france?",
    "what is the capital of france",
    "  what is the capital of france \n",
    "\twhat is the capital of france?  ",
])
def test_make_prompt_byte_identical(question):
    prompt = protocol.make_prompt(question)
    assert prompt == PROMPT_PARIS
    assert prompt.count("\n") == 1 and prompt.endswith("?\n")


def test_make_prompt_keeps_inner_question_marks_and_rejects_empty():
    assert protocol.make_prompt("who? when").endswith("Question: who? when?\n")
    assert protocol.make_prompt("why??").endswith("Question: why??\n")
    with pytest.raises(ValueError, match="empty"):
        protocol.make_prompt("  \n")


def test_chat_prompt_ids_base_template(qwen_tokenizer):
    expected = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                "<|im_start|>user\n" + PROMPT_PARIS + "<|im_end|>\n<|im_start|>assistant\n")
    ids = protocol.chat_prompt_ids(qwen_tokenizer, "what is the capital of france", PROMPT_TOKENS)
    assert ids == qwen_tokenizer.encode(expected, add_special_tokens=False)
    assert qwen_tokenizer.decode(ids) == expected
    assert ids[:3] == [151644, 8948, 198]  # <|im_start|> system \n
    assert ids[-3:] == [151644, 77091, 198]  # <|im_start|> assistant \n


def test_chat_prompt_ids_instruct_template(qwen_instruct_tokenizer):
    ids = protocol.chat_prompt_ids(qwen_instruct_tokenizer, "what is the capital of france", PROMPT_TOKENS)
    assert qwen_instruct_tokenizer.decode(ids) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n" + PROMPT_PARIS + "<|im_end|>\n<|im_start|>assistant\n")


def test_chat_prompt_ids_without_template(qwen_tokenizer):
    raw = copy.deepcopy(qwen_tokenizer)
    raw.chat_template = None
    ids = protocol.chat_prompt_ids(raw, "what is the capital of france", PROMPT_TOKENS)
    assert raw.decode(ids) == PROMPT_PARIS
    assert ids == raw.encode(PROMPT_PARIS, add_special_tokens=False)
    assert protocol.fit_prompt(raw, "what is the capital of france", PROMPT_TOKENS) == (ids, 0)


@pytest.mark.parametrize("chat_template", [True, False])
def test_an_over_long_question_loses_its_start_never_the_instruction(qwen_tokenizer, chat_template):
    """Issue 58 item 10: the last max_prompt_tokens tokens were kept, so the search instruction (and the chat
    template's system turn) was cut, with no count."""
    tok = copy.deepcopy(qwen_tokenizer)
    if not chat_template:
        tok.chat_template = None
    question = " ".join(f"w{i}" for i in range(3000)) + " who founded Acme"
    ids, cut = protocol.fit_prompt(tok, question, max_prompt_tokens=400)
    text = tok.decode(ids)
    assert 390 <= len(ids) <= 400 and cut > 0
    assert text.startswith("<|im_start|>system\n" if chat_template else protocol.SEARCH_R1_TEMPLATE[:60])
    assert protocol.SEARCH_R1_TEMPLATE.split("{question}")[0] in text  # the whole instruction
    assert text.endswith("w2999 who founded Acme?\n" + ("<|im_end|>\n<|im_start|>assistant\n" if chat_template else ""))
    question_ids = tok.encode(question, add_special_tokens=False)
    kept = text.split("Question: ")[1]
    assert abs(len(tok.encode(kept, add_special_tokens=False)) - (len(question_ids) - cut)) <= 10
    full = protocol.chat_prompt_ids(tok, "what is the capital of france", PROMPT_TOKENS)
    with pytest.raises(ValueError, match=rf"^the prompt's instruction alone is \d+ tokens, more than "
                                         rf"max_prompt_tokens = {len(full) - 20}$"):
        protocol.fit_prompt(tok, "what is the capital of france", max_prompt_tokens=len(full) - 20)


def test_invalid_action_message_literal():
    assert protocol.INVALID_ACTION_MESSAGE == (
        "\nMy previous action is invalid. If I want to search, I should put the query between <search> and "
        "</search>. If I want to give the final answer, I should put the answer between <answer> and </answer>. "
        "Let me try again.\n")


@dataclasses.dataclass(frozen=True)
class Document:
    id: str
    contents: str
    score: float = 0.0


def test_format_observation_byte_identical():
    docs = [
        Document("1", '"Paul Walker"\nPaul William Walker IV was an American actor.', 0.9),
        Document("2", '"Fast & Furious"\nFirst line of body.\nSecond line of body.', 0.8),
        Document("3", "No Body Title", 0.7),
    ]
    assert protocol.format_observation([d.contents for d in docs]) == (
        '\n\n<information>Doc 1(Title: "Paul Walker") Paul William Walker IV was an American actor.\n'
        'Doc 2(Title: "Fast & Furious") First line of body.\nSecond line of body.\n'
        "Doc 3(Title: No Body Title)</information>\n\n")


def test_format_observation_edge_cases():
    assert protocol.format_observation(['"T"\n  body  \n']) == '\n\n<information>Doc 1(Title: "T")   body</information>\n\n'
    assert protocol.format_observation(['\n"T"\nbody', ""]) == (
        '\n\n<information>Doc 1(Title: ) "T"\nbody\nDoc 2(Title: )</information>\n\n')
    assert protocol.format_observation([]) == "\n\n<information></information>\n\n"


# (turn text, cut text, action kind, action content)
CUT_CASES = [
    ("<think>x</think><search> capital of France </search>\n\n<information>junk",
     "<think>x</think><search> capital of France </search>", "search", "capital of France"),
    ("<answer> Paris </answer> trailing <search>q</search>",
     "<answer> Paris </answer> trailing <search>q</search>", "answer", "Paris"),
    ("<answer>Paris</answer> then </search>", "<answer>Paris</answer> then </search>", "answer", "Paris"),
    ("<search>a</search><answer>b</answer>", "<search>a</search>", "search", "a"),
    ("<search>a</answer>", "<search>a</answer>", None, ""),
    ("<search>\n multi\nline \n</search>", "<search>\n multi\nline \n</search>", "search", "multi\nline"),
    ("<answer></answer>", "<answer></answer>", "answer", ""),
    ("<search>   </search>", "<search>   </search>", "search", ""),
    ("<SEARCH>q</SEARCH><Answer>x</Answer>", "<SEARCH>q</SEARCH><Answer>x</Answer>", None, ""),
    ("<think>maybe <search>inner</search> later</think>", "<think>maybe <search>inner</search>",
     "search", "inner"),
    ("<search>outer <search>inner</search> tail</search>", "<search>outer <search>inner</search>",
     "search", "outer <search>inner"),
    ("<answer>x <answer>y</answer></answer>", "<answer>x <answer>y</answer>", "answer", "x <answer>y"),
    ("<search>unclosed query", "<search>unclosed query", None, ""),
    ("<answer>unclosed answer</search>", "<answer>unclosed answer</search>", None, ""),
    ("no tags at all", "no tags at all", None, ""),
    ("", "", None, ""),
    ("</search><search>q</search>", "</search>", None, ""),
    ("<search>q</search >", "<search>q</search >", None, ""),
]


@pytest.mark.parametrize("text,cut,kind,content", CUT_CASES)
def test_cut_and_parse_action(text, cut, kind, content):
    assert protocol.cut_turn(text) == cut
    assert protocol.parse_action(text) == protocol.Action(kind, content)
    assert protocol.turn_finished(text) == ("</search>" in text or "</answer>" in text)


def test_turn_finished_and_stop_strings():
    assert protocol.STOP_STRINGS == ("</search>", "</answer>")
    assert protocol.turn_finished("a</answer>")
    assert not protocol.turn_finished("a</answer")
    assert not protocol.turn_finished("<search>q</SEARCH>")


def _ids(tok, *pieces):
    """Token ids from pieces: a str is encoded, an int kept (to build non-canonical token splits)."""
    out = []
    for piece in pieces:
        out += [piece] if isinstance(piece, int) else tok.encode(piece, add_special_tokens=False)
    return out


def test_cut_turn_tokens_tag_split_across_tokens(qwen_tokenizer):
    tok = qwen_tokenizer
    text = "<think>hi</think>\n<search> capital of France </search>\n\n<information>"
    ids = tok.encode(text, add_special_tokens=False)
    # `</search>` spans the tokens ' </', 'search', '>\n\n'; the last one straddles the cut and is kept.
    assert [tok.decode([i]) for i in ids[-6:]] == [" </", "search", ">\n\n", "<", "information", ">"]
    cut = protocol.cut_turn_tokens(ids, tok)
    assert cut == protocol.TurnCut(len(ids) - 3, "<think>hi</think>\n<search> capital of France </search>")
    assert tok.decode(ids[:cut.num_tokens]) == cut.text + "\n\n"


def test_cut_turn_tokens_straddling_answer_and_search_wins(qwen_tokenizer):
    tok = qwen_tokenizer
    ids = tok.encode("<answer> Paris</answer>.", add_special_tokens=False)
    assert tok.decode(ids[-1:]) == ">."
    assert protocol.cut_turn_tokens(ids, tok) == protocol.TurnCut(len(ids), "<answer> Paris</answer>")
    # An `</answer>` first, then a `</search>`: the cut is after `</search>`, not after `</answer>`.
    ids = _ids(tok, "<answer>P</answer> x </search> after more words")
    assert protocol.cut_turn_tokens(ids, tok) == protocol.TurnCut(
        len(_ids(tok, "<answer>P</answer> x </search>")), "<answer>P</answer> x </search>")


def test_cut_turn_tokens_non_canonical_and_special_tokens(qwen_tokenizer):
    tok = qwen_tokenizer
    se, ar, ch = (tok.convert_tokens_to_ids(t) for t in ("se", "ar", "ch"))
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    # A tag sampled as odd pieces with a special token inside: decoding skips it, as Search-R1 does.
    ids = _ids(tok, "<search>q</", se, ar, im_end, ch, "> tail text")
    cut = protocol.cut_turn_tokens(ids, tok)
    assert cut.text == "<search>q</search>"
    assert ids[cut.num_tokens - 1] == tok.convert_tokens_to_ids(">")
    assert cut.num_tokens == len(_ids(tok, "<search>q</", se, ar, im_end, ch, ">"))
    # EOS right after the tag is dropped with the rest of the tail.
    ids = _ids(tok, "<answer>Paris</answer>", tok.eos_token_id)
    assert protocol.cut_turn_tokens(ids, tok) == protocol.TurnCut(len(ids) - 1, "<answer>Paris</answer>")


def test_cut_turn_tokens_multibyte_and_no_tag(qwen_tokenizer):
    tok = qwen_tokenizer
    # Characters split over byte tokens before and after the tag: prefixes decode with U+FFFD tails.
    text = "<search>北京 🦜 é</search>🦜🦜 more"
    ids = tok.encode(text, add_special_tokens=False)
    assert any(tok.decode(ids[:n]).endswith("\ufffd") for n in range(len(ids)))
    cut = protocol.cut_turn_tokens(ids, tok)
    assert cut.text == "<search>北京 🦜 é</search>"
    assert tok.decode(ids[:cut.num_tokens]).startswith(cut.text)
    assert not tok.decode(ids[:cut.num_tokens - 1]).startswith(cut.text)
    # No closing tag: every sampled token (EOS included) is kept and the text is whole.
    ids = _ids(tok, "<think>still thinking", tok.eos_token_id)
    assert protocol.cut_turn_tokens(ids, tok) == protocol.TurnCut(len(ids), "<think>still thinking")
    assert protocol.cut_turn_tokens([], tok) == protocol.TurnCut(0, "")


LONG_TEXTS = {  # pasted pages: prose and numbers, CJK sentences, emoji and line breaks, trailing blanks
    "prose": "The 1984 census, page 12: 3,456 people (est.) lived in the valley; most farmed. ",
    "cjk": "北京是中国的首都，也是一座历史悠久的城市。人口约两千万。",
    "emoji": "Great 🙂🙂 day\n\n- item one\n- item two\t(tab)\n",
    "blanks": "word " * 7 + "   \n",
}


@pytest.mark.parametrize("chat_template", [True, False])
@pytest.mark.parametrize("kind", sorted(LONG_TEXTS))
def test_a_question_bounded_as_it_is_read_keeps_the_tokens_fit_prompt_keeps(qwen_tokenizer, chat_template, kind):
    """Issue 66: a 1 MB question is bounded when it is read (its last max_prompt_tokens x 128 characters); the
    prompt fit_prompt makes of it is the whole question's, token for token, wherever the cut lands."""
    tok = copy.deepcopy(qwen_tokenizer)
    if not chat_template:
        tok.chat_template = None
    max_prompt_tokens = 256
    limit = protocol.max_question_chars(max_prompt_tokens)
    assert limit == 2 * max_prompt_tokens * 128
    for shift in range(3):  # the cut lands at another character of the text
        question = "x" * shift + LONG_TEXTS[kind] * (3 * limit // len(LONG_TEXTS[kind])) + " who founded Acme"
        bounded = protocol.bounded_question(question, max_prompt_tokens)
        assert bounded == question.strip()[-limit:]
        ids, cut = protocol.fit_prompt(tok, question, max_prompt_tokens)
        bounded_ids, bounded_cut = protocol.fit_prompt(tok, bounded, max_prompt_tokens)
        assert bounded_ids == ids and cut > bounded_cut > 0


def test_a_question_within_the_bound_is_read_unchanged():
    limit = protocol.max_question_chars(4)
    for question in ("  who wrote hamlet \n", " " * 3 * limit + "a" * limit + "\n"):
        assert protocol.bounded_question(question, 4) == question
    assert protocol.bounded_question("b" + "a" * limit, 4) == "a" * limit
