"""Grammar-constrained decoding: JSON schemas and tool calls enforced token by token.

llguidance is the engine (see tests/bench/grammar_bench.py for why, with numbers): its tokenizer
is built once per loaded model, compiled grammars are cached in a bounded LRU keyed by the grammar
text, and each constrained sequence gets its own matcher inside a logits processor, so
constrained and unconstrained sequences share one batch. Masks are applied to MLX logits with a
compiled bit-unpack and `mx.where` (llguidance's own MLX helper is a Metal kernel).

Grammars are written in llguidance's Lark dialect: JSON values through `%json {schema}` (which
enforces what JSON Schema asks, and refuses what it cannot), Qwen's special tokens (`<tool_call>`,
`</think>`) by name. A thinking model's reasoning stays free: the constraint starts after
`</think>`.
"""

from __future__ import annotations

import copy
import time
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import mlx.core as mx
import numpy as np


class GrammarError(ValueError):
    """A schema or tool definition the engine cannot enforce; `param` names where."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


# ----------------------------------------------------------------------------- grammar text
def _lit(text: str) -> str:
    return json.dumps(text)


def strictify(schema: dict) -> dict:
    """OpenAI strict mode: every object schema that leaves additionalProperties open closes it."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if (node.get("type") == "object" or "properties" in node) and \
                    "additionalProperties" not in node:
                node["additionalProperties"] = False
            for key, value in node.items():
                if key in ("properties", "$defs", "definitions", "patternProperties"):
                    for sub in (value or {}).values():
                        walk(sub)
                elif key in ("items", "additionalProperties", "not", "if", "then", "else",
                             "contains", "propertyNames"):
                    walk(value)
                elif key in ("anyOf", "oneOf", "allOf", "prefixItems"):
                    for sub in value or []:
                        walk(sub)
        return node

    return walk(schema)


# JSON as json.dumps writes it: a small model given free whitespace can fill the budget with it
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_rule(schema: dict) -> str:
    if isinstance(schema, dict) and "x-guidance" not in schema:
        schema = {**schema, "x-guidance": JSON_STYLE}
    return "%json " + json.dumps(schema, separators=(",", ":"))  # property order matters


_STRING_LIMITS = ("pattern", "format", "minLength", "maxLength")


def _xml_value_rule(name: str, schema: dict, where: str) -> str:
    """The grammar of one <parameter=...> value in Qwen3.5's XML form: strings are raw text,
    everything else is JSON (what the template writes with tojson)."""
    if schema.get("type") == "string" and "enum" not in schema and "const" not in schema:
        for key in _STRING_LIMITS:
            if key in schema:
                raise GrammarError(f"{where}: a string parameter's {key!r} cannot be enforced in "
                                   "Qwen3.5's XML tool-call format; drop it or use an enum", where)
        return "xml_text"
    if schema.get("type") == "string" or (schema.get("enum") and all(
            isinstance(v, str) for v in schema["enum"])):
        values = schema.get("enum") or [schema.get("const")]
        return "(" + " | ".join(_lit(str(v)) for v in values) + ")"
    return json_rule(schema)


def _xml_function(fn: dict, where: str, constrain: bool) -> str:
    name = fn["name"]
    head = _lit(f"<function={name}>\n")
    if not constrain:
        return f'{head} xml_any_param* "</function>"'
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    props = params.get("properties") or {}
    required = params.get("required") or []
    for key in ("patternProperties", "minProperties", "maxProperties", "dependentRequired"):
        if key in params:
            raise GrammarError(f"{where}.parameters: {key!r} cannot be enforced in Qwen3.5's XML "
                               "tool-call format", where)
    parts = []
    for pname, pschema in props.items():
        value = _xml_value_rule(pname, pschema or {}, f"{where}.parameters.properties.{pname}")
        close = "" if value == "xml_text" else ' "\\n</parameter>\\n"'
        item = f'{_lit(f"<parameter={pname}>" + chr(10))} {value}{close}'
        parts.append(f"({item})" if pname in required else f"({item})?")
    return f'{head} {" ".join(parts)} "</function>"'


def tool_call_grammar(tools: list[dict], *, only: str | None = None, required: bool = True,
                      parallel: bool = True, fmt: str = "xml", constrain_all: bool = True) -> str:
    """Lark grammar of the assistant's tool calls. required=False (tool_choice auto with strict
    functions): free text, then optionally calls. `only` forces one named function."""
    fns = [t.get("function", t) for t in tools]
    if only is not None:
        fns = [f for f in fns if f["name"] == only]
        if not fns:
            raise GrammarError(f"tool_choice names {only!r}, which is not among the tools",
                               "tool_choice")
    alts = []
    for i, fn in enumerate(fns):
        where = f"tools[{i}].function"
        constrain = constrain_all or bool(fn.get("strict"))
        if fmt == "xml":
            alts.append(_xml_function(fn, where, constrain))
        else:
            params = fn.get("parameters") or {"type": "object"}
            if fn.get("strict"):
                params = strictify(params)
            schema = {"type": "object", "additionalProperties": False,
                      "required": ["name", "arguments"],
                      "properties": {"name": {"const": fn["name"]},
                                     "arguments": params if constrain else {"type": "object"}}}
            alts.append(json_rule(schema))
    body = " | ".join(f"({a})" for a in alts)
    call = f'<tool_call> "\\n" ({body}) "\\n" </tool_call>'
    calls = "call (\"\\n\" call)*" if parallel else "call"
    lines = [f"call: {call}"]
    if fmt == "xml":
        # a string value runs to the first "\n</parameter>\n" (which it includes)
        lines += ['xml_text[lazy]: /(.|\\n)*\\n<\\/parameter>\\n/',
                  'xml_any_param: "<parameter=" /[A-Za-z0-9_.\\-]+/ ">\\n" xml_text']
    if required:
        lines.insert(0, f"answer: {calls}")
    else:
        lines.insert(0, f"answer: TEXT? ({calls})?")
        lines.append("TEXT: /(.|\\n)+/")
    return "\n".join(lines)


def answer_grammar(answer: str, thinking: bool) -> str:
    """The whole completion: with thinking, free reasoning up to `</think>`, then `answer`."""
    if thinking:
        head = 'start: REASONING? </think> /[ \\n]*/ answer\nREASONING: /(.|\\n)+/\n'
    else:
        head = "start: answer\n"
    return head + answer


def json_grammar(schema: dict | None, strict: bool, thinking: bool) -> str:
    if schema is None:
        schema = {"type": "object"}
    elif strict:
        schema = strictify(schema)
    return answer_grammar(f"answer: {json_rule(schema)}", thinking)


# ----------------------------------------------------------------------------- the engine
@dataclass
class CompiledGrammar:
    text: str
    compile_ms: float
    prototype: object  # a fresh LLMatcher; each sequence decodes with a deep copy of it


def _byte_level(hf_tokenizer) -> bool:
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    return backend is not None and type(backend.decoder).__name__ == "ByteLevel"


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character a BPE token uses for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def _shared_tokenizer(hf_tokenizer, vocab_size: int, eos_ids: list[int]):
    """llguidance's tokenizer over the model's own tokenizer instead of a second copy of it.

    `llguidance.hf.from_tokenizer` serialises the tokenizer and parses it again inside
    llguidance: a second full Hugging Face tokenizer, +431 MB of resident memory at Qwen3.5's
    248,320-token vocabulary (as much as the 0.8B shape's 4-bit variant, 439 MB). llguidance only
    needs each token's bytes (for its token trie and masks) and a way to tokenize text (grammar
    literals): the bytes here, the tokenizer we already hold for the rest, about +50 MB. Added
    tokens carry llguidance's special-token marker (0xFF), ids with no token are reserved
    special ones, exactly as llguidance reads a tokenizer itself (tests/test_grammar.py compares
    every token)."""
    import llguidance

    backend = hf_tokenizer.backend_tokenizer
    added = backend.get_added_tokens_decoder()
    to_byte = _byte_decoder()
    tokens = [b"\xff<[%d]>" % i for i in range(vocab_size)]
    special = set(range(vocab_size))
    for text, i in backend.get_vocab(with_added_tokens=True).items():
        if i >= vocab_size:
            continue
        if i in added:  # as llguidance reads them: every added token is special (<tool_call>)
            tokens[i] = b"\xff" + text.encode()
        else:
            tokens[i] = bytes(to_byte[c] for c in text)
            special.discard(i)

    class Tokens:
        eos_token_id = eos_ids[0] if eos_ids else None
        bos_token_id = None
        special_token_ids = sorted(special)

        def __init__(self):
            self.tokens = tokens

        def __call__(self, text):
            if not isinstance(text, str):  # llguidance then passes text, and handles bytes itself
                raise TypeError("text only")
            return backend.encode(text, add_special_tokens=False).ids

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Tokens()), n_vocab=vocab_size,
                                  eos_token=eos_ids or None)


class GrammarEngine:
    """llguidance bound to one tokenizer and vocabulary size (the model's logits width)."""

    name = "llguidance"

    def __init__(self, hf_tokenizer, vocab_size: int, eos_ids: list[int], cache_size: int = 128):
        import llguidance
        import llguidance.hf

        self._ll = llguidance
        self.vocab_size = vocab_size
        self.tokenizer = (_shared_tokenizer(hf_tokenizer, vocab_size, list(eos_ids))
                          if _byte_level(hf_tokenizer) else
                          llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size,
                                                       eos_token=list(eos_ids) or None))
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.last_compile_ms = 0.0

    def compile(self, grammar: str) -> CompiledGrammar:
        """Compile (the expensive, cached part) or raise GrammarError with llguidance's reason."""

        with self._lock:
            hit = self._cache.get(grammar)
            if hit is not None:
                self._cache.move_to_end(grammar)
                self.hits += 1
                return hit
        started = time.perf_counter()
        matcher = self._ll.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(_short_error(matcher.get_error()))
        compiled = CompiledGrammar(grammar, (time.perf_counter() - started) * 1000, matcher)
        with self._lock:
            self.misses += 1
            self.last_compile_ms = compiled.compile_ms
            self._cache[grammar] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def processor(self, compiled: CompiledGrammar) -> GrammarProcessor:
        return GrammarProcessor(compiled.prototype.deep_copy(), self.vocab_size)


def _short_error(text: str) -> str:
    first = text.strip().splitlines()[0] if text.strip() else "invalid grammar"
    return first[:400]


# from numpy, so the constant is data, not a lazy op bound to the importing thread's stream
_SHIFTS = mx.array(np.arange(32, dtype=np.uint32))


@mx.compile
def _apply_mask(logits: mx.array, words: mx.array) -> mx.array:
    bits = (words.astype(mx.uint32)[:, None] >> _SHIFTS) & 1
    allowed = bits.reshape(-1)[: logits.shape[-1]].astype(mx.bool_)
    return mx.where(allowed, logits, mx.array(-mx.inf, dtype=logits.dtype))


class GrammarProcessor:
    """An mlx-lm logits processor: feeds the last sampled token to the matcher, masks the rest.

    mlx-lm calls it once per generated token with the sequence so far; the first call comes
    before any token was generated (its last token is the prompt's)."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.calls = 0
        self.failed: str | None = None

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self.calls:
            token = int(tokens[-1].item())
            if not self.matcher.consume_token(token) and self.failed is None:
                self.failed = _short_error(self.matcher.get_error())
        self.calls += 1
        words = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.int32)
        masked = _apply_mask(logits.reshape(-1), mx.array(words))
        return masked.reshape(logits.shape)


class GrammarReplay:
    """The masks a finished sequence decoded under, position by position: what the grammar
    allowed before each generated token (the fidelity worker compares distributions over those).
    After a token the grammar refused (or after it ended), positions are unconstrained."""

    def __init__(self, compiled: CompiledGrammar):
        self.matcher = compiled.prototype.deep_copy()
        self.alive = True

    def rows(self, tokens: list[int], width: int) -> mx.array:
        """Allowed-token masks [len(tokens), width] (bool), consuming `tokens` as it goes."""
        out = []
        for token in tokens:
            if self.alive and not self.matcher.is_stopped():
                words = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.int32)
                bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:width].astype(bool)
                self.alive = self.matcher.consume_token(token)
            else:
                bits = np.ones(width, dtype=bool)
            out.append(bits)
        return mx.array(np.stack(out)) if out else mx.zeros((0, width), dtype=mx.bool_)


def chat_grammar(tools: list[dict] | None, tool_choice, parallel: bool,
                 response_format: dict | None, thinking: bool, fmt: str,
                 names_under_auto: bool = False) -> str | None:
    """The grammar a chat request asks for, or None when its output is free.

    - tool_choice "required" / a named function: only tool calls (of that function).
    - tool_choice "auto" with a `strict` function (or any tools, with names_under_auto): free
      text, or calls that name an offered function; strict functions' arguments follow their
      schema.
    - response_format json_object / json_schema: the JSON answer (or, with tools under "auto",
      tool calls instead)."""
    forced = tool_choice == "required" or isinstance(tool_choice, dict)
    rf = response_format or {}
    kind = rf.get("type", "text")
    if kind not in ("text", "json_object", "json_schema"):
        raise GrammarError(f"response_format type {kind!r} is not one of text, json_object, "
                           "json_schema", "response_format")
    if forced:
        only = None
        if isinstance(tool_choice, dict):
            only = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
            if tool_choice.get("type", "function") != "function" or not only:
                raise GrammarError('tool_choice must be "none", "auto", "required" or '
                                   '{"type": "function", "function": {"name": ...}}', "tool_choice")
        return answer_grammar(tool_call_grammar(tools or [], only=only, parallel=parallel,
                                                fmt=fmt), thinking)
    offer_tools = bool(tools) and tool_choice != "none"
    strict_tools = offer_tools and any((t.get("function") or t).get("strict") for t in tools)
    if kind == "text":
        if not strict_tools and not (offer_tools and names_under_auto):
            return None
        return answer_grammar(tool_call_grammar(tools, required=False, parallel=parallel, fmt=fmt,
                                                constrain_all=False), thinking)
    if kind == "json_object":
        schema, strict = None, False
    else:
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise GrammarError("response_format json_schema needs a json_schema object with a "
                               "schema", "response_format")
        schema, strict = spec.get("schema") or {"type": "object"}, bool(spec.get("strict"))
        if strict:
            schema = strictify(schema)
    json_answer = json_rule(schema or {"type": "object"})
    if not offer_tools:
        return answer_grammar(f"answer: {json_answer}", thinking)
    calls = tool_call_grammar(tools, required=True, parallel=parallel, fmt=fmt,
                              constrain_all=False).replace("answer:", "calls:", 1)
    return answer_grammar(f"answer: {json_answer} | calls\n{calls}", thinking)
