"""Generates the training corpus and the held-out evaluation prompts of the embedded model.

A document is a chat in OpenAI message form plus the tools offered; the chat template turns it
into text. Kinds: tool-calling episodes (call -> result -> answer, parallel calls, multi-round),
requests that need no tool (with and without tools offered), multi-turn chat, short code, JSON
answers to schema-like instructions, and copy drills. Held-out prompts use phrasings and
(function, value) pairs that training never shows.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass

from . import catalogue as C
from . import toolspace as T

KINDS = ("tool", "parallel", "gen_tool", "gen_two", "gen_no_fit", "agent", "no_tool",
         "no_tool_gen", "chat", "code", "json", "copy")
# The mix the shipped embedded model was trained on: share of each kind after the warm-up phase.
MIX = {"tool": 0.38, "parallel": 0.05, "no_tool": 0.20, "chat": 0.09, "code": 0.05,
       "json": 0.08, "copy": 0.15}
# copy-first phase: short documents whose answers copy from the question
COPY_PHASE_MIX = {"copy": 0.6, "chat": 0.2, "json": 0.2}
WARMUP_MIX = {"tool": 0.30, "parallel": 0.02, "no_tool": 0.06, "chat": 0.05, "code": 0.02,
              "json": 0.10, "copy": 0.45}
# With the generated tool space (toolspace.py, issue 15): gen_tool a generated function among
# decoys, gen_two two functions in one request, gen_no_fit a request no offered tool fits,
# agent a long loop over one tool set, no_tool_gen a question needing no tool with generated
# tools offered. The catalogue's kinds stay a part of it.
TOOLSPACE_MIX = {"tool": 0.14, "parallel": 0.03, "gen_tool": 0.22, "gen_two": 0.05,
                 "gen_no_fit": 0.12, "agent": 0.05, "no_tool": 0.07, "no_tool_gen": 0.07,
                 "chat": 0.06, "code": 0.03, "json": 0.06, "copy": 0.10}
TOOLSPACE_WARMUP_MIX = {"tool": 0.20, "parallel": 0.02, "gen_tool": 0.15, "no_tool": 0.05,
                        "chat": 0.05, "code": 0.02, "json": 0.08, "copy": 0.43}
# held-out documents of the generated kinds alone (their loss per kind, beside MIX's kinds)
GENERATED_MIX = {"gen_tool": 0.4, "gen_two": 0.1, "gen_no_fit": 0.2, "agent": 0.1, "no_tool_gen": 0.2}
# train-tiny's `mix` setting: (mix, warm-up mix)
MIXES = {"catalogue": (MIX, WARMUP_MIX), "toolspace": (TOOLSPACE_MIX, TOOLSPACE_WARMUP_MIX)}


def _stable_hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little")


def is_heldout_value(function: str, value: str) -> bool:
    """About 1 in 7 (function, value) pairs never appears in training."""
    return _stable_hash(f"{function}|{value}") % 7 == 0


def phrasings(fn: C.Function, split: str) -> list[str]:
    """Whole-sentence phrasings: the last HOLDOUT_PHRASINGS are the "novel" split."""
    k = C.HOLDOUT_PHRASINGS
    return fn.phrasings[:-k] if split == "train" else fn.phrasings[-k:]


def request_text(fn: C.Function, args: dict[str, str], rng: random.Random, split: str,
                 wrap: bool = True) -> str:
    """What the user writes. "train": a trained whole sentence or frame x request combination;
    "heldout": a frame x request combination training never showed; "novel": a whole sentence
    training never showed (new words too). Openers and closers wrap all but "novel"."""
    if split == "novel":
        return rng.choice(phrasings(fn, "novel")).format(**args)
    if split == "train" and rng.random() < 0.4:
        text = rng.choice(phrasings(fn, "train"))
    else:
        text = rng.choice(C.composed_phrasings(fn.name, split))
    text = text.format(**args)
    return C.wrap(text, rng) if wrap and rng.random() < 0.5 else text


def sample_args(fn: C.Function, rng: random.Random, split: str = "train",
                made_up: float = 0.0) -> dict[str, str]:
    """Argument strings for `fn`, as the user will write them."""
    args: dict[str, str] = {}
    for p in fn.params:
        sampler = p.sample
        if sampler in C.GENERATED:
            args[p.name] = C.GENERATED[sampler](rng)
            continue
        if sampler in C.MADE_UP_OK and rng.random() < made_up:
            args[p.name] = C.made_up_word(rng)
            continue
        pool = list(C.POOLS[sampler])
        for _ in range(200):
            value = rng.choice(pool)
            if value in args.values():
                continue
            if (split == "train") != is_heldout_value(fn.name, value):
                break
        args[p.name] = value
    return args


def typed(fn: C.Function, args: dict[str, str]) -> dict:
    """Arguments converted to their schema types (what a client receives as JSON)."""
    out: dict = {}
    for p in fn.params:
        raw = args[p.name]
        if p.type == "integer":
            out[p.name] = int(raw)
        elif p.type == "number":
            out[p.name] = float(raw) if "." in raw else int(raw)
        else:
            out[p.name] = raw
    return out


CONDITIONS = "sunny cloudy rainy windy foggy snowy stormy clear".split()


def tool_result(fn: C.Function, args: dict[str, str], rng: random.Random) -> dict:
    """A plausible result of calling `fn`; every value the final answer cites is in here."""
    r = rng.randint
    extra = {
        "get_weather": lambda: {"temperature_c": r(-15, 38), "condition": rng.choice(CONDITIONS)},
        "get_current_time": lambda: {"time": f"{r(0, 23):02d}:{r(0, 59):02d}"},
        "get_stock_price": lambda: {"price": f"{r(5, 900)}.{r(0, 99):02d}"},
        "convert_currency": lambda: {"converted": f"{r(1, 99999)}.{r(0, 99):02d}"},
        "send_email": lambda: {"status": "sent"},
        "search_web": lambda: {"title": f"A short guide to {args.get('query', '')}"},
        "set_timer": lambda: {"status": "running"},
        "translate_text": lambda: {"translation": C.made_up_word(rng).lower() + " "
                                   + C.made_up_word(rng).lower()},
        "create_calendar_event": lambda: {"status": "created"},
        "get_news": lambda: {"headline": f"{rng.choice(C.CITIES)} hosts {args.get('topic', '')} summit"},
        "book_flight": lambda: {"reference": f"{rng.choice(C.AIRLINES)}{r(100, 999)}"},
        "get_directions": lambda: {"distance_km": r(5, 2500), "hours": r(1, 30)},
        "play_music": lambda: {"status": "playing"},
        "set_reminder": lambda: {"status": "scheduled"},
        "calculate": lambda: {"result": _evaluate(args.get("expression", "0"))},
        "get_exchange_rate": lambda: {"rate": f"{r(0, 150)}.{r(0, 9999):04d}"},
        "find_restaurant": lambda: {"restaurant": f"{C.made_up_word(rng)} Kitchen"},
        "get_population": lambda: {"population": r(1, 1400)},
        "check_flight_status": lambda: {"status": rng.choice(["on time", "delayed", "landed",
                                                              "boarding", "cancelled"])},
        "order_food": lambda: {"status": "ordered"},
        "define_word": lambda: {"definition": rng.choice(
            ["a quality that is hard to describe", "showing great care", "lasting a short time",
             "found everywhere", "strong and hard to break", "full of energy"])},
        "get_crypto_price": lambda: {"price": f"{r(1, 90000)}.{r(0, 99):02d}"},
        "convert_units": lambda: {"converted": f"{r(0, 9999)}.{r(0, 99):02d}"},
        "get_air_quality": lambda: (lambda aqi: {"aqi": aqi, "level": "good" if aqi < 50 else
                                    "moderate" if aqi < 100 else "unhealthy"})(r(5, 250)),
    }[fn.name]()
    return {**typed(fn, args), **extra}


def _evaluate(expression: str) -> str:
    a, op, b = expression.split()
    x, y = int(a), int(b)
    value = {"+": x + y, "-": x - y, "*": x * y, "/": round(x / y, 2)}[op]
    return str(value)


def tool_call(fn: C.Function, args: dict[str, str]) -> dict:
    return {"type": "function",
            "function": {"name": fn.name, "arguments": typed(fn, args)}}


def offered_tools(right: list[C.Function], rng: random.Random, lo: int = 2, hi: int = 4) -> list[dict]:
    names = {f.name for f in right}
    others = [f for f in C.FUNCTIONS if f.name not in names]
    count = max(rng.randint(lo, hi), len(right))
    chosen = list(right) + rng.sample(others, count - len(right))
    rng.shuffle(chosen)
    return [f.schema() for f in chosen]


SYSTEM_PROMPTS = ["You are a helpful assistant.", "You are a concise assistant.",
                  "You are an assistant that uses tools when they help.",
                  "Answer briefly and call a tool when needed."]


def _system(rng: random.Random) -> list[dict]:
    return [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] if rng.random() < 0.4 else []


def _think_for_call(fn: C.Function, args: dict[str, str]) -> str:
    values = ", ".join(f"{k} {v}" for k, v in args.items())
    return f"The user needs {fn.name} with {values}. I will call it."


def tool_episode(rng: random.Random, split: str = "train", think: bool = False,
                 made_up: float = 0.2) -> dict:
    fn = rng.choice(C.FUNCTIONS)
    args = sample_args(fn, rng, split, made_up)
    user = request_text(fn, args, rng, split)
    tools = offered_tools([fn], rng, 2, 4)
    call = tool_call(fn, args)
    result = tool_result(fn, args, rng)
    messages = _system(rng) + [{"role": "user", "content": user}]
    turn = {"role": "assistant", "content": "", "tool_calls": [call]}
    if think:
        turn["reasoning_content"] = _think_for_call(fn, args)
    messages += [turn, {"role": "tool", "content": json.dumps(result)}]
    final = {"role": "assistant", "content": fn.answer.format(**{**args, **{k: str(v) for k, v in result.items()}})}
    if think:
        final["reasoning_content"] = "The tool answered. I will report the result."
    messages.append(final)
    rounds = 1
    while rounds < 4 and rng.random() < 0.45:  # further rounds in the same conversation
        rounds += 1
        fn2 = rng.choice(C.FUNCTIONS)
        if not any(t["function"]["name"] == fn2.name for t in tools):
            tools.append(fn2.schema())
        messages += _round(fn2, rng, split, made_up)
    return {"kind": "tool", "messages": messages, "tools": tools, "enable_thinking": think}


def _round(fn: C.Function, rng: random.Random, split: str, made_up: float = 0.2) -> list[dict]:
    """One round of an agent loop with a catalogue function: request, call, result, answer."""
    args = sample_args(fn, rng, split, made_up)
    result = tool_result(fn, args, rng)
    return [{"role": "user", "content": request_text(fn, args, rng, split)},
            {"role": "assistant", "content": "", "tool_calls": [tool_call(fn, args)]},
            {"role": "tool", "content": json.dumps(result)},
            {"role": "assistant", "content": fn.answer.format(
                **{**args, **{k: str(v) for k, v in result.items()}})}]


def agent_episode(rng: random.Random, split: str = "train") -> dict:
    """A long agent loop over one tool set (3-5 catalogue or generated functions): 4-18 rounds
    of request -> call -> result -> answer, now and then a question that needs no tool. What an
    agent framework sends after a dozen turns; rows of 1,024 tokens never showed past round 8."""
    messages = _system(rng)
    rounds = rng.randint(4, 18)
    if rng.random() < 0.5:
        functions = rng.sample(C.FUNCTIONS, rng.randint(3, 5))
        tools = [f.schema() for f in functions]
        for _ in range(rounds):
            if rng.random() < 0.15:
                q, a = _plain_qa(rng, split)
                messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            else:
                messages += _round(rng.choice(functions), rng, split)
        return {"kind": "agent", "messages": messages, "tools": tools, "enable_thinking": False}
    generated = T.agent_tools(rng, _space(split), rng.randint(3, 5))
    for _ in range(rounds):
        if rng.random() < 0.15:
            q, a = _plain_qa(rng, split)
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        else:
            messages += T.round_messages(rng.choice(generated), rng)
    return {"kind": "agent", "messages": messages, "tools": [t.schema() for t in generated],
            "enable_thinking": False}


def parallel_episode(rng: random.Random, split: str = "train", think: bool = False) -> dict:
    fn = rng.choice([f for f in C.FUNCTIONS if len(f.params) == 1 and f.params[0].sample == "city"]
                    or C.FUNCTIONS)
    a1 = sample_args(fn, rng, split)
    a2 = sample_args(fn, rng, split)
    p = fn.params[0].name
    if a1[p] == a2[p]:
        a2[p] = C.made_up_word(rng)
    ask = request_text(fn, a1, rng, split, wrap=False).rstrip("?.!")
    user = f"{ask} and in {a2[p]}?" if rng.random() < 0.5 else f"{ask}. Also for {a2[p]}."
    r1, r2 = tool_result(fn, a1, rng), tool_result(fn, a2, rng)
    ans = (fn.answer.format(**{**a1, **{k: str(v) for k, v in r1.items()}}) + " "
           + fn.answer.format(**{**a2, **{k: str(v) for k, v in r2.items()}}))
    messages = _system(rng) + [
        {"role": "user", "content": user},
        {"role": "assistant", "content": "", "tool_calls": [tool_call(fn, a1), tool_call(fn, a2)]},
        {"role": "tool", "content": json.dumps(r1)},
        {"role": "tool", "content": json.dumps(r2)},
        {"role": "assistant", "content": ans},
    ]
    return {"kind": "parallel", "messages": messages, "tools": offered_tools([fn], rng),
            "enable_thinking": think}


# ----------------------------------------------------------------------------- plain answers
NEXT_DAY = {d: C.WEEKDAYS[(i + 1) % 7] for i, d in enumerate(C.WEEKDAYS)}
JOKES = ["Why did the computer sneeze? It had a virus.",
         "I told my plant a joke. It did not laugh, but it grew on me.",
         "Why do programmers like dark mode? Because light attracts bugs."]


def _plain_qa(rng: random.Random, split: str) -> tuple[str, str]:
    """A request that needs no tool, and its answer. Like tool requests: whole sentences (the
    last of each is the "novel" split) and requests in the shared frames (some combinations
    held out), wrapped in the same openers and closers, so that neither a frame nor a greeting
    tells the model whether to call a tool: only what is asked does."""
    country = rng.choice(list(C.COUNTRIES))
    a, b = rng.randint(1, 20), rng.randint(1, 20)
    x, y = rng.sample(range(10, 999), 2)
    day = rng.choice(C.WEEKDAYS)
    name = rng.choice(C.NAMES)
    topic = rng.choice(C.SEARCH_TOPICS)
    options = [
        (["What is the capital of {c}?", "Which city is the capital of {c}?", "Name the capital of {c}."],
         ["tell me the capital of {c}", "name the capital city of {c}", "say which city is the capital of {c}"],
         "The capital of {c} is {cap}."),
        (["What is {a} plus {b}?", "Add {a} and {b}.", "What do {a} and {b} make together?"],
         ["add {a} and {b}", "add up {a} plus {b}", "tell me the sum of {a} and {b}"],
         "{a} plus {b} is {s}."),
        (["Which is bigger, {x} or {y}?", "Is {x} larger than {y}?", "Compare {x} and {y}."],
         ["compare {x} and {y}", "tell me which is bigger, {x} or {y}", "say whether {x} or {y} is larger"],
         "{big} is bigger than {small}."),
        (["What day comes after {d}?", "Which day follows {d}?", "If today is {d}, what is tomorrow?"],
         ["tell me the day after {d}", "name the day that follows {d}", "say which day comes after {d}"],
         "The day after {d} is {nd}."),
        (["Hi, I am {n}.", "Hello! My name is {n}.", "Hey there, {n} here."],
         ["say hello to {n}", "greet {n}", "welcome {n}"],
         "Hello {n}! How can I help you today?"),
        (["Tell me a joke.", "Make me laugh.", "Do you know a good joke?"],
         ["tell me a joke", "make me laugh with a joke", "share a funny joke"], "{joke}"),
        (["Who are you?", "What are you?", "Introduce yourself."],
         ["introduce yourself", "tell me who you are", "describe what you are"],
         "I am a small assistant model. I can chat and call tools."),
        (["Thanks!", "Thank you so much.", "Great, thanks for the help."],
         [], "You're welcome! Anything else?"),
        (["Give me one fact about {t}.", "Say something about {t}.", "What do you know about {t}?"],
         ["tell me one fact about {t}", "say something about {t}", "share a fact about {t}"],
         "{T} is a popular subject, and there is a lot to learn about it."),
        (["Count from {a} to {a4}.", "List the numbers from {a} to {a4}.", "Count up from {a} to {a4}."],
         ["count from {a} to {a4}", "list the numbers from {a} to {a4}", "count up from {a} to {a4}"],
         "{seq}"),
        (["Spell the word {w}.", "How do you spell {w}?", "Write {w} letter by letter."],
         ["spell the word {w}", "spell {w} for me letter by letter", "write out {w} letter by letter"],
         "{spelled}"),
    ]
    index = rng.randrange(len(options))
    templates, requests, answer = options[index]
    if split == "novel" or not requests:
        template = rng.choice(templates[:-1]) if split == "train" else templates[-1]
    elif split == "train" and rng.random() < 0.4:
        template = rng.choice(templates[:-1])
    else:
        combos = [(i, j) for i in range(len(C.FRAMES)) for j in range(len(requests))
                  if C.composed_heldout(f"plain{index}", i, j) == (split == "heldout")
                  and (split == "train" or C.compose(C.FRAMES[i], requests[j]) not in templates)]
        i, j = rng.choice(combos)
        template = C.compose(C.FRAMES[i], requests[j])
    w = rng.choice(C.WORDS)
    fields = dict(c=country, cap=C.COUNTRIES[country], a=a, b=b, s=a + b, x=x, y=y,
                  big=max(x, y), small=min(x, y), d=day, nd=NEXT_DAY[day], n=name,
                  joke=rng.choice(JOKES), t=topic, T=topic[0].upper() + topic[1:],
                  a4=a + 4, seq=", ".join(str(i) for i in range(a, a + 5)), w=w,
                  spelled="-".join(w))
    question = template.format(**fields)
    if split != "novel" and rng.random() < 0.5:
        question = C.wrap(question, rng)
    return question, answer.format(**fields)


def _space(split: str) -> str:
    """The generated tool space's split for a corpus split: held-out data uses unseen functions."""
    return "train" if split == "train" else "unseen"


def no_tool_episode(rng: random.Random, split: str = "train", think: bool = False,
                    generated: bool = False) -> dict:
    """A question that needs no tool, with catalogue tools offered (or generated ones)."""
    question, answer = _plain_qa(rng, split)
    tools = (T.random_tools(rng, _space(split)) if generated else
             [f.schema() for f in rng.sample(C.FUNCTIONS, rng.randint(2, 4))])
    turn = {"role": "assistant", "content": answer}
    if think:
        turn["reasoning_content"] = "No tool is needed for this. I will answer directly."
    return {"kind": "no_tool_gen" if generated else "no_tool", "tools": tools, "enable_thinking": think,
            "messages": _system(rng) + [{"role": "user", "content": question}, turn]}


def chat_episode(rng: random.Random, split: str = "train", think: bool = False) -> dict:
    messages = _system(rng)
    for _ in range(rng.randint(1, 3)):
        q, a = _plain_qa(rng, split)
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    if think:
        messages[-1]["reasoning_content"] = "A simple question. I will answer it."
    return {"kind": "chat", "messages": messages, "tools": None, "enable_thinking": think}


CODE_TASKS = [
    ("adds two numbers", "def {f}(a, b):\n    return a + b"),
    ("multiplies two numbers", "def {f}(a, b):\n    return a * b"),
    ("reverses a string", "def {f}(text):\n    return text[::-1]"),
    ("checks whether a number is even", "def {f}(n):\n    return n % 2 == 0"),
    ("returns the largest item of a list", "def {f}(items):\n    return max(items)"),
    ("counts the words in a sentence", "def {f}(sentence):\n    return len(sentence.split())"),
    ("computes a factorial", "def {f}(n):\n    result = 1\n    for i in range(2, n + 1):\n"
                             "        result *= i\n    return result"),
    ("greets a person by name", "def {f}(name):\n    return f\"Hello, {{name}}!\""),
    ("squares every number in a list", "def {f}(numbers):\n    return [x * x for x in numbers]"),
    ("sums a list of numbers", "def {f}(numbers):\n    total = 0\n    for x in numbers:\n"
                               "        total += x\n    return total"),
]
VERBS = "compute make get build find check count sum parse format".split()
NOUNS = "total result value answer score items data text list record".split()


def code_episode(rng: random.Random, split: str = "train") -> dict:
    task, body = rng.choice(CODE_TASKS)
    f = f"{rng.choice(VERBS)}_{rng.choice(NOUNS)}"
    asks = ["Write a Python function named {f} that {t}.", "Implement {f} in Python: it {t}.",
            "I need a Python function {f} that {t}."]
    ask = (rng.choice(asks[:-1]) if split == "train" else asks[-1]).format(f=f, t=task)
    answer = f"```python\n{body.format(f=f)}\n```"
    return {"kind": "code", "tools": None, "enable_thinking": False,
            "messages": _system(rng) + [{"role": "user", "content": ask},
                                        {"role": "assistant", "content": answer}]}


def json_episode(rng: random.Random, split: str = "train") -> dict:
    name, city = rng.choice(C.NAMES), rng.choice(C.CITIES)
    age, qty = rng.randint(18, 90), rng.randint(1, 12)
    food, ticker = rng.choice(C.FOODS), rng.choice(C.TICKERS)
    price = f"{rng.randint(5, 900)}.{rng.randint(0, 99):02d}"
    options = [
        ({"name": name, "city": city}, ["Return JSON with the keys name and city for {name} who lives in {city}.",
                                         "Give me a JSON object: {name} lives in {city}. Use keys name and city.",
                                         "As JSON with name and city: {name}, {city}."]),
        ({"name": name, "age": age}, ["Reply with JSON {{\"name\": string, \"age\": integer}} for {name}, aged {age}.",
                                      "Make a JSON object for {name} who is {age} years old, keys name and age.",
                                      "JSON please: name {name}, age {age}."]),
        ({"item": food, "quantity": qty}, ["Output JSON with item and quantity for an order of {qty} {food}.",
                                            "Encode the order {qty} {food} as JSON with keys item and quantity.",
                                            "As JSON (item, quantity): {qty} {food}."]),
        ({"ticker": ticker, "price": float(price)}, [
            "Respond only with JSON matching {{\"type\": \"object\", \"properties\": {{\"ticker\": {{\"type\": \"string\"}}, \"price\": {{\"type\": \"number\"}}}}}}: {ticker} costs {price}.",
            "Write {ticker} at {price} as JSON with keys ticker and price.",
            "JSON for ticker {ticker} priced {price}."]),
    ]
    obj, asks = rng.choice(options)
    ask = (rng.choice(asks[:-1]) if split == "train" else asks[-1]).format(
        name=name, city=city, age=age, qty=qty, food=food, ticker=ticker, price=price)
    return {"kind": "json", "tools": None, "enable_thinking": False,
            "messages": _system(rng) + [{"role": "user", "content": ask},
                                        {"role": "assistant", "content": json.dumps(obj)}]}


def _copy_item(rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.3:
        return C.made_up_word(rng)
    if roll < 0.5:
        return str(rng.randint(1, 99999))
    pool = rng.choice([C.CITIES, C.NAMES, C.TICKERS, C.CURRENCIES, C.WORDS, C.LANGUAGES, C.CRYPTO])
    return rng.choice(pool)


def copy_episode(rng: random.Random, split: str = "train") -> dict:
    """Copy drills: the skill tool arguments need, in concentrated form."""
    items = [_copy_item(rng) for _ in range(rng.randint(1, 6))]
    roll = rng.random()
    if roll < 0.4:
        ask = rng.choice(["Repeat exactly: ", "Say back: ", "Echo this: ", "Copy: "]) + " ".join(items)
        answer = " ".join(items)
    elif roll < 0.7:
        target = rng.choice(items)
        filler = rng.choice(["I met {v} yesterday.", "The code is {v}.", "We talked about {v} at lunch.",
                             "Please note {v} for later.", "My favourite is {v}."])
        ask = f"{filler.format(v=target)} Which word did I mention? Answer with it only."
        answer = target
    else:
        key = rng.choice(["id", "code", "label", "tag", "key"])
        ask = f"Put {items[0]} into a field called {key}."
        answer = f"<{key}>\n{items[0]}\n</{key}>"
    return {"kind": "copy", "tools": None, "enable_thinking": False,
            "messages": [{"role": "user", "content": ask}, {"role": "assistant", "content": answer}]}


def document(rng: random.Random, mix: dict[str, float], split: str = "train") -> dict:
    kind = rng.choices(list(mix), weights=list(mix.values()))[0]
    think = rng.random() < 0.25
    if kind == "tool":
        return tool_episode(rng, split, think)
    if kind == "parallel":
        return parallel_episode(rng, split, think)
    if kind in ("no_tool", "no_tool_gen"):
        return no_tool_episode(rng, split, think, generated=kind == "no_tool_gen")
    if kind == "gen_tool":
        return T.tool_episode(rng, _space(split), think)
    if kind == "gen_two":
        return T.two_tool_episode(rng, _space(split), think)
    if kind == "gen_no_fit":
        return T.no_fit_episode(rng, _space(split), think)
    if kind == "agent":
        return agent_episode(rng, split)
    if kind == "chat":
        return chat_episode(rng, split, think)
    if kind == "code":
        return code_episode(rng, split)
    if kind == "json":
        return json_episode(rng, split)
    return copy_episode(rng, split)


# ----------------------------------------------------------------------------- held-out evaluation
@dataclass
class ToolPrompt:
    """One held-out prompt: what to send, and what a correct answer is."""
    messages: list[dict]
    tools: list[dict]
    expected: dict | None  # {"name": ..., "arguments": {...}} or None when no tool is needed
    value_kind: str  # "pool", "made_up" or "none"
    # a request that needs several calls: every expected call, in order (expected is the first)
    expected_all: list[dict] | None = None


def heldout_tool_prompts(n: int = 120, seed: int = 1234, made_up: bool = False,
                         phrasing: str = "heldout") -> list[ToolPrompt]:
    """Prompts whose (function, value) pairs training never showed. phrasing="heldout" (the
    default): frame x request sentences training never showed; "novel": whole sentences with
    words training never used for that function; "train": trained wordings, new values only."""
    rng = random.Random(seed + (1 if made_up else 0))
    out = []
    functions = [f for f in C.FUNCTIONS
                 if not made_up or any(p.sample in C.MADE_UP_OK for p in f.params)]
    for i in range(n):
        fn = functions[i % len(functions)]
        args = sample_args(fn, rng, "heldout", made_up=1.0 if made_up else 0.0)
        user = request_text(fn, args, rng, phrasing)
        out.append(ToolPrompt(messages=[{"role": "user", "content": user}],
                              tools=offered_tools([fn], rng, 2, 4),
                              expected={"name": fn.name, "arguments": typed(fn, args)},
                              value_kind="made_up" if made_up else "pool"))
    return out


def heldout_plain_prompts(n: int = 60, seed: int = 4321, phrasing: str = "heldout") -> list[ToolPrompt]:
    """Requests that need no tool, with 2-4 tools offered; phrasing as in heldout_tool_prompts."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        question, _answer = _plain_qa(rng, phrasing)
        tools = [f.schema() for f in rng.sample(C.FUNCTIONS, rng.randint(2, 4))]
        out.append(ToolPrompt(messages=[{"role": "user", "content": question}], tools=tools,
                              expected=None, value_kind="none"))
    return out


def heldout_documents(n: int = 300, seed: int = 999, mix: dict[str, float] = MIX) -> list[dict]:
    """Whole documents (with answers) of every kind of `mix`, for held-out loss per kind."""
    rng = random.Random(seed)
    return [document(rng, mix, split="heldout") for _ in range(n)]


def _unseen_requests(n: int, seed: int, offered: bool) -> list[ToolPrompt]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        tool = T._pick(rng, "unseen")
        values = T.sample_values(tool, rng)
        others = T._other_tools({tool.name}, "unseen", rng, rng.randint(1, 4) if offered else rng.randint(2, 5),
                                near=(tool.verb, tool.obj))
        messages = [{"role": "user", "content": T.request_text(tool, values, rng)}]
        out.append(ToolPrompt(messages=messages, tools=T._offer([tool] if offered else [], others, rng),
                              expected={"name": tool.name, "arguments": dict(values)} if offered else None,
                              value_kind="unseen" if offered else "none"))
    return out


def unseen_tool_prompts(n: int = 120, seed: int = 2468) -> list[ToolPrompt]:
    """Requests for generated functions training never showed (name, description and at least
    one parameter name held out), offered among decoys that share the verb or the object."""
    return _unseen_requests(n, seed, offered=True)


def unseen_no_fit_prompts(n: int = 60, seed: int = 1357) -> list[ToolPrompt]:
    """Requests for an unseen function that is not offered: only decoys sharing its words."""
    return _unseen_requests(n, seed, offered=False)


def unseen_plain_prompts(n: int = 60, seed: int = 8642) -> list[ToolPrompt]:
    """Questions that need no tool (held-out wordings), with unseen generated tools offered."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        question, _answer = _plain_qa(rng, "heldout")
        out.append(ToolPrompt(messages=[{"role": "user", "content": question}],
                              tools=T.random_tools(rng, "unseen"), expected=None, value_kind="none"))
    return out


def unseen_two_tool_prompts(n: int = 40, seed: int = 9753) -> list[ToolPrompt]:
    """One request that needs two different unseen functions."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        doc = T.two_tool_episode(rng, "unseen")
        calls = [c["function"] for c in doc["messages"][1]["tool_calls"]]
        out.append(ToolPrompt(messages=doc["messages"][:1], tools=doc["tools"], expected=calls[0],
                              value_kind="unseen", expected_all=calls))
    return out
