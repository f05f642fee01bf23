"""Chat: messages rendered into prompt ids with the model folder's chat template, and tool calls.

Tool choice (OpenAI's): `none` never parses calls; `required` and a named function are enforced by a
grammar (a JSON array of {name, parameters} objects, or the named function's parameters), so the
answer is always a call; `auto` lets the model choose and reads calls from its text with the parser
the server was started with (`--tool-call-parser`): `hermes` (<tool_call>{...}</tool_call>, Qwen's
and Hermes' style) or `llama3_json` (a JSON object, or several separated by ';', optionally after
<|python_tag|>, Llama 3's style).
"""

from __future__ import annotations

import json
import re
import uuid

from decode_service.openai_api.protocol import ApiError, ChatRequest


def _text(content, where: str) -> str | None:
    """A message's content as text: a string, or a list of text parts; other parts refused by name."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ApiError(400, f"{where}: content parts of type {kind!r} are not supported (text only)", where)
            out.append(str(part.get("text", "")))
        return "".join(out)
    raise ApiError(400, f"{where}: content must be a string or a list of text parts", where)


def _message(m: dict, i: int) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m.get("role"), str):
        raise ApiError(400, f"{where}: a message needs a role", where)
    out = dict(m, content=_text(m.get("content"), where))
    calls = []
    for call in m.get("tool_calls") or ():  # templates read arguments as a mapping: JSON text decoded
        fn = dict(call.get("function") or {})
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except ValueError:
                pass
        calls.append(dict(call, function=fn))
    if calls:
        out["tool_calls"] = calls
    return out


def tool_mode(req: ChatRequest, parser: str | None) -> tuple[str, str | None]:
    """(mode, grammar): mode none / auto / required / named; the JSON schema the grammar enforces."""
    tools, choice = req.tools or [], req.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return "none", None
    if not tools:
        raise ApiError(400, f"tool_choice {choice!r} needs tools", "tool_choice")
    functions = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ApiError(400, f"tools[{i}] must be {{type: function, function: {{name, parameters}}}}", "tools")
        functions[fn["name"]] = fn.get("parameters") or {"type": "object"}
    if choice == "auto":
        if parser is None:
            raise ApiError(400, "tool_choice 'auto' needs the server started with --tool-call-parser", "tool_choice")
        return "auto", None
    if choice == "required":
        items = [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
                  "required": ["name", "parameters"]} for name, schema in functions.items()]  # fmt: skip
        array = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not req.parallel_tool_calls:
            array["maxItems"] = 1
        return "required", json.dumps(array)
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    if name not in functions:
        raise ApiError(400, f"tool_choice names no tool of the request: {name!r}", "tool_choice")
    return "named", json.dumps(functions[name])


def render(tokenizer, req: ChatRequest, with_tools: bool) -> list[int]:
    """The prompt ids of the conversation, through the model's chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, "this model has no chat template: use /v1/completions", "messages")
    if req.continue_final_message and (req.add_generation_prompt or req.messages[-1].get("role") != "assistant"):
        raise ApiError(400, "continue_final_message needs add_generation_prompt false and a last assistant "
                       "message", "continue_final_message")  # fmt: skip
    messages = [_message(m, i) for i, m in enumerate(req.messages)]
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tools=req.tools if with_tools else None,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            tokenize=False,
            **(req.chat_template_kwargs or {}),
        )
    except Exception as e:  # the template's own checks (jinja raise_exception), or a bad message
        raise ApiError(400, f"the chat template refused the messages: {e}", "messages") from None
    return tokenizer.encode(text, add_special_tokens=False)


def _call(name: str, arguments) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": args}}


def forced_calls(mode: str, text: str, named: str | None) -> list[dict] | None:
    """The calls of a grammar-forced answer (required: the array; named: the arguments), or None when
    the text is not the whole grammar (cut by max_tokens)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if mode == "named":
        return [_call(named, value)]
    return [_call(c["name"], c["parameters"]) for c in value]


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_calls(parser: str, text: str) -> tuple[str | None, list[dict]]:
    """(content, calls) of an `auto` answer; text that holds no well-formed call is all content."""
    if parser == "hermes":
        calls = []
        for body in _HERMES.findall(text):
            try:
                obj = json.loads(body)
                calls.append(_call(obj["name"], obj.get("arguments", {})))
            except (ValueError, KeyError, TypeError):
                return text, []
        if not calls:
            return text, []
        content = text[: text.index("<tool_call>")].strip()
        return content or None, calls
    rest = text.strip().removeprefix("<|python_tag|>").strip()
    calls, decoder = [], json.JSONDecoder()
    while rest:
        try:
            obj, end = decoder.raw_decode(rest)
            calls.append(_call(obj["name"], obj.get("parameters", obj.get("arguments", {}))))
        except (ValueError, KeyError, TypeError):
            return text, []
        rest = rest[end:].strip().removeprefix(";").strip()
    return (None, calls) if calls else (text, [])
