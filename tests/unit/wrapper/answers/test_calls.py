"""How a chat template writes a tool call before its arguments, read from two renders (wrapper/answers/calls.py):
the renders are shaped as llama-server's /apply-template answers for Llama 3.1's and Hermes 2 Pro's templates
for a call whose arguments are the marker (tests/integration/test_crash.py learns them from the real server)."""

from __future__ import annotations

from wrapper.answers.calls import JOINTS, LEADS, MARKER, laid_out, markup, prefills

ASKED = "<|start_header_id|>user<|end_header_id|>\n\n?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"


def test_llama_31_writes_its_json_call_before_the_arguments() -> None:
    after = ASKED + '{"name": "write_file", "parameters": {"' + MARKER + '": 0}}<|eot_id|>' \
        "<|start_header_id|>user<|end_header_id|>\n\n?<|eot_id|>"
    assert markup(ASKED, after, "write_file") == '{"name": "write_file", "parameters": '


def test_hermes_writes_its_tool_call_tag() -> None:
    before = "<|im_start|>user\n?<|im_end|>\n<|im_start|>assistant\n"
    after = before + '<tool_call>\n{"name": "get_weather", "arguments": {"' + MARKER + '": 0}}\n</tool_call>' \
        "<|im_end|>\n<|im_start|>user\n?<|im_end|>\n"
    assert markup(before, after, "get_weather") == '<tool_call>\n{"name": "get_weather", "arguments": '


def test_a_template_that_opens_the_turn_otherwise_or_drops_the_call_is_not_read() -> None:
    thinking = ASKED + "<think>\n"  # a generation prompt the rendered turn does not begin with
    assert markup(thinking, ASKED + '{"name": "f", "parameters": {"' + MARKER + '": 0}}', "f") is None
    assert markup(ASKED, ASKED + "I would call a tool.<|eot_id|>", "f") is None  # the call not rendered


def test_the_markup_is_laid_out_as_the_model_laid_out_the_arguments() -> None:
    """The demo wrote `{\\n    "name": …` where Llama 3.1's template writes `{"name": …`: the arguments the client has
    show the layout (keys two levels in)."""
    llama = '{"name": "write_file", "parameters": '
    assert laid_out(llama, '{\n        "path": "a"') == '{\n    "name": "write_file",\n    "parameters": '
    assert laid_out(llama, '{"path": "a"') == llama  # on one line: as the template writes it
    hermes = '<tool_call>\n{"name": "get_weather", "arguments": '
    assert laid_out(hermes, '{\n    "city"') == '<tool_call>\n{\n  "name": "get_weather",\n  "arguments": '
    assert laid_out("[TOOL_CALLS]get_weather[ARGS]", '{\n    "city"') == "[TOOL_CALLS]get_weather[ARGS]"  # no JSON


def test_the_ways_an_answer_may_have_been_written_likeliest_first() -> None:
    """What the parser drops (a newline before the text, one between it and the call) and the markup's two
    layouts: each once, the model's layout and nothing dropped first."""
    ways = prefills("Sure.", '{"name": "f", "parameters": ', '{\n        "a": 1')
    laid = '{\n    "name": "f",\n    "parameters": '
    assert ways[0] == "Sure." + laid + '{\n        "a": 1'
    assert ways[1] == "\nSure." + laid + '{\n        "a": 1'
    assert len(ways) == len(set(ways)) == 2 * len(LEADS) * len(JOINTS)
    assert "Sure.\n" + '{"name": "f", "parameters": ' + '{\n        "a": 1' in ways
    assert len(prefills("", '{"name": "f", "parameters": ', '{"a": 1')) == len(LEADS)  # no text: nothing between
